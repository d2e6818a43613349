"""gpud.executor.dynamic_scheduler's callback API (submit/cancel/_on_reply/_collect/_answer/_split).

A scripted worker answers batches from the instance's real shared-memory segments; no sleeps, no processes."""
from __future__ import annotations

import asyncio
import gc
import weakref

import numpy as np
import pytest

from gpud.executor.bytes_tensor import encode_bytes_elements
from gpud.executor.model_config import DynamicBatching, ModelConfig, TensorSpec
from gpud.executor.instance import InstanceHandle
from gpud.executor.protocol import Done, Infer, TensorMeta
from gpud.executor.dynamic_scheduler import DynamicScheduler
from gpud.executor.shm import Segment, align, new_segment_name
from gpud.executor.types import ClientIO, ErrorKind, InferenceError, InferRequest, InferResponse, InferTensor, RegionSlice
from gpud.executor.types import RequestedOutput, ShmRef

TWO_OUTPUTS = ModelConfig(name="m", max_batch_size=8, inputs=(TensorSpec("x", "FP32", (2,)),),
                          outputs=(TensorSpec("y", "FP32", (2,)), TensorSpec("z", "FP32", (2,))),
                          dynamic_batching=DynamicBatching())
UNBATCHED = ModelConfig(name="u", max_batch_size=0, inputs=(TensorSpec("x", "FP32", (2,)),),
                        outputs=(TensorSpec("y", "FP32", (2,)),))
WITH_BYTES = ModelConfig(name="b", max_batch_size=8, inputs=(TensorSpec("x", "FP32", (1,)),),
                         outputs=(TensorSpec("s", "BYTES", (1,)),), dynamic_batching=DynamicBatching())


def _compute(name: str, x: np.ndarray) -> np.ndarray:
    if name == "y":
        return 2 * x
    if name == "z":
        return x + 100
    if name == "s":  # BYTES: the text of each value
        out = np.empty(x.shape, dtype=object)
        out.reshape(-1)[:] = [str(int(v)).encode() for v in x.reshape(-1)]
        return out
    raise AssertionError(name)


class Worker:
    """Shared by any number of instances (of one or several models): batches are answered in order by `finish`,
    or by `poll()` when `on_poll` says so (what the real WorkerSupervisor.poll does when replies are waiting)."""

    def __init__(self):
        self.pending: list[tuple[InstanceHandle, Infer, object]] = []
        self.instances: dict[str, InstanceHandle] = {}
        self.on_poll = None
        self.polls = 0

    def submit(self, msg, callback):
        self.pending.append((self.instances[msg.key], msg, callback))

    def poll(self):
        self.polls += 1
        if self.on_poll is not None:
            self.on_poll()

    def reply(self, inst: InstanceHandle, msg: Infer) -> Done:
        name, _, shape, offset, _ = msg.inputs[0]
        x = inst.in_seg.ndarray(offset, shape, np.float32).copy()
        outputs, off = [], 0
        for out_name, out_type in zip(msg.outputs, msg.output_types):
            arr = _compute(out_name, x)
            if out_type == "BYTES":
                blob = encode_bytes_elements(arr)
                inst.out_seg.buf[off:off + len(blob)] = blob
                nbytes = len(blob)
            else:
                inst.out_seg.ndarray(off, arr.shape, np.float32)[...] = arr
                nbytes = arr.nbytes
            outputs.append(TensorMeta(out_name, out_type, tuple(arr.shape), off, nbytes))
            off += align(nbytes)
        return Done(msg.seq, tuple(outputs), "", 1, 2, 3)

    def finish(self, index: int = 0) -> None:
        inst, msg, callback = self.pending.pop(index)
        callback(self.reply(inst, msg))

    def die(self, error: InferenceError) -> None:
        """What WorkerSupervisor._on_death does: every instance unready first, then every in-flight batch failed."""
        for inst in self.instances.values():
            if inst.ready:
                inst.ready = False
                if inst.on_ready_change:
                    inst.on_ready_change(inst)
        pending, self.pending = self.pending, []
        for _, _, callback in pending:
            callback(error)


def _instance(worker: Worker, config: ModelConfig, index: int = 0) -> InstanceHandle:
    key = f"{config.name}/1/{index}"
    inst = InstanceHandle(key=key, model=config.name, version="1", index=index, device_id="cpu", model_path="",
                          config=config, estimate_bytes=0, worker=worker, ready=True,
                          in_seg=Segment.create(new_segment_name("in"), 1 << 16),
                          out_seg=Segment.create(new_segment_name("out"), 1 << 16))
    worker.instances[key] = inst
    return inst


