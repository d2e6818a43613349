"""Requests a front-end process sends the core as one group (gpud.frontproc.group): the rule that says which may go
together, the cut into groups of at most the model's batch, the answer split back by rows; a front-end process's
RemoteCore sending a turn's requests alike as one message (their rows one after another in its arena) and handing
each its part of the answer; the core's FrontendHost submitting a group as one request of n members, cutting it at
the limit, and submitting each member alone where the group is refused."""
from __future__ import annotations

import asyncio
import dataclasses
import os
import socket

import numpy as np
import pytest

from gpud.executor.client_shm import NO_DATA
from gpud.executor.types import (ErrorKind, InferenceError, InferRequest, InferResponse, InferTensor, RequestedOutput,
                                 ShmRef)
from gpud.frontproc.arena import Arena
from gpud.frontproc.group import group_key, group_sizes, split_answer
from gpud.frontproc.link import FrameReader, request_of, response_wire
from tests.fakes import replaces_functions_of


def request(rows: int = 1, value: float = 0.0, **changes) -> InferRequest:
    r = InferRequest("m", [InferTensor("x", "FP32", (rows, 4), np.full((rows, 4), value, np.float32)),
                           InferTensor("y", "INT64", (rows, 2), np.zeros((rows, 2), np.int64))],
                     outputs=[RequestedOutput("out", {"binary_data": True})])
    return dataclasses.replace(r, **changes)


class TestGroupKey:
    def test_requests_that_differ_only_in_their_data_share_a_key(self):
        assert group_key(request(value=1.0)) == group_key(request(value=2.0)) is not None

    def test_front_end_parameters_and_ids_do_not_matter(self):
        # binary_data_output and an output's binary_data only say how the front end writes the answer; nothing in
        # gpud acts on triton_enable_empty_final_response (perf_analyzer sends it); each member's answer gets its id
        a = request(parameters={"binary_data_output": True})
        b = request(outputs=[RequestedOutput("out", {"binary_data": False})])
        c = request(id="281474976710656", parameters={"triton_enable_empty_final_response": True})
        assert group_key(a) == group_key(b) == group_key(c) == group_key(request(id="7")) == group_key(request())

    @pytest.mark.parametrize("changes", [
        {"model_name": "other"},
        {"model_version": "2"},
        {"outputs": None},  # every output
        {"outputs": [RequestedOutput("other")]},
    ], ids=["model", "version", "all-outputs", "other-output"])
    def test_what_the_core_or_the_answer_sees_separates_groups(self, changes):
        assert group_key(request(**changes)) not in (None, group_key(request()))

    def test_other_rows_or_shapes_or_datatypes_separate_groups(self):
        other_dtype = request()
        other_dtype.inputs[1] = InferTensor("y", "INT32", (1, 2), np.zeros((1, 2), np.int32))
        keys = {group_key(request(rows=1)), group_key(request(rows=2)), group_key(other_dtype)}
        assert None not in keys and len(keys) == 3

    @pytest.mark.parametrize("changes", [
        {"priority": 1},
        {"timeout_us": 1000},
        {"parameters": {"sequence_id": 3}},
        {"parameters": {"binary_data_output": True, "sequence_start": True}},
        {"outputs": [RequestedOutput("out", {"classification": 2})]},
        {"outputs": [RequestedOutput("out", {}, ShmRef("r", 0, 64))]},
        {"uses_shm": True},
    ], ids=["priority", "timeout", "sequence", "sequence-and-binary", "classification", "output-shm", "uses-shm"])
    def test_anything_of_its_own_the_core_acts_on_goes_alone(self, changes):
        assert group_key(request(**changes)) is None

    def test_text_scalars_data_elsewhere_and_no_inputs_go_alone(self):
        text = request()
        text.inputs[0] = InferTensor("x", "BYTES", (1,), np.array([b"a"], dtype=object))
        scalar = request()
        scalar.inputs[0] = InferTensor("x", "FP32", (), np.float32(1.0))
        empty = request(rows=0)
        placed = request()
        placed.inputs[0].data = NO_DATA
        for r in (text, scalar, empty, placed, request(inputs=[])):
            assert group_key(r) is None


class TestGroupSizes:
    @pytest.mark.parametrize("count, limit, sizes", [
        (5, 2, [2, 2, 1]),  # 2 + 2 + 1 = 5
        (64, 64, [64]),
        (65, 64, [64, 1]),
        (3, 1, [1, 1, 1]),  # a model that does not batch them: each alone
        (3, 0, [1, 1, 1]),
        (0, 8, []),
    ])
    def test_cut_at_the_limit(self, count, limit, sizes):
        assert group_sizes(count, limit) == sizes


