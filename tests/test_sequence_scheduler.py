"""gpud.executor.sequence_scheduler.SequenceScheduler with the test's ONNX models run in-process by a scripted worker
(the real shared-memory staging, onnxruntime computing, the test deciding when each batch finishes): the control
tensors each row gets, the implicit state kept per sequence, null rows, failed batches, instances going away."""
from __future__ import annotations

import asyncio

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from gpud.executor.instance import InstanceHandle
from gpud.executor.protocol import Done, Failed, read_inputs, write_outputs
from gpud.executor.sequence_scheduler import SequenceScheduler, sequence_parameters
from gpud.executor.shm import Segment, new_segment_name
from gpud.executor.types import ErrorKind, InferenceError, InferRequest, InferResponse, InferTensor, RequestedOutput
from gpud.repository.layout import load_model
from tests.daemon_harness import save
from tests.sequence_models import (GROWING_CONFIG, accumulator_config, accumulator_model, controls_config,
                                   controls_model, growing_model)


class OrtWorker:
    """Takes the batches the scheduler sends; `finish()` runs the oldest with onnxruntime, in shared memory."""

    def __init__(self, model: onnx.ModelProto):
        self.session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        self.pending: list = []
        self.feeds: list[dict[str, np.ndarray]] = []

    def submit(self, msg, callback):
        self.pending.append((msg, callback))

    def poll(self):
        pass

    def finish(self, inst: InstanceHandle, fail: str = "") -> None:
        msg, callback = self.pending.pop(0)
        if fail:
            callback(Failed(msg.seq, "INTERNAL", fail))
            return
        feed = {k: (v.astype(str) if v.dtype == object else v.copy())
                for k, v in read_inputs(inst.in_seg, msg.inputs).items()}
        self.feeds.append(feed)
        results = self.session.run(list(msg.outputs), feed)
        outputs, ovf = write_outputs(inst.out_seg, msg.outputs, msg.output_types, results)
        callback(Done(msg.seq, outputs, ovf, 1, 2, 3))


def instance(config, key: str, model: onnx.ModelProto) -> InstanceHandle:
    return InstanceHandle(key=key, model=config.name, version="1", index=0, device_id="cpu", model_path="",
                          config=config, estimate_bytes=0, worker=OrtWorker(model), ready=True,
                          in_seg=Segment.create(new_segment_name("in"), 1 << 12),
                          out_seg=Segment.create(new_segment_name("out"), 1 << 12))


@pytest.fixture
def made(tmp_path):
    """make(name, model, config, instances=1) -> (scheduler, [instances]); segments closed at the end."""
    handles: list[InstanceHandle] = []

    def make(name, model, config, instances=1):
        save(model, tmp_path, name, config)
        cfg = load_model(tmp_path / name).config
        scheduler = SequenceScheduler(cfg, "1")
        insts = [instance(cfg, f"{name}:{i}", model) for i in range(instances)]
        handles.extend(insts)
        for inst in insts:
            scheduler.add_instance(inst)
        return scheduler, insts

    yield make
    for h in handles:
        h.close_segments()


def request(model: str, value: int, seq, start=False, end=False, rows=1, **params) -> InferRequest:
    parameters = {"sequence_id": seq, "sequence_start": start, "sequence_end": end, **params}
    return InferRequest(model, [InferTensor("INPUT", "INT32", (rows, 1), np.full((rows, 1), value, np.int32))],
                        parameters=parameters)


class Answers:
    def __init__(self):
        self.got: dict[str, object] = {}

    def __call__(self, tag: str):
        return lambda result: self.got.__setitem__(tag, result)

    def out(self, tag: str, name: str = "OUTPUT"):
        result = self.got[tag]
        assert isinstance(result, InferResponse), result
        return next(t.data for t in result.outputs if t.name == name).reshape(-1)[0]


def run(coro_fn):
    return asyncio.run(coro_fn())


class TestParameters:
    @pytest.mark.parametrize("params, want", [
        ({}, (0, False, False)),
        ({"sequence_id": 7, "sequence_start": True}, (7, True, False)),
        ({"sequence_id": "abc", "sequence_end": True}, ("abc", False, True)),
        ({"sequence_id": 2**64 - 1}, (2**64 - 1, False, False)),
    ])
    def test_parsed(self, params, want):
        assert sequence_parameters(params) == want

    @pytest.mark.parametrize("params, fragment", [
        ({"sequence_id": -1}, "unsigned 64-bit"),
        ({"sequence_id": 2**64}, "unsigned 64-bit"),
        ({"sequence_id": 1.5}, "'sequence_id' must be an unsigned integer or a string"),
        ({"sequence_id": True}, "'sequence_id' must be an unsigned integer or a string"),
        ({"sequence_id": 1, "sequence_start": 1}, "'sequence_start' must be a boolean"),
        ({"sequence_id": 1, "sequence_end": "yes"}, "'sequence_end' must be a boolean"),
    ])
    def test_refused(self, params, fragment):
        with pytest.raises(InferenceError) as e:
            sequence_parameters(params)
        assert e.value.kind is ErrorKind.INVALID_ARGUMENT and fragment in e.value.message