@pytest.fixture
def made():
    instances: list[InstanceHandle] = []

    def make(config: ModelConfig, worker: Worker, n: int = 1) -> tuple[DynamicScheduler, list[InstanceHandle]]:
        scheduler = DynamicScheduler(config, "1")
        insts = [_instance(worker, config, i) for i in range(n)]
        for inst in insts:
            scheduler.add_instance(inst)
        instances.extend(insts)
        return scheduler, insts

    yield make
    for inst in instances:
        inst.close_segments()


def _req(model: str, values, outputs=None) -> InferRequest:
    x = np.asarray(values, np.float32).reshape(-1, 1 if model == "b" else 2)
    if model == "u":
        x = x.reshape(2)
    return InferRequest(model, [InferTensor("x", "FP32", x.shape, x)],
                        outputs=None if outputs is None else [RequestedOutput(n) for n in outputs])


# ---------------------------------------------------------------------------------------------------------------------
# Fixed bugs (each test failed before its fix)
# ---------------------------------------------------------------------------------------------------------------------
def test_an_answered_request_is_freed_without_the_cyclic_gc(made):
    worker = Worker()
    scheduler, _ = made(TWO_OUTPUTS, worker)

    async def run():
        request = _req("m", [1, 2])
        body = weakref.ref(request.inputs[0].data)
        got = []
        scheduler.submit(request, got.append)
        del request
        worker.finish()
        assert isinstance(got[0], InferResponse)
        return body

    enabled = gc.isenabled()
    gc.disable()
    try:
        body = asyncio.run(run())
        # The 1c3de28 scheduler let go of the request as soon as it was answered (refcount only).
        assert body() is None, "the request's input data is still alive after its answer"
    finally:
        if enabled:
            gc.enable()


def test_a_batch_whose_only_request_failed_writing_its_client_region_is_not_an_error_of_the_scheduler(made):
    """A request alone in its batch whose output did not fit the client's region (the worker's write error): the
    request fails with why, nothing succeeded to count, and the scheduler goes on (it raised from the statistics,
    "a batch has at least one request", and never signalled idle)."""
    worker = Worker()
    scheduler, _ = made(TWO_OUTPUTS, worker)

    async def run():
        request = _req("m", [1, 2], ["y"])
        request.client_io = ClientIO(outputs={"y": (ShmRef("r", 0, 4), RegionSlice("r", "/r", 0, 4))})
        got = []
        scheduler.submit(request, got.append)
        idle = asyncio.ensure_future(scheduler.wait_idle())
        await asyncio.sleep(0)
        inst, msg, callback = worker.pending.pop()
        callback(worker.reply(inst, msg)._replace(write_errors=((0, "INVALID_ARGUMENT", "should be at least 8 bytes"),)))
        assert len(got) == 1 and isinstance(got[0], InferenceError) and got[0].kind is ErrorKind.INVALID_ARGUMENT
        await asyncio.wait_for(idle, 1.0)
        scheduler.submit(_req("m", [3, 4]), got.append)  # and it serves on
        worker.finish()
        np.testing.assert_array_equal(got[1].outputs[0].data, [[6, 8]])

    asyncio.run(run())
    assert (scheduler.stats.success.count, scheduler.stats.fail.count) == (1, 1)


def test_a_request_whose_input_the_worker_could_not_read_fails_alone_with_its_kind(made):
    """The worker's read of one request's input from its region failed (Done.read_errors): that request fails with
    the read's error kind and message, its batch mate is answered, and the statistics count one of each."""
    worker = Worker()
    scheduler, _ = made(TWO_OUTPUTS, worker)

    async def run():
        got: dict[str, object] = {}
        scheduler.submit(_req("m", [0, 0]), lambda r: None)  # occupies the instance so the next two batch
        bad = _req("m", [1, 2], ["y"])
        bad.client_io = ClientIO(inputs={"x": RegionSlice("r", "/r", 0, 8)})
        scheduler.submit(bad, lambda r: got.setdefault("bad", r))
        scheduler.submit(_req("m", [3, 4], ["y"]), lambda r: got.setdefault("good", r))
        worker.finish()
        inst, msg, callback = worker.pending.pop()
        callback(worker.reply(inst, msg)._replace(read_errors=((0, "UNAVAILABLE", "region gone"),)))
        assert isinstance(got["bad"], InferenceError) and got["bad"].kind is ErrorKind.UNAVAILABLE
        assert got["bad"].message == "region gone"
        np.testing.assert_array_equal(got["good"].outputs[0].data, [[6, 8]])

    asyncio.run(run())
    assert (scheduler.stats.success.count, scheduler.stats.fail.count) == (2, 1)