class TestSplitAnswer:
    def test_each_member_gets_its_rows_in_order(self):
        out = np.arange(3 * 2 * 4, dtype=np.float32).reshape(6, 4)  # 3 members of 2 rows
        other = np.arange(6, dtype=np.int64).reshape(6, 1)
        answer = InferResponse("m", "1", [InferTensor("out", "FP32", (6, 4), out),
                                          InferTensor("n", "INT64", (6, 1), other)], "id", {}, (1, 2, 3))
        parts = split_answer(answer, 3)
        assert len(parts) == 3
        for i, part in enumerate(parts):
            assert (part.model_name, part.model_version, part.id, part.compute_ns) == ("m", "1", "id", (1, 2, 3))
            assert [t.name for t in part.outputs] == ["out", "n"]
            assert part.outputs[0].shape == (2, 4) and part.outputs[1].shape == (2, 1)
            np.testing.assert_array_equal(part.outputs[0].data, out[2 * i:2 * i + 2])
            np.testing.assert_array_equal(part.outputs[1].data, other[2 * i:2 * i + 2])
        assert parts[0].parameters is not parts[1].parameters

    def test_rows_that_do_not_divide_are_refused(self):
        with pytest.raises(ValueError, match="5 rows"):
            split_answer(InferResponse("m", "1", [InferTensor("out", "FP32", (5, 1), np.zeros((5, 1)))]), 2)


# --- a front-end process's side: RemoteCore ----------------------------------------------------------------------
class _CoreEnd:
    """The core's end of the link: what the front end sent."""

    def __init__(self, sock: socket.socket):
        self.messages: list[tuple] = []
        self.reader = FrameReader(sock, self.messages.append)

    async def receive(self, count: int) -> list[tuple]:
        for _ in range(200):
            self.reader.read()
            if len(self.messages) >= count:
                break
            await asyncio.sleep(0.005)
        got = list(self.messages)
        self.messages.clear()  # the same list: the reader appends to it
        return got


def _send(sock: socket.socket, messages: list[tuple]) -> None:
    from gpud.frontproc.link import frame

    sock.setblocking(True)
    sock.sendall(frame(messages))
    sock.setblocking(False)


async def _answers_arrive(results: dict, count: int) -> None:
    for _ in range(200):
        if len(results) >= count:
            return
        await asyncio.sleep(0.005)


@pytest.fixture
def link():
    from gpud.frontproc.remote_core import RemoteCore

    ours, theirs = socket.socketpair()
    theirs.setblocking(False)
    arena = Arena(segment_bytes=1 << 16)
    core = RemoteCore(ours, arena)
    yield core, _CoreEnd(theirs), theirs, arena
    arena.close()
    ours.close()
    theirs.close()


def _read(placed: tuple, dtype, shape) -> np.ndarray:
    path, offset, nbytes = placed
    with open(path, "rb") as f:
        f.seek(offset)
        return np.frombuffer(f.read(nbytes), dtype).reshape(shape)


