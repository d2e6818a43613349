"""gpud.executor.dynamic_scheduler.DynamicScheduler against a scripted worker: the callback API, cancellation, and
the order of events when a batch finishes (the next batch goes to the instance before the finished one is answered)."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from gpud.executor.model_config import DynamicBatching, ModelConfig, TensorSpec
from gpud.executor.instance import InstanceHandle
from gpud.executor.protocol import Done, Failed, Infer, TensorMeta
from gpud.executor.dynamic_scheduler import DynamicScheduler
from gpud.executor.shm import Segment, new_segment_name
from gpud.executor.types import ErrorKind, InferenceError, InferRequest, InferResponse, InferTensor

CONFIG = ModelConfig(name="m", max_batch_size=8, inputs=(TensorSpec("x", "FP32", (2,)),),
                     outputs=(TensorSpec("y", "FP32", (2,)),), dynamic_batching=DynamicBatching())


class ScriptedWorker:
    """Records the batches the scheduler sends; the test answers them, computing y = 2x from shared memory."""

    def __init__(self, log: list):
        self.log = log
        self.pending: list[tuple[Infer, object]] = []
        self.polls = 0

    def submit(self, msg, callback):
        self.log.append(("dispatch", msg.inputs[0].shape[0]))
        self.pending.append((msg, callback))

    def poll(self):
        self.polls += 1

    def finish(self, inst: InstanceHandle) -> None:
        msg, callback = self.pending.pop(0)
        name, _, shape, offset, _ = msg.inputs[0]
        x = inst.in_seg.ndarray(offset, shape, np.float32)
        inst.out_seg.ndarray(0, shape, np.float32)[...] = 2 * x
        callback(Done(msg.seq, (TensorMeta("y", "FP32", shape, 0, int(np.prod(shape)) * 4),), "", 1, 2, 3))


def scripted(model: str) -> tuple[DynamicScheduler, InstanceHandle, ScriptedWorker, list]:
    """A scheduler for `model` with one ready instance on a scripted worker, and the worker's log."""
    log: list = []
    worker = ScriptedWorker(log)
    inst = InstanceHandle(key=f"{model}/1/0", model=model, version="1", index=0, device_id="cpu", model_path="",
                          config=CONFIG, estimate_bytes=0, worker=worker, ready=True,
                          in_seg=Segment.create(new_segment_name("in"), 1 << 16),
                          out_seg=Segment.create(new_segment_name("out"), 1 << 16))
    scheduler = DynamicScheduler(CONFIG, "1")
    scheduler.add_instance(inst)
    return scheduler, inst, worker, log


@pytest.fixture
def setup():
    scheduler, inst, worker, log = scripted("m")
    yield scheduler, inst, worker, log
    inst.close_segments()


def _request(value: float, rows: int = 1) -> InferRequest:
    return InferRequest("m", [InferTensor("x", "FP32", (rows, 2), np.full((rows, 2), value, np.float32))])


def test_next_batch_is_dispatched_before_the_finished_one_is_answered(setup):
    scheduler, inst, worker, log = setup

    async def run():
        answers = {}

        def done(tag):
            def record(result):
                log.append(("answer", tag))
                answers[tag] = result
            return record

        scheduler.submit(_request(1.0), done("a"))  # alone: dispatched at once (instance free)
        scheduler.submit(_request(2.0), done("b"))  # the instance is busy: these two queue
        scheduler.submit(_request(3.0), done("c"))
        assert log == [("dispatch", 1)]
        worker.finish(inst)
        # b and c went to the instance before a was answered: the worker computes while answers are written.
        assert log == [("dispatch", 1), ("dispatch", 2), ("answer", "a")]
        worker.finish(inst)
        assert log[-2:] == [("answer", "b"), ("answer", "c")]
        for tag, value in (("a", 1.0), ("b", 2.0), ("c", 3.0)):
            assert isinstance(answers[tag], InferResponse)
            np.testing.assert_array_equal(answers[tag].outputs[0].data, [[2 * value, 2 * value]])
        # The answers are copies: the next batch reuses the output region.
        worker_free_run = scheduler.submit(_request(9.0), done("d"))
        worker.finish(inst)
        np.testing.assert_array_equal(answers["a"].outputs[0].data, [[2.0, 2.0]])
        assert worker_free_run.finished
        await scheduler.wait_idle()

    asyncio.run(run())
    st = scheduler.stats
    assert (st.success.count, st.queue.count, st.compute_infer.count, st.execution_count) == (4, 4, 4, 3)
    assert st.compute_infer.ns == 4 * 2  # each request counts its batch's infer time once


