"""gpud.executor.ensemble.EnsembleScheduler against scripted step models: which steps are sent when (parallel when
their inputs are ready, in order otherwise, only those the requested outputs need), what a failure looks like,
statistics, cancellation and shutdown. Deterministic: the test answers each step when it chooses."""
from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from gpud.executor.ensemble import EnsembleScheduler, plan_route
from gpud.executor.model_config import ENSEMBLE_PLATFORM, EnsembleScheduling, EnsembleStep, ModelConfig, TensorSpec
from gpud.executor.types import ErrorKind, InferenceError, InferRequest, InferResponse, InferTensor, RequestedOutput


class Pending:
    def __init__(self, request: InferRequest, done):
        self.request = request
        self.done = done
        self.cancelled = False


class ScriptedModel:
    """A step target that keeps what it is sent until the test answers it (the part of a Scheduler an ensemble
    uses)."""

    takes_groups = False

    def __init__(self, name: str, log: list[str]):
        self.name = name
        self.log = log
        self.pending: list[Pending] = []
        self.refuse: InferenceError | None = None
        self.answer_at_once: Any = None  # a result to answer with from inside submit()

    def submit(self, request: InferRequest, done) -> Pending:
        if self.refuse is not None:
            raise self.refuse
        self.log.append(f"sent {self.name}")
        p = Pending(request, done)
        if self.answer_at_once is not None:
            done(self.answer_at_once(request))
            return p
        self.pending.append(p)
        return p

    def cancel(self, p: Pending) -> None:
        p.cancelled = True
        self.log.append(f"cancelled {self.name}")

    def answer(self, fn=lambda x: x + 1, compute_ns=(1, 10, 100)) -> None:
        """Answer the oldest pending request: every requested output = fn(first input)."""
        p = self.pending.pop(0)
        self.log.append(f"answered {self.name}")
        x = p.request.inputs[0].data
        outs = [InferTensor(o.name, "FP32", x.shape, fn(x)) for o in p.request.outputs]
        p.done(InferResponse(self.name, "1", outs, id=p.request.id, compute_ns=compute_ns))

    def fail(self, error: InferenceError) -> None:
        p = self.pending.pop(0)
        p.done(error)


def ensemble(steps: list[EnsembleStep], inputs=("IN",), outputs=("OUT",), max_batch_size: int = 8,
             max_inflight_requests: int = 0) -> ModelConfig:
    return ModelConfig(name="ens", platform=ENSEMBLE_PLATFORM, backend="", max_batch_size=max_batch_size,
                       inputs=tuple(TensorSpec(n, "FP32", (2,)) for n in inputs),
                       outputs=tuple(TensorSpec(n, "FP32", (2,)) for n in outputs), instance_groups=(),
                       ensemble=EnsembleScheduling(tuple(steps), max_inflight_requests))


def s(model: str, inputs: dict[str, str], outputs: dict[str, str], version: int = -1) -> EnsembleStep:
    return EnsembleStep(model, version, tuple(inputs.items()), tuple(outputs.items()))


CHAIN = [s("a", {"x": "IN"}, {"y": "m"}), s("b", {"x": "m"}, {"y": "OUT"})]
# b and c both read a's output (parallel); d joins them
DIAMOND = [s("a", {"x": "IN"}, {"y": "m"}), s("b", {"x": "m"}, {"y": "mb"}), s("c", {"x": "m"}, {"y": "mc"}),
           s("d", {"x": "mb", "w": "mc"}, {"y": "OUT"})]


class Harness:
    def __init__(self, steps: list[EnsembleStep], **kw):
        self.log: list[str] = []
        self.models = {st.model_name: ScriptedModel(st.model_name, self.log) for st in steps}
        self.routed: list[tuple[str, str]] = []
        self.scheduler = EnsembleScheduler(ensemble(steps, **kw), "1", self.route)
        self.results: list[Any] = []

    def route(self, request: InferRequest) -> ScriptedModel:
        self.routed.append((request.model_name, request.model_version))
        if request.model_name not in self.models:
            raise InferenceError(ErrorKind.NOT_FOUND, f"Request for unknown model: '{request.model_name}' is not found")
        return self.models[request.model_name]

    async def submit(self, rows: int = 1, outputs: list[str] | None = None, **kw) -> Any:
        """Submit a request and let the loop turn once: its first steps are sent at the end of the turn in which
        it came (rule 6)."""
        handle = self.submit_only(rows, outputs, **kw)
        await asyncio.sleep(0)  # one turn of the loop (not a timed wait)
        return handle

    def submit_only(self, rows: int = 1, outputs: list[str] | None = None, **kw) -> Any:
        x = np.arange(rows * 2, dtype=np.float32).reshape(rows, 2)
        inputs = [InferTensor(spec.name, "FP32", x.shape, x) for spec in self.scheduler.config.inputs]
        request = InferRequest("ens", inputs, id="r1", outputs=None if outputs is None else
                               [RequestedOutput(o) for o in outputs], **kw)
        return self.scheduler.submit(request, self.results.append)