class TestRemoteCore:
    def test_a_turns_requests_alike_go_as_one_group_the_rest_alone(self, link):
        core, end, theirs, arena = link

        async def run():
            core.start()
            results: dict[int, object] = {}
            for i in range(3):  # ids of their own (perf_analyzer's): one group all the same, each answered with its own
                core.submit(request(value=float(i), id=f"id{i}" if i else ""),
                            lambda r, i=i: results.__setitem__(i, r))
            core.submit(request(rows=2), lambda r: results.__setitem__(9, r))  # other rows: alone
            messages = await end.receive(2)
            kinds = sorted(m[0] for m in messages)
            assert kinds == ["group", "submit"]
            group = next(m for m in messages if m[0] == "group")
            _, idents, wire, placed, token = group
            assert len(idents) == 3 and token is None
            member = request_of(wire)
            assert member.inputs[0].shape == (1, 4) and member.inputs[0].data is NO_DATA
            x = _read(placed["x"], np.float32, (3, 4))  # each member's rows, one after another
            np.testing.assert_array_equal(x, [[0.0] * 4, [1.0] * 4, [2.0] * 4])
            assert placed["y"][2] == 3 * 2 * 8
            # the answer: 3 members' rows; each gets its own
            out = np.arange(3, dtype=np.float32).reshape(3, 1)
            _send(theirs, [("answers", idents, True,
                            response_wire(InferResponse("m", "1", [InferTensor("out", "FP32", (3, 1), out)])))])
            await _answers_arrive(results, 3)
            core._readable()
            for i in range(3):
                assert results[i].outputs[0].shape == (1, 1) and results[i].outputs[0].data[0, 0] == i
                assert results[i].id == (f"id{i}" if i else "")
            assert 9 not in results
        asyncio.run(run())

    def test_an_error_reaches_every_member_each_its_own_and_a_withdrawn_one_hears_nothing(self, link):
        core, end, theirs, arena = link

        async def run():
            core.start()
            results: dict[int, object] = {}
            cancels = [core.submit(request(), lambda r, i=i: results.__setitem__(i, r)) for i in range(3)]
            (_, idents, _, _, _), = await end.receive(1)
            cancels[1]()  # its client went away
            _send(theirs, [("answers", idents, False, InferenceError(ErrorKind.UNAVAILABLE, "queue full"))])
            await asyncio.sleep(0.01)
            core._readable()
            assert sorted(results) == [0, 2]
            assert results[0] is not results[2]
            assert all(isinstance(r, InferenceError) and r.kind is ErrorKind.UNAVAILABLE for r in results.values())
            # the group's blocks went back to the arena with its last member: the next takes the same place
            block = arena.put(np.zeros(1, np.float32))[1]
            assert block.offset == 0
        asyncio.run(run())

    def test_a_member_withdrawn_before_the_turn_ends_is_not_sent(self, link):
        core, end, theirs, arena = link

        async def run():
            core.start()
            cancel = core.submit(request(), lambda r: None)
            core.submit(request(), lambda r: None)
            cancel()
            messages = await end.receive(2)
            submits = [m for m in messages if m[0] in ("submit", "group")]
            assert [m[0] for m in submits] == ["submit"]  # the one left goes alone
        asyncio.run(run())


    @replaces_functions_of("gpud.frontproc.remote_core")
    def test_an_answer_that_cannot_be_read_is_an_error_for_its_requests_and_the_next_answers_still_arrive(
            self, link, monkeypatch):
        """Reading an answer raised (its segment gone, memory): the request was already taken off the waiting list,
        so it never heard anything, and the exception left the messages read after it unhandled."""
        import gpud.frontproc.remote_core as remote_core

        core, end, theirs, arena = link
        real = remote_core.response_of
        calls = []

        def response_of(wire):
            calls.append(wire)
            if len(calls) <= 2:  # the lone request's answer, then the group's
                raise OSError("No such file or directory")
            return real(wire)
        monkeypatch.setattr(remote_core, "response_of", response_of)

        async def run():
            core.start()
            results: dict[int, object] = {}
            core.submit(request(rows=2), lambda r: results.__setitem__("alone", r))
            for i in range(2):
                core.submit(request(), lambda r, i=i: results.__setitem__(i, r))
            messages = await end.receive(2)
            alone = next(m for m in messages if m[0] == "submit")
            group = next(m for m in messages if m[0] == "group")
            ok = response_wire(InferResponse("m", "1", [InferTensor("out", "FP32", (2, 1), np.ones((2, 1)))]))
            handed: list[str] = []  # a large output comes in a segment of its own: removed though never read
            big = response_wire(InferResponse("m", "1", [InferTensor("out", "FP32", (2, 32768),
                                                                     np.ones((2, 32768), np.float32))]), handed.append)
            assert len(handed) == 1 and os.path.exists(f"/dev/shm/{handed[0]}")
            _send(theirs, [("answer", alone[1], True, big), ("answers", group[1], True, ok)])
            core.submit(request(rows=3), lambda r: results.__setitem__("next", r))
            (nxt,) = await end.receive(1)
            out3 = response_wire(InferResponse("m", "1", [InferTensor("out", "FP32", (3, 1), np.ones((3, 1)))]))
            _send(theirs, [("answer", nxt[1], True, out3)])
            await _answers_arrive(results, 4)
            assert all(isinstance(results[k], InferenceError) and results[k].kind is ErrorKind.INTERNAL
                       and "could not be read" in results[k].message for k in ("alone", 0, 1))
            assert results[0] is not results[1]
            assert isinstance(results["next"], InferResponse)
            assert not os.path.exists(f"/dev/shm/{handed[0]}")
        asyncio.run(run())

    def test_an_answer_handed_over_in_a_segment_for_withdrawn_requests_removes_the_segment(self, link):
        """A large output comes back in a shared-memory segment of its own, which the receiver removes when it maps
        it. An answer that crosses its request's withdrawal (a gRPC client that cancelled, gone) was dropped
        unread, its segment left in /dev/shm for good: alone, and a group whose members were all withdrawn."""
        from gpud.executor.shm import segment_path

        core, end, theirs, arena = link
        big = np.ones((1, 20000), np.float32)  # over HANDOFF_MIN_BYTES: handed over in a segment

        async def run():
            core.start()
            alone = core.submit(request(priority=1), lambda r: None)  # (a priority: sent alone)
            together = [core.submit(request(), lambda r: None) for _ in range(2)]
            messages = await end.receive(2)
            ident = next(m[1] for m in messages if m[0] == "submit")
            idents = next(m[1] for m in messages if m[0] == "group")
            alone()
            for cancel in together:
                cancel()
            handed: list[str] = []
            answer = InferResponse("m", "1", [InferTensor("out", "FP32", big.shape, big)])
            group_answer = InferResponse("m", "1", [InferTensor("out", "FP32", (2, 20000), np.ones((2, 20000),
                                                                                                   np.float32))])
            _send(theirs, [("answer", ident, True, response_wire(answer, handed.append)),
                           ("answers", idents, True, response_wire(group_answer, handed.append))])
            core._readable()
            assert len(handed) == 2
            assert [name for name in handed if os.path.exists(segment_path(name))] == []
        asyncio.run(run())