def test_a_batch_its_worker_could_not_take_for_a_bug_fails_and_the_instance_serves_the_next(made):
    """worker.submit raising something other than InferenceError or OSError (a bug): the batch's requests were
    never answered, and the instance stayed 'running' for ever, so nothing after them ran either."""
    worker = Worker()
    scheduler, _ = made(TWO_OUTPUTS, worker)
    real_submit, calls = worker.submit, []

    def submit(msg, callback):
        calls.append(msg)
        if len(calls) == 1:
            raise RuntimeError("boom")
        real_submit(msg, callback)

    worker.submit = submit

    async def run():
        got = []
        scheduler.submit(_req("m", [1, 2]), got.append)
        assert len(got) == 1 and isinstance(got[0], InferenceError) and got[0].kind is ErrorKind.INTERNAL
        assert "RuntimeError: boom" in got[0].message
        scheduler.submit(_req("m", [3, 4]), got.append)
        worker.finish()
        np.testing.assert_array_equal(got[1].outputs[0].data, [[6, 8]])

    asyncio.run(run())
    assert (scheduler.stats.success.count, scheduler.stats.fail.count) == (1, 1)


def test_each_request_gets_its_outputs_in_its_own_order_whatever_its_batch_mates_asked(made):
    """A batch computes the union of its requests' outputs, in the order they first appear; each request's answer
    had them in that order, so the bytes of an answer depended on which requests it happened to be batched with (all
    outputs asked in the model's order came back in another request's order, and the reverse)."""
    worker = Worker()
    scheduler, _ = made(TWO_OUTPUTS, worker)

    async def run():
        got: dict[str, InferResponse] = {}
        scheduler.submit(_req("m", [0, 0]), lambda r: None)  # occupies the instance so the next ones batch
        scheduler.submit(_req("m", [1, 2], ["z", "y"]), lambda r: got.setdefault("zy", r))
        scheduler.submit(_req("m", [3, 4]), lambda r: got.setdefault("all", r))
        scheduler.submit(_req("m", [5, 6], ["y", "z"]), lambda r: got.setdefault("yz", r))
        worker.finish()
        worker.finish()
        assert [t.name for t in got["zy"].outputs] == ["z", "y"]
        assert [t.name for t in got["all"].outputs] == ["y", "z"]  # the model's order, as when it runs alone
        assert [t.name for t in got["yz"].outputs] == ["y", "z"]
        np.testing.assert_array_equal(got["all"].outputs[1].data, [[103, 104]])

    asyncio.run(run())


# ---------------------------------------------------------------------------------------------------------------------
# Tricky cases that are handled correctly
# ---------------------------------------------------------------------------------------------------------------------
def test_idle_is_signalled_only_after_the_finished_batch_is_answered(made):
    worker = Worker()
    scheduler, _ = made(TWO_OUTPUTS, worker)

    async def run():
        waiters_done_when_answered = []

        def done(result):
            waiters_done_when_answered.append([f.done() for f in scheduler._idle_waiters])

        scheduler.submit(_req("m", [1, 2]), done)
        idle = asyncio.ensure_future(scheduler.wait_idle())
        await asyncio.sleep(0)
        assert len(scheduler._idle_waiters) == 1 and not idle.done()
        worker.finish()
        # While the answer was delivered the waiter was not yet released; right after, it is.
        assert waiters_done_when_answered == [[False]]
        await asyncio.wait_for(idle, 1.0)

    asyncio.run(run())


def test_a_request_cancelled_while_its_batch_runs_is_not_answered_and_the_rest_is(made):
    worker = Worker()
    scheduler, _ = made(TWO_OUTPUTS, worker)

    async def run():
        got: dict[str, object] = {}
        scheduler.submit(_req("m", [0, 0]), lambda r: got.setdefault("first", r))
        a = scheduler.submit(_req("m", [1, 2]), lambda r: got.setdefault("a", r))
        scheduler.submit(_req("m", [3, 4]), lambda r: got.setdefault("b", r))
        worker.finish()  # a and b go together
        scheduler.cancel(a)  # the client of a leaves while the batch runs
        worker.finish()
        assert set(got) == {"first", "b"}
        np.testing.assert_array_equal(got["b"].outputs[0].data, [[6, 8]])
        assert scheduler.pending_requests == 0
        await asyncio.wait_for(scheduler.wait_idle(), 1.0)

    asyncio.run(run())