def run(coro):
    return asyncio.run(coro)


def test_a_chain_sends_each_step_when_its_input_is_ready_and_answers_with_the_outputs():
    async def scenario():
        h = Harness(CHAIN)
        await h.submit(rows=2)
        assert h.log == ["sent a"] and h.scheduler.pending_requests == 1
        h.models["a"].answer(lambda x: x * 10)
        assert h.log == ["sent a", "answered a", "sent b"]
        req_b = h.models["b"].pending[0].request
        assert [(t.name, t.shape) for t in req_b.inputs] == [("x", (2, 2))]  # the step's own input name
        assert [o.name for o in req_b.outputs] == ["y"] and req_b.id == "r1"
        h.models["b"].answer(lambda x: x + 1)
        (response,) = h.results
        assert response.model_name == "ens" and [t.name for t in response.outputs] == ["OUT"]
        np.testing.assert_array_equal(response.outputs[0].data, np.arange(4, dtype=np.float32).reshape(2, 2) * 10 + 1)
        assert h.scheduler.pending_requests == 0
        assert h.routed == [("a", ""), ("b", "")]  # -1: the newest served version
    run(scenario())


def test_steps_whose_inputs_are_ready_together_run_in_parallel_and_a_join_waits_for_both():
    async def scenario():
        h = Harness(DIAMOND)
        await h.submit()
        h.models["a"].answer()
        assert h.log == ["sent a", "answered a", "sent b", "sent c"]  # both before either answered
        h.models["c"].answer()
        assert "sent d" not in h.log  # d waits for b too
        h.models["b"].answer()
        assert h.log[-1] == "sent d"
        h.models["d"].answer()
        assert len(h.results) == 1 and isinstance(h.results[0], InferResponse)
    run(scenario())


def test_two_steps_reading_an_ensemble_input_start_at_once():
    async def scenario():
        h = Harness([s("a", {"x": "IN"}, {"y": "OUT"}), s("b", {"x": "IN"}, {"y": "OUT2"})], outputs=("OUT", "OUT2"))
        await h.submit()
        assert h.log == ["sent a", "sent b"]
        h.models["b"].answer()
        h.models["a"].answer()
        assert [t.name for t in h.results[0].outputs] == ["OUT", "OUT2"]
    run(scenario())


def test_only_the_steps_the_requested_outputs_need_run():
    async def scenario():
        h = Harness([s("a", {"x": "IN"}, {"y": "OUT"}), s("b", {"x": "IN"}, {"y": "OUT2"})], outputs=("OUT", "OUT2"))
        await h.submit(outputs=["OUT2"])
        assert h.log == ["sent b"]
        h.models["b"].answer()
        assert [t.name for t in h.results[0].outputs] == ["OUT2"]
    run(scenario())
    route = plan_route(DIAMOND, ["OUT"])
    assert [st.index for st in route.steps] == [0, 1, 2, 3] and dict(route.waits) == {0: 1, 1: 1, 2: 1, 3: 2}


def test_a_step_failing_fails_the_request_naming_the_step_and_cancels_the_others():
    async def scenario():
        h = Harness(DIAMOND)
        await h.submit()
        h.models["a"].answer()
        h.models["b"].fail(InferenceError(ErrorKind.INTERNAL, "model 'b' failed: boom"))
        (error,) = h.results
        assert isinstance(error, InferenceError) and error.kind is ErrorKind.INTERNAL
        assert error.message == "in ensemble 'ens', step 1 (model 'b'): model 'b' failed: boom"
        assert h.log[-1] == "cancelled c" and h.models["c"].pending[0].cancelled
        assert h.scheduler.pending_requests == 0
        h.models["c"].answer()  # an answer after the failure changes nothing
        assert len(h.results) == 1
        st = h.scheduler.stats
        assert (st.fail.count, st.success.count) == (1, 0)
    run(scenario())