# --- the core's side: FrontendHost ---------------------------------------------------------------------------------
class _FakeCore:
    """A core that records what it was given: groups refused when `refuse` says so, everything answered at once
    with each row's first input value doubled."""

    def __init__(self, limit: int, refuse=lambda request, members: False):
        self.limit = limit
        self.refuse = refuse
        self.submitted: list[tuple[tuple, int, dict]] = []

    def group_limit(self, request: InferRequest) -> int:
        return self.limit

    def submit(self, request, done, placed=None, members=1):
        if self.refuse(request, members):
            raise InferenceError(ErrorKind.UNAVAILABLE, "queue full")
        self.submitted.append((tuple(request.inputs[0].shape), members, dict(placed or {})))
        rows = request.inputs[0].shape[0]
        done(InferResponse(request.model_name, "1", [InferTensor("out", "FP32", (rows, 1),
                                                                 np.zeros((rows, 1), np.float32))]))
        return lambda: None


class _Sent:
    def __init__(self):
        self.messages: list[tuple] = []

    def put(self, message):
        self.messages.append(message)


def _host(core):
    from gpud.api.admin import AdminAuth
    from gpud.frontproc.host import FrontendHost, FrontendProcess

    host = FrontendHost(core, AdminAuth(), 1, socket.socket(), {"kind": "http"})
    fp = FrontendProcess(0, None, socket.socket())
    fp.sender = _Sent()
    return host, fp


def _group_message(count: int, member: InferRequest | None = None) -> tuple:
    from gpud.frontproc.link import request_wire

    member = member or request()
    placed = {"x": ("/dev/shm/f", 4096, count * 16), "y": ("/dev/shm/f", 8192, count * 16)}
    return ("group", list(range(100, 100 + count)), request_wire(member), placed, None)