def test_controls_reach_each_row_as_triton_delivers_them(made):
    """START 10/11 (int32), END false/true (bool), READY 0/1 (fp32), CORRID uint64; null rows READY false."""
    scheduler, (inst,) = made("controls", controls_model(), controls_config(max_batch_size=4))
    worker = inst.worker
    got = Answers()

    async def go():
        scheduler.submit(request("controls", 5, 100, start=True), got("a1"))  # slot 0, runs alone
        scheduler.submit(request("controls", 6, 200, start=True), got("b1"))  # slot 1, waits for the instance
        worker.finish(inst)
        worker.finish(inst)
        scheduler.submit(request("controls", 7, 200, end=True), got("b2"))  # only slot 1 has a request
        worker.finish(inst)
        await scheduler.wait_idle()

    run(go)
    first, second, third = worker.feeds
    assert first["START"].tolist() == [[11]] and first["END"].tolist() == [[False]]
    assert first["READY"].tolist() == [[1.0]] and first["CORRID"].tolist() == [[100]]
    assert second["CORRID"].tolist() == [[0], [200]]  # slot 0 is a null row: sequence 100 has nothing queued
    assert second["READY"].tolist() == [[0.0], [1.0]] and second["START"].tolist() == [[10], [11]]
    assert second["INPUT"].tolist() == [[0], [6]]  # a null row's inputs are zeros
    assert third["END"].tolist() == [[False], [True]] and third["START"].tolist() == [[10], [10]]
    assert (got.out("a1"), got.out("b1"), got.out("b2")) == (5, 6, 7)
    assert got.out("b2", "END_OUT") and got.out("b2", "CORRID_OUT") == 200
    assert scheduler.stats.inference_count == 3 and scheduler.stats.execution_count == 3  # null rows not counted


def test_interleaved_sequences_keep_their_own_state(made):
    scheduler, insts = made("acc", accumulator_model(), accumulator_config(max_batch_size=4, instances=2), 2)
    rng = np.random.default_rng(3)
    got = Answers()
    expected: dict[str, int] = {}

    async def go():
        sums = {cid: 0 for cid in range(1, 7)}
        steps = {cid: 0 for cid in sums}
        order = [cid for cid in sums for _ in range(5)]
        rng.shuffle(order)
        for cid in order:
            value = int(rng.integers(1, 100))
            sums[cid] += value
            tag = f"{cid}:{steps[cid]}"
            expected[tag] = sums[cid]
            scheduler.submit(request("acc", value, cid, start=steps[cid] == 0, end=steps[cid] == 4), got(tag))
            steps[cid] += 1
            for inst in insts:  # finish what runs now and then, so that batches mix sequences
                if inst.worker.pending and rng.random() < 0.5:
                    inst.worker.finish(inst)
        while any(i.worker.pending for i in insts):
            for inst in insts:
                if inst.worker.pending:
                    inst.worker.finish(inst)
        await scheduler.wait_idle()

    run(go)
    assert {tag: got.out(tag) for tag in expected} == expected
    assert {tag: got.out(tag, "CORRID_OUT") for tag in expected} == {t: int(t.split(":")[0]) for t in expected}
    assert scheduler.live_sequences == 0  # all ended
    assert all(inst.worker.feeds for inst in insts)  # both instances served


def test_a_failed_batch_leaves_the_state_as_it_was(made):
    scheduler, (inst,) = made("acc", accumulator_model(), accumulator_config())
    got = Answers()

    async def go():
        scheduler.submit(request("acc", 5, 1, start=True), got("1"))
        inst.worker.finish(inst)
        scheduler.submit(request("acc", 7, 1), got("2"))
        inst.worker.finish(inst, fail="the device fell off the bus")
        scheduler.submit(request("acc", 9, 1), got("3"))  # the client retries
        inst.worker.finish(inst)

    run(go)
    assert isinstance(got.got["2"], InferenceError) and "fell off the bus" in got.got["2"].message
    assert (got.out("1"), got.out("3")) == (5, 14)