def test_a_first_step_refused_at_once_fails_the_request_through_its_callback():
    async def scenario():
        h = Harness(CHAIN)
        h.models["a"].refuse = InferenceError(ErrorKind.UNAVAILABLE, "Exceeds maximum queue size")
        await h.submit()
        (error,) = h.results
        assert error.kind is ErrorKind.UNAVAILABLE
        assert error.message == "in ensemble 'ens', step 0 (model 'a'): Exceeds maximum queue size"
        assert h.scheduler.pending_requests == 0 and h.scheduler.stats.fail.count == 1
    run(scenario())


def test_a_parallel_step_refused_at_once_cancels_the_one_already_sent():
    async def scenario():
        h = Harness([s("a", {"x": "IN"}, {"y": "OUT"}), s("b", {"x": "IN"}, {"y": "OUT2"})], outputs=("OUT", "OUT2"))
        h.models["b"].refuse = InferenceError(ErrorKind.INVALID_ARGUMENT, "unexpected shape")
        await h.submit()
        (error,) = h.results
        assert error.kind is ErrorKind.INVALID_ARGUMENT and "step 1 (model 'b'): unexpected shape" in error.message
        assert h.models["a"].pending[0].cancelled
    run(scenario())


def test_a_later_step_refused_fails_through_the_callback_and_a_missing_model_is_named():
    async def scenario():
        h = Harness([s("a", {"x": "IN"}, {"y": "m"}), s("gone", {"x": "m"}, {"y": "OUT"})])
        del h.models["gone"]
        await h.submit()
        h.models["a"].answer()
        (error,) = h.results
        assert error.kind is ErrorKind.NOT_FOUND
        assert error.message == ("in ensemble 'ens', step 1 (model 'gone'): Request for unknown model: 'gone' is "
                                 "not found")
    run(scenario())


def test_a_bad_ensemble_request_is_refused_before_any_step():
    async def scenario():
        h = Harness(CHAIN)
        bad = InferRequest("ens", [InferTensor("IN", "INT64", (1, 2), np.zeros((1, 2), np.int64))])
        with pytest.raises(InferenceError) as e:
            h.scheduler.submit(bad, h.results.append)
        assert e.value.kind is ErrorKind.INVALID_ARGUMENT and "expects 'FP32'" in e.value.message
        assert h.log == [] and h.scheduler.stats.fail.count == 0
    run(scenario())


def test_a_step_answered_inside_submit_is_not_waited_for_again():
    """A scheduler may answer inside submit() (it handles replies already waiting on its worker's pipe)."""
    async def scenario():
        h = Harness(CHAIN)
        h.models["a"].answer_at_once = lambda r: InferResponse("a", "1", [InferTensor("y", "FP32", (1, 2),
                                                                                      np.ones((1, 2), np.float32))])
        await h.submit()
        assert h.log == ["sent a", "sent b"]
        h.models["b"].answer()
        assert isinstance(h.results[0], InferResponse) and h.scheduler.pending_requests == 0
    run(scenario())


def test_statistics_count_one_execution_per_request_with_the_steps_compute_summed():
    async def scenario():
        h = Harness(CHAIN)
        await h.submit(rows=3)
        h.models["a"].answer(compute_ns=(1, 10, 100))
        h.models["b"].answer(compute_ns=(2, 20, 200))
        st = h.scheduler.stats
        assert (st.success.count, st.execution_count, st.inference_count) == (1, 1, 3)
        assert (st.compute_input.ns, st.compute_infer.ns, st.compute_output.ns) == (3, 30, 300)
        assert st.batches[3].compute_infer.ns == 30 and st.queue.count == 1
        assert h.results[0].compute_ns == (3, 30, 300)  # so an ensemble inside an ensemble adds up too
    run(scenario())


def test_priority_timeout_and_parameters_go_to_the_steps():
    async def scenario():
        h = Harness(CHAIN)
        await h.submit(priority=2, timeout_us=5000, parameters={"k": "v"})
        r = h.models["a"].pending[0].request
        assert (r.priority, r.timeout_us, r.parameters) == (2, 5000, {"k": "v"})
    run(scenario())