class TestFrontendHost:
    def test_a_group_is_one_request_of_its_members_rows_cut_at_the_limit(self):
        core = _FakeCore(limit=2)
        host, fp = _host(core)
        host._on_message(fp, _group_message(5))
        # 5 members, at most 2 at once: 2 + 2 as groups, the last alone (its own rows)
        assert [(shape, members) for shape, members, _ in core.submitted] == [((2, 4), 2), ((2, 4), 2), ((1, 4), 1)]
        x = [placed["x"] for _, _, placed in core.submitted]
        assert [(s.offset, s.byte_size) for s in x] == [(4096, 32), (4096 + 32, 32), (4096 + 64, 16)]
        answers = fp.sender.messages
        assert [m[0] for m in answers] == ["answers", "answers", "answer"]
        assert [m[1] for m in answers] == [[100, 101], [102, 103], 104]
        assert fp.grouped == 5 and not fp.submits

    def test_a_refused_group_goes_member_by_member_each_with_its_own_outcome(self):
        # a queue with room for one more: the group of 3 does not fit whole; alone, the first fits, the others not
        room = [1]

        def refuse(request, members):
            if members > room[0]:
                return True
            room[0] -= members
            return False
        core = _FakeCore(limit=8, refuse=refuse)
        host, fp = _host(core)
        host._on_message(fp, _group_message(3))
        assert [(shape, members) for shape, members, _ in core.submitted] == [((1, 4), 1)]
        answers = fp.sender.messages
        assert [(m[0], m[1], m[2]) for m in answers] == [("answer", 100, True), ("answer", 101, False),
                                                         ("answer", 102, False)]

    def test_what_the_model_says_of_one_it_says_of_each(self):
        class Unknown(_FakeCore):
            def group_limit(self, request):
                raise InferenceError(ErrorKind.NOT_FOUND, "unknown model: 'm'")
        host, fp = _host(Unknown(limit=8))
        host._on_message(fp, _group_message(2))
        answers = fp.sender.messages
        assert [(m[0], m[1], m[2], m[3].kind) for m in answers] == [("answer", 100, False, ErrorKind.NOT_FOUND),
                                                                    ("answer", 101, False, ErrorKind.NOT_FOUND)]
        assert answers[0][3] is not answers[1][3]

    @replaces_functions_of("gpud.frontproc.host")
    def test_an_answer_that_cannot_be_staged_for_the_front_end_is_an_error_for_its_requests(self, monkeypatch):
        """Staging an answer for its front-end process raised (/dev/shm full): its requests were already taken off
        the waiting list and never heard anything."""
        import gpud.frontproc.host as host_module

        def response_wire(result, handed=None):
            raise OSError(28, "No space left on device")
        monkeypatch.setattr(host_module, "response_wire", response_wire)
        host, fp = _host(_FakeCore(limit=2))
        host._on_message(fp, _group_message(3))  # 2 as a group, the last alone
        answers = fp.sender.messages
        assert [(m[0], m[1], m[2]) for m in answers] == [("answers", [100, 101], False), ("answer", 102, False)]
        assert all(m[3].kind is ErrorKind.INTERNAL and "No space left on device" in m[3].message for m in answers)
        assert not fp.submits

    def test_a_group_is_withdrawn_only_when_all_its_members_are(self):
        cancelled = []

        class Holding(_FakeCore):
            def submit(self, request, done, placed=None, members=1):
                self.submitted.append((tuple(request.inputs[0].shape), members, {}))
                return lambda: cancelled.append(members)
        host, fp = _host(Holding(limit=8))
        host._on_message(fp, _group_message(2))
        host._on_message(fp, ("cancel", 100))
        assert cancelled == []
        host._on_message(fp, ("cancel", 101))
        assert cancelled == [2]

    def test_a_member_withdrawn_alone_is_told_to_the_core_so_it_is_not_counted(self):
        from gpud.core import GroupCancel
        from gpud.executor.scheduler import RequestHandle
        calls = []
        handle = RequestHandle()  # (a real one: the compiled GroupCancel checks its type)

        class Recording:
            def cancel(self, handle):
                calls.append(("cancel", handle))

            def withdraw_member(self, handle):
                calls.append(("one", handle))

        class Holding(_FakeCore):
            def submit(self, request, done, placed=None, members=1):
                self.submitted.append((tuple(request.inputs[0].shape), members, {}))
                return GroupCancel(Recording(), handle)
        host, fp = _host(Holding(limit=8))
        host._on_message(fp, _group_message(3))
        host._on_message(fp, ("cancel", 100))
        host._on_message(fp, ("cancel", 102))
        assert calls == [("one", handle), ("one", handle)]
        host._on_message(fp, ("cancel", 101))
        assert calls[-1] == ("cancel", handle)


def test_a_stopping_host_refuses_new_connections_once_its_processes_have_closed_theirs():
    """The processes accept on the daemon's listening socket, each with a descriptor of its own. Told to stop, each
    closes its own; the daemon held its copy until they had all exited, so meanwhile a new client's connection was
    queued by the kernel, never accepted, and reset at the end (after the client had sent its request), where the
    in-process front end refuses it at once."""
    from gpud.api.admin import AdminAuth
    from gpud.frontproc.host import FrontendHost, FrontendProcess

    listen = socket.create_server(("127.0.0.1", 0))
    port = listen.getsockname()[1]
    refused: list[bool] = []

    class _Exiting:
        """A process that has closed its descriptor of the socket and is exiting: the first poll says it runs."""
        pid = 2 ** 22 + 1  # (no arena of its own to remove)
        polls = 0

        def poll(self):
            self.polls += 1
            if self.polls == 1:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=5).close()
                    refused.append(False)
                except ConnectionRefusedError:
                    refused.append(True)
                return None
            return 0

    class _Sender(_Sent):
        def flush(self):
            pass

    async def run():
        host = FrontendHost(_FakeCore(1), AdminAuth(), 1, listen, {"kind": "http"})
        host._loop = asyncio.get_running_loop()
        fp = FrontendProcess(0, _Exiting(), socket.socket())
        fp.sender = _Sender()
        host.processes[0] = fp
        await host.stop(5)
        assert fp.sender.messages == [("stop", 5)]
    try:
        asyncio.run(run())
    finally:
        listen.close()
    assert refused == [True]