def test_sequences_go_on_with_their_state_when_their_instance_goes(made):
    scheduler, (a, b) = made("acc", accumulator_model(), accumulator_config(max_batch_size=2), 2)
    got = Answers()

    async def go():
        scheduler.submit(request("acc", 1, 1, start=True), got("x1"))  # a slot 0
        scheduler.submit(request("acc", 10, 2, start=True), got("y1"))  # b slot 0
        a.worker.finish(a)
        b.worker.finish(b)
        scheduler.remove_instance(a)  # the controller scales down: sequence 1 moves to b's free slot
        scheduler.submit(request("acc", 2, 1), got("x2"))
        b.worker.finish(b)
        b.ready = False  # b's worker restarts: both sequences wait in the backlog, with their state
        b.on_ready_change(b)
        scheduler.submit(request("acc", 20, 2, end=True), got("y2"))
        assert not b.worker.pending
        b.ready = True
        b.on_ready_change(b)
        b.worker.finish(b)

    run(go)
    assert (got.out("x1"), got.out("y1"), got.out("x2"), got.out("y2")) == (1, 10, 3, 30)


def test_requests_failed_for_want_of_a_ready_instance_hear_that_their_sequences_keep_their_state(made):
    """(Compiled, the base class once read its own empty note instead of the sequence scheduler's.)"""
    scheduler, (a,) = made("acc", accumulator_model(), accumulator_config(max_batch_size=2), 1)
    got = Answers()

    async def go():
        a.ready = False
        a.on_ready_change(a)
        scheduler.submit(request("acc", 1, 1, start=True), got("x1"))
        scheduler._on_unready_deadline()  # the unready wait ran out

    run(go)
    error = got.got["x1"]
    assert isinstance(error, InferenceError) and error.kind is ErrorKind.UNAVAILABLE
    assert error.message.endswith("; its sequences keep their state"), error.message


def test_a_start_during_a_live_sequence_restarts_its_state(made, caplog):
    scheduler, (inst,) = made("acc", accumulator_model(), accumulator_config())
    got = Answers()

    async def go():
        scheduler.submit(request("acc", 5, 1, start=True), got("1"))
        inst.worker.finish(inst)
        scheduler.submit(request("acc", 3, 1, start=True), got("2"))
        inst.worker.finish(inst)

    with caplog.at_level("WARNING", logger="gpud.executor"):
        run(go)
    assert got.out("2") == 3
    assert "Previous sequence will be terminated early" in caplog.text


def test_initial_state_from_a_file_and_the_state_output(made, tmp_path):
    (tmp_path / "init" / "initial_state").mkdir(parents=True)
    (tmp_path / "init" / "initial_state" / "hundred").write_bytes(np.array([100], "<i4").tobytes())
    config = accumulator_config(output_state=True, initial_state='initial_state: { data_type: TYPE_INT32 '
                                'dims: [ 1 ] data_file: "hundred" name: "from a file" }')
    scheduler, (inst,) = made("init", accumulator_model(reset_on_start=False), config)
    got = Answers()

    async def go():
        scheduler.submit(request("init", 5, 1, start=True), got("1"))
        inst.worker.finish(inst)
        scheduler.submit(request("init", 1, 1, end=True), got("2"))
        inst.worker.finish(inst)
        scheduler.submit(request("init", 2, 1, start=True, end=True), got("3"))  # a new sequence: 100 again
        inst.worker.finish(inst)

    run(go)
    assert (got.out("1"), got.out("2"), got.out("3")) == (105, 106, 102)
    assert got.out("2", "OUTPUT_STATE") == 106  # listed in output: the client may read it too


def test_string_ids_with_the_oldest_strategy(made):
    config = accumulator_config(corrid="BYTES", strategy="oldest { max_candidate_sequences: 4 }")
    scheduler, (inst,) = made("acc", accumulator_model("BYTES"), config)
    got = Answers()

    async def go():
        scheduler.submit(request("acc", 1, "alpha", start=True), got("a1"))
        scheduler.submit(request("acc", 2, "beta", start=True), got("b1"))
        scheduler.submit(request("acc", 3, "alpha"), got("a2"))
        inst.worker.finish(inst)  # alpha:1 alone (the instance was free)
        inst.worker.finish(inst)  # beta:2 and alpha:3 together: no null rows in oldest
        await scheduler.wait_idle()

    run(go)
    assert [f["INPUT"].reshape(-1).tolist() for f in inst.worker.feeds] == [[1], [2, 3]]
    assert (got.out("a1"), got.out("b1"), got.out("a2")) == (1, 2, 4)
    assert got.out("a2", "CORRID_OUT") == b"alpha"