def test_each_request_of_a_batch_gets_exactly_the_outputs_it_asked_for(made):
    worker = Worker()
    scheduler, _ = made(TWO_OUTPUTS, worker)

    async def run():
        got: dict[str, InferResponse] = {}
        scheduler.submit(_req("m", [0, 0]), lambda r: None)  # occupies the instance so the next ones batch
        scheduler.submit(_req("m", [1, 2], ["z"]), lambda r: got.setdefault("z", r))
        scheduler.submit(_req("m", [3, 4, 5, 6]), lambda r: got.setdefault("all", r))
        with pytest.raises(InferenceError, match="output 'y' already exists in request"):  # as Triton
            scheduler.submit(_req("m", [7, 8], ["y", "y"]), lambda r: got.setdefault("y", r))
        scheduler.submit(_req("m", [9, 10], ["z", "y"]), lambda r: got.setdefault("zy", r))
        worker.finish()
        worker.finish()
        assert [t.name for t in got["z"].outputs] == ["z"]
        np.testing.assert_array_equal(got["z"].outputs[0].data, [[101, 102]])
        assert sorted(t.name for t in got["all"].outputs) == ["y", "z"]
        all_out = {t.name: t.data for t in got["all"].outputs}
        np.testing.assert_array_equal(all_out["y"], [[6, 8], [10, 12]])
        np.testing.assert_array_equal(all_out["z"], [[103, 104], [105, 106]])
        assert "y" not in got
        zy = {t.name: t.data for t in got["zy"].outputs}
        np.testing.assert_array_equal(zy["y"], [[18, 20]])
        np.testing.assert_array_equal(zy["z"], [[109, 110]])
        for r in got.values():
            for t in r.outputs:
                assert t.shape == t.data.shape

    asyncio.run(run())


def test_a_model_that_does_not_batch_runs_one_request_per_batch(made):
    worker = Worker()
    scheduler, _ = made(UNBATCHED, worker)

    async def run():
        got = []
        for v in (1, 2, 3):
            scheduler.submit(_req("u", [v, v]), got.append)
        for _ in range(3):
            worker.finish()
        assert [r.outputs[0].data.tolist() for r in got] == [[2, 2], [4, 4], [6, 6]]
        assert scheduler.stats.execution_count == 3

    asyncio.run(run())


def test_bytes_outputs_are_split_per_request_and_survive_the_next_batch(made):
    worker = Worker()
    scheduler, _ = made(WITH_BYTES, worker)

    async def run():
        got: dict[str, InferResponse] = {}
        scheduler.submit(_req("b", [1]), lambda r: got.setdefault("first", r))
        scheduler.submit(_req("b", [22, 333]), lambda r: got.setdefault("a", r))
        scheduler.submit(_req("b", [4444]), lambda r: got.setdefault("b", r))
        worker.finish()
        worker.finish()
        scheduler.submit(_req("b", [55555, 6]), lambda r: got.setdefault("c", r))
        worker.finish()
        assert got["first"].outputs[0].data.reshape(-1).tolist() == [b"1"]
        assert got["a"].outputs[0].data.reshape(-1).tolist() == [b"22", b"333"]
        assert got["b"].outputs[0].data.reshape(-1).tolist() == [b"4444"]
        assert got["c"].outputs[0].data.reshape(-1).tolist() == [b"55555", b"6"]

    asyncio.run(run())