def test_bad_input_raises_at_once_and_queues_nothing(setup):
    scheduler, _, _, log = setup

    async def run():
        bad = InferRequest("m", [InferTensor("x", "FP32", (1, 3), np.zeros((1, 3), np.float32))])
        with pytest.raises(InferenceError) as e:
            scheduler.submit(bad, lambda r: pytest.fail("answered"))
        assert e.value.kind is ErrorKind.INVALID_ARGUMENT
        assert scheduler.pending_requests == 0 and log == []

    asyncio.run(run())


def test_a_cancelled_queued_request_never_runs_and_is_never_answered(setup):
    scheduler, inst, worker, log = setup

    async def run():
        answered = []
        scheduler.submit(_request(1.0), answered.append)
        queued = scheduler.submit(_request(2.0), lambda r: pytest.fail("a cancelled request was answered"))
        scheduler.cancel(queued)
        worker.finish(inst)
        assert len(answered) == 1 and log == [("dispatch", 1)]
        assert scheduler.pending_requests == 0

    asyncio.run(run())


def test_infer_wraps_submit_and_cancelling_it_dequeues(setup):
    scheduler, inst, worker, log = setup

    async def run():
        first = asyncio.ensure_future(scheduler.infer(_request(1.0)))
        second = asyncio.ensure_future(scheduler.infer(_request(2.0)))
        await asyncio.sleep(0)  # both coroutines run up to their await
        second.cancel()
        await asyncio.gather(second, return_exceptions=True)
        worker.finish(inst)
        result = await first
        np.testing.assert_array_equal(result.outputs[0].data, [[2.0, 2.0]])
        assert log == [("dispatch", 1)] and scheduler.pending_requests == 0

    asyncio.run(run())


def test_a_failed_batch_fails_each_request_with_the_workers_error(setup):
    scheduler, inst, worker, _ = setup

    async def run():
        results = []
        scheduler.submit(_request(1.0), results.append)
        _, callback = worker.pending.pop(0)
        callback(Failed(0, "INTERNAL", "boom"))
        assert isinstance(results[0], InferenceError) and "boom" in results[0].message

    asyncio.run(run())


def test_worker_is_polled_while_requests_arrive_with_a_batch_running(setup):
    scheduler, inst, worker, _ = setup

    async def run():
        scheduler.submit(_request(1.0), lambda r: None)
        assert worker.polls == 1  # a batch was running when it was submitted
        worker.finish(inst)

    asyncio.run(run())


def test_an_answer_callback_that_raises_does_not_stop_the_others(setup, caplog):
    scheduler, inst, worker, _ = setup

    async def run():
        got = []
        scheduler.submit(_request(1.0), lambda r: None)
        scheduler.submit(_request(2.0), lambda r: 1 / 0)
        scheduler.submit(_request(3.0), got.append)
        worker.finish(inst)
        worker.finish(inst)
        assert len(got) == 1 and isinstance(got[0], InferResponse)

    asyncio.run(run())
    assert any("answering request" in r.message for r in caplog.records)


class TestNoReadyInstance:
    """While no instance is ready (a worker restarting), requests wait in the queue, at most unready_wait_s."""

    def test_a_request_waits_for_the_instance_to_come_back(self, setup):
        scheduler, inst, worker, log = setup

        async def run():
            inst.ready = False
            inst.on_ready_change(inst)  # the worker died: its instance is unready
            got = []
            scheduler.submit(_request(1.0), got.append)
            assert log == [] and scheduler.pending_requests == 1  # queued, not refused, not dispatched
            inst.ready = True
            inst.on_ready_change(inst)  # restarted and reloaded: the queued request goes
            assert log == [("dispatch", 1)]
            worker.finish(inst)
            assert isinstance(got[0], InferResponse)
            assert scheduler._unready_timer is None  # the deadline went with the unready spell

        asyncio.run(run())

    def test_the_wait_is_bounded(self, setup):
        scheduler, inst, _, log = setup
        scheduler.unready_wait_s = 0.01

        async def run():
            inst.ready = False
            inst.on_ready_change(inst)
            answered = asyncio.get_running_loop().create_future()
            scheduler.submit(_request(1.0), answered.set_result)
            return await asyncio.wait_for(answered, 10)  # the deadline answers it: no sleep in the test

        error = asyncio.run(run())
        assert isinstance(error, InferenceError) and error.kind is ErrorKind.UNAVAILABLE
        assert "no instance of model 'm' version 1 became ready within 0.01 s" in error.message
        assert log == [] and scheduler.stats.fail.count == 1