class TestErrors:
    def refused(self, scheduler, req) -> InferenceError:
        async def go():
            with pytest.raises(InferenceError) as e:
                scheduler.submit(req, lambda r: None)
            return e.value
        return asyncio.run(go())

    def test_errors_at_submit_change_nothing(self, made):
        scheduler, _ = made("acc", accumulator_model(), accumulator_config())
        e = self.refused(scheduler, request("acc", 1, 0))
        assert e.message == "inference request to model 'acc' must specify a non-zero or non-empty correlation ID"
        e = self.refused(scheduler, request("acc", 1, 9))
        assert e.message.startswith("inference request for sequence 9 to model 'acc' must specify the START flag")
        e = self.refused(scheduler, request("acc", 1, 9, start=True, rows=2))
        assert e.message == ("inference request to model 'acc' must specify batch-size 1 due to requirements of "
                             "sequence batcher")
        e = self.refused(scheduler, request("acc", 1, "nine", start=True))
        assert e.message == "sequence batching control 'CORRID' data-type is 'BYTES', but model 'acc' expects 'UINT64'"
        e = self.refused(scheduler, InferRequest("acc", [], parameters={"sequence_id": 1, "sequence_start": True}))
        assert "expected input 'INPUT'" in e.message
        assert scheduler.live_sequences == 0 and scheduler.pending_requests == 0

    def test_only_the_clients_outputs_can_be_requested(self, made):
        scheduler, _ = made("acc", accumulator_model(), accumulator_config())
        req = request("acc", 1, 1, start=True)
        req.outputs = [RequestedOutput("OUTPUT_STATE")]  # a state output the config does not list
        assert "unexpected inference output 'OUTPUT_STATE'" in self.refused(scheduler, req).message


def test_a_model_that_does_not_batch_with_a_growing_state(made):
    """max_batch_size 0: one slot per instance, tensors without a batch dimension; a state with a variable dim
    starts as one zero (Triton: 1 for each variable dim) and may change shape from request to request."""
    scheduler, (inst,) = made("grow", growing_model(), GROWING_CONFIG)
    got = Answers()

    async def go():
        for step, value in enumerate((3, 4, 5)):
            req = InferRequest("grow", [InferTensor("INPUT", "INT32", (1,), np.array([value], np.int32))],
                               parameters={"sequence_id": 8, "sequence_start": step == 0})
            scheduler.submit(req, got(str(step)))
            inst.worker.finish(inst)
        req = InferRequest("grow", [InferTensor("INPUT", "INT32", (1,), np.array([1], np.int32))],
                           parameters={"sequence_id": 9, "sequence_start": True})
        scheduler.submit(req, got("other"))  # the one slot is sequence 8's: 9 waits in the backlog
        assert not inst.worker.pending and scheduler.backlog_sequences == 1

    run(go)
    assert [got.out(str(s)) for s in range(3)] == [3, 7, 12]
    assert got.got["2"].outputs[1].data.tolist() == [0, 3, 4, 5]  # the state the client may read: it grew
    assert [f["INPUT_STATE"].shape for f in inst.worker.feeds] == [(1,), (2,), (3,)]


def test_a_state_output_of_the_wrong_shape_fails_the_batch_and_keeps_the_state(made):
    """The model's file says [N, 1] but it returns [N, 2] on the second request: that batch fails, the sequence's
    state stays what the first request left."""
    scheduler, (inst,) = made("acc", accumulator_model(), accumulator_config())
    got = Answers()
    real = inst.worker.session.run

    def broken(names, feed):
        out = real(names, feed)
        return [np.concatenate([o, o], axis=1) if n == "OUTPUT_STATE" else o for n, o in zip(names, out)]

    async def go():
        scheduler.submit(request("acc", 5, 1, start=True), got("1"))
        inst.worker.finish(inst)
        inst.worker.session = type("S", (), {"run": staticmethod(broken)})()
        scheduler.submit(request("acc", 7, 1), got("2"))
        inst.worker.finish(inst)
        inst.worker.session = type("S", (), {"run": staticmethod(real)})()
        scheduler.submit(request("acc", 1, 1), got("3"))
        inst.worker.finish(inst)

    run(go)
    assert "state output 'OUTPUT_STATE' has shape [1, 2], not the state's dims [1]" in got.got["2"].message
    assert (got.out("1"), got.out("3")) == (5, 6)


def test_string_ids_must_be_text():
    with pytest.raises(InferenceError) as e:
        sequence_parameters({"sequence_id": "\ud800", "sequence_start": True})
    assert "not valid Unicode text" in e.value.message