def test_two_models_on_one_worker_answered_from_the_other_models_submit(made):
    worker = Worker()
    a, _ = made(TWO_OUTPUTS, worker)
    b, _ = made(WITH_BYTES, worker)

    async def run():
        got: dict[str, object] = {}
        b.submit(_req("b", [7]), lambda r: got.setdefault("b1", r))
        a.submit(_req("m", [1, 1]), lambda r: got.setdefault("a1", r))
        b.submit(_req("b", [8]), lambda r: got.setdefault("b2", r))  # queued behind b1
        # The worker has finished everything in flight: a's next submit polls it and both models' replies are
        # handled inside that call (re-entrantly), b's instance gets b2.
        worker.on_poll = lambda: [worker.finish() for _ in range(len(worker.pending))]
        a._polled_s = 0.0
        a.submit(_req("m", [2, 2]), lambda r: got.setdefault("a2", r))
        # Both finished batches were answered inside a's submit, and each freed instance got its next batch.
        assert set(got) == {"a1", "b1"}
        assert [msg.key for _, msg, _ in worker.pending] == ["b/1/0", "m/1/0"]
        worker.on_poll = None
        worker.finish()
        worker.finish()
        assert set(got) == {"a1", "b1", "a2", "b2"}
        assert got["b2"].outputs[0].data.reshape(-1).tolist() == [b"8"]
        np.testing.assert_array_equal(got["a2"].outputs[0].data, [[4, 4]])
        await asyncio.wait_for(asyncio.gather(a.wait_idle(), b.wait_idle()), 1.0)

    asyncio.run(run())


def test_worker_death_found_by_the_poll_inside_submit(made):
    worker = Worker()
    scheduler, (inst,) = made(TWO_OUTPUTS, worker)
    died = InferenceError(ErrorKind.UNAVAILABLE, "worker died")

    async def run():
        got: dict[str, object] = {}
        scheduler.submit(_req("m", [1, 1]), lambda r: got.setdefault("running", r))
        worker.on_poll = lambda: worker.die(died)
        scheduler._polled_s = 0.0
        scheduler.submit(_req("m", [2, 2]), lambda r: got.setdefault("queued", r))
        # The running batch failed (once); the new request waits for the restart instead of going to the dead
        # instance, and nothing reached the worker.
        assert got == {"running": died}
        assert scheduler.pending_requests == 1 and not worker.pending
        worker.on_poll = None
        idle = asyncio.ensure_future(scheduler.wait_idle())
        await asyncio.sleep(0)
        assert not idle.done()
        inst.ready = True  # restarted and reloaded
        inst.on_ready_change(inst)
        worker.finish()
        np.testing.assert_array_equal(got["queued"].outputs[0].data, [[4, 4]])
        await asyncio.wait_for(idle, 1.0)

    asyncio.run(run())


def test_instance_unready_while_running_is_not_given_the_next_batch(made):
    worker = Worker()
    scheduler, (i0, i1) = made(TWO_OUTPUTS, worker, n=2)

    async def run():
        got = []
        scheduler.submit(_req("m", [1, 1]), got.append)   # -> i0
        scheduler.submit(_req("m", [2, 2]), got.append)   # -> i1
        i0.ready = False
        i0.on_ready_change(i0)
        scheduler.submit(_req("m", [3, 3]), got.append)   # queued: both busy
        worker.finish(0)  # i0 finishes: unready, so it gets nothing
        assert [p[0] for p in worker.pending] == [i1]
        worker.finish(0)  # i1 finishes and takes the queued request
        assert [p[0] for p in worker.pending] == [i1]
        worker.finish(0)
        assert sorted(float(r.outputs[0].data[0, 0]) for r in got) == [2, 4, 6]

    asyncio.run(run())


def test_a_done_callback_that_submits_again_is_served(made):
    worker = Worker()
    scheduler, _ = made(TWO_OUTPUTS, worker)

    async def run():
        got = []

        def done(result):
            got.append(result)
            if len(got) < 3:
                scheduler.submit(_req("m", [len(got), 0]), done)

        scheduler.submit(_req("m", [0, 0]), done)
        for _ in range(3):
            worker.finish()
        assert len(got) == 3 and all(isinstance(r, InferResponse) for r in got)
        await asyncio.wait_for(scheduler.wait_idle(), 1.0)

    asyncio.run(run())


def test_batch_statistics_match_per_request_accounting(made):
    worker = Worker()
    scheduler, _ = made(TWO_OUTPUTS, worker)

    async def run():
        scheduler.submit(_req("m", [0, 0]), lambda r: None)
        scheduler.submit(_req("m", [1, 1, 2, 2]), lambda r: None)
        scheduler.submit(_req("m", [3, 3]), lambda r: None)
        worker.finish()
        worker.finish()

    asyncio.run(run())
    st = scheduler.stats
    assert (st.success.count, st.queue.count, st.compute_input.count, st.execution_count,
            st.inference_count) == (3, 3, 3, 2, 4)
    assert sorted(st.batches) == [1, 3]