def test_cancel_drops_the_queued_steps_and_infer_cancelled_does_too():
    async def scenario():
        h = Harness(CHAIN)
        handle = await h.submit()
        h.scheduler.cancel(handle)
        assert h.models["a"].pending[0].cancelled and h.scheduler.pending_requests == 0
        task = asyncio.ensure_future(h.scheduler.infer(InferRequest(
            "ens", [InferTensor("IN", "FP32", (1, 2), np.zeros((1, 2), np.float32))])))
        await asyncio.sleep(0)  # the task submits
        await asyncio.sleep(0)  # the turn ends: its first step is sent
        assert len(h.models["a"].pending) == 2
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert h.models["a"].pending[1].cancelled and h.scheduler.pending_requests == 0
    run(scenario())


def test_first_steps_go_at_the_end_of_the_turn_and_a_request_cancelled_before_sends_nothing():
    async def scenario():
        h = Harness(CHAIN)
        first = h.submit_only()
        second = h.submit_only()
        assert h.log == [] and h.scheduler.pending_requests == 2  # accepted, not sent yet
        h.scheduler.cancel(second)
        await asyncio.sleep(0)
        assert h.log == ["sent a"] and h.scheduler.pending_requests == 1
        h.models["a"].answer()
        h.models["b"].answer()
        assert len(h.results) == 1 and first.finished
    run(scenario())


def test_wait_idle_returns_once_the_requests_inside_are_answered_and_fail_all_queued_fails_them():
    async def scenario():
        h = Harness(CHAIN)
        await h.submit()
        idle = asyncio.ensure_future(h.scheduler.wait_idle())
        await asyncio.sleep(0)
        assert not idle.done()
        h.models["a"].answer()
        h.models["b"].answer()
        await asyncio.wait_for(idle, 1)
        await h.submit()
        h.scheduler.fail_all_queued("the server is shutting down")
        assert h.results[-1].kind is ErrorKind.UNAVAILABLE
        assert h.results[-1].message == "in ensemble 'ens', the server is shutting down"
        assert h.models["a"].pending[-1].cancelled
        await asyncio.wait_for(h.scheduler.wait_idle(), 1)
    run(scenario())


class TestMaxInflightRequests:
    def test_a_step_at_its_limit_waits_for_one_of_its_requests_to_be_answered(self):
        async def scenario():
            h = Harness(CHAIN, max_inflight_requests=1)
            await h.submit()
            await h.submit()
            assert h.log == ["sent a"]  # the second request's step a waits for the first's
            h.models["a"].answer()
            assert h.log == ["sent a", "answered a", "sent a", "sent b"]  # its slot went to the waiting one
            h.models["b"].answer()
            h.models["a"].answer()
            h.models["b"].answer()
            assert [type(r).__name__ for r in h.results] == ["InferResponse", "InferResponse"]
            assert h.scheduler._inflight == [0, 0]
        run(scenario())

    def test_a_queued_request_cancelled_or_failed_gives_no_slot_away_and_a_failure_frees_its_slot(self):
        async def scenario():
            h = Harness(CHAIN, max_inflight_requests=1)
            await h.submit()
            second = await h.submit()
            await h.submit()
            h.scheduler.cancel(second)  # queued: nothing was sent for it
            h.models["a"].fail(InferenceError(ErrorKind.INTERNAL, "boom"))  # the first fails: the third goes
            assert h.log == ["sent a", "sent a"]
            assert len(h.models["a"].pending) == 1 and h.scheduler.pending_requests == 1
            h.scheduler.fail_all_queued("going away")
            assert h.scheduler._inflight == [0, 0] and h.scheduler.pending_requests == 0
        run(scenario())

    def test_the_limit_is_read_from_the_config(self, tmp_path):
        from gpud.repository.config import parse_config_text
        from gpud.repository.ensemble import ensemble_config_from_proto
        from tests.ensemble_models import ensemble_config, step
        text = ensemble_config("ens", [("IN", "TYPE_FP32", [2])], [("OUT", "TYPE_FP32", [2])],
                               [step("a", {"x": "IN"}, {"y": "OUT"})]).replace(
            "ensemble_scheduling {\n", "ensemble_scheduling {\n  max_inflight_requests: 16\n")
        config, _ = ensemble_config_from_proto(parse_config_text(text, "c"), "ens", "c")
        assert config.ensemble.max_inflight_requests == 16