def test_a_batchs_answers_that_feed_another_model_reach_it_as_one_batch(setup):
    # As an ensemble's steps do: each answer of model a's batch is submitted to model b from its callback. b is free
    # and would take the first alone; b's scheduler is stepped only once the whole batch is answered.
    scheduler_a, inst_a, worker_a, log_a = setup
    scheduler_b, inst_b, worker_b, log_b = scripted("b")
    answers: list = []

    def feed_b(result) -> None:
        y = result.outputs[0].data
        scheduler_b.submit(InferRequest("b", [InferTensor("x", "FP32", y.shape, y)]), answers.append)

    async def run():
        for value in (1.0, 2.0, 3.0, 4.0):
            scheduler_a.submit(_request(value), feed_b)
        assert log_a == [("dispatch", 1)]
        worker_a.finish(inst_a)  # a: the next three go; the first answer goes to b, which takes it
        assert log_a == [("dispatch", 1), ("dispatch", 3)] and log_b == [("dispatch", 1)]
        worker_b.finish(inst_b)
        worker_a.finish(inst_a)  # three answers to b at once: one batch
        assert log_b == [("dispatch", 1), ("dispatch", 3)]
        worker_b.finish(inst_b)
        await scheduler_a.wait_idle()
        await scheduler_b.wait_idle()

    try:
        asyncio.run(run())
    finally:
        inst_b.close_segments()
    assert [float(a.outputs[0].data[0, 0]) for a in answers] == [4.0, 8.0, 12.0, 16.0]


def test_a_group_is_batched_and_answered_as_one_request_and_counted_as_its_members(setup):
    # An ensemble's step for several of its requests (gpud.executor.ensemble rule 6): one request of their rows,
    # `members` requests in the statistics, whether it succeeds or fails.
    scheduler, inst, worker, log = setup
    assert scheduler.takes_groups

    async def run():
        results: list = []
        scheduler.submit(_request(1.0, rows=3), results.append, members=3)
        scheduler.submit(_request(2.0), results.append)
        assert scheduler.pending_requests == 4  # the group (running) as its three, and the one queued
        worker.finish(inst)
        worker.finish(inst)
        assert log == [("dispatch", 3), ("dispatch", 1)] and [r.outputs[0].shape for r in results] == [(3, 2), (1, 2)]
        st = scheduler.stats
        assert (st.success.count, st.queue.count, st.inference_count, st.execution_count) == (4, 4, 4, 2)
        scheduler.submit(_request(1.0, rows=2), results.append, members=2)
        _, callback = worker.pending.pop(0)
        callback(Failed(2, "INTERNAL", "boom"))
        assert isinstance(results[-1], InferenceError) and st.fail.count == 2

    asyncio.run(run())
    no_batching = DynamicScheduler(ModelConfig(name="n", max_batch_size=8, inputs=CONFIG.inputs, outputs=CONFIG.outputs),
                                 "1")
    assert not no_batching.takes_groups  # each request a batch of its own: a group would change that


def test_a_group_member_withdrawn_while_queued_is_not_counted_and_one_withdrawn_while_running_is(setup):
    # A front-end process's group (gpud.frontproc.host): a member whose client went away is counted no more while
    # the group waits (as a lone request withdrawn while queued is not), its rows still running with the others';
    # once the group runs, it counts (as a lone request withdrawn while running does).
    scheduler, inst, worker, log = setup

    async def run():
        results: list = []
        scheduler.submit(_request(1.0), results.append)  # takes the one instance
        queued = scheduler.submit(_request(1.0, rows=3), results.append, members=3)
        assert scheduler.pending_requests == 4
        scheduler.withdraw_member(queued)
        assert scheduler.pending_requests == 3
        worker.finish(inst)
        scheduler.withdraw_member(queued)  # running now: still counted
        worker.finish(inst)
        assert log == [("dispatch", 1), ("dispatch", 3)] and [r.outputs[0].shape for r in results] == [(1, 2), (3, 2)]
        st = scheduler.stats
        assert (st.success.count, st.inference_count, st.execution_count) == (3, 4, 2)

    asyncio.run(run())
