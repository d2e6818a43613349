"""gpud.executor.ensemble rule 6: the steps of several ensemble requests go to a model that batches as one request
(the first steps of the requests that came in one turn of the loop; the steps one batch's answers make ready),
each request answered with its own rows. Against scripted step models (what is sent, when, with which rows) and
through the real core and workers (answers equal the steps run by hand; the statistics count every request)."""
from __future__ import annotations

import asyncio
import gc
from concurrent.futures import Future
from types import SimpleNamespace

import numpy as np
import onnxruntime as ort
import pytest

import gpud
from gpud.executor.ensemble import _Group, _joined
from gpud.executor.scheduler import gathering
from gpud.executor.types import ErrorKind, InferenceError, InferRequest, InferResponse, InferTensor
from tests.test_ensemble_scheduler import CHAIN, DIAMOND, Harness, ScriptedModel, run, s
from tests.test_inprocess import NODE


class GroupingModel(ScriptedModel):
    """A scripted step model that batches: it takes groups (members > 1) of at most max_batch_size rows."""

    takes_groups = True

    def __init__(self, name: str, log: list[str], max_batch_size: int = 8):
        super().__init__(name, log)
        self.config = SimpleNamespace(max_batch_size=max_batch_size)
        self.members: list[int] = []

    def submit(self, request: InferRequest, done, members: int = 1):
        p = super().submit(request, done)
        self.members.append(members)
        return p

    def withdraw_member(self, p) -> None:
        self.log.append(f"withdrawn one of {self.name}")


def grouping(h: Harness, *names: str, max_batch_size: int = 8) -> Harness:
    for name in names:
        h.models[name] = GroupingModel(name, h.log, max_batch_size)
    return h


def rows_of(model: ScriptedModel) -> list[int]:
    return [p.request.inputs[0].shape[0] for p in model.pending]


def expected(rows: int) -> np.ndarray:
    return np.arange(rows * 2, dtype=np.float32).reshape(rows, 2)  # what Harness.submit sends


def test_the_first_steps_of_one_turns_requests_go_as_one_request_and_each_gets_its_rows():
    async def scenario():
        h = grouping(Harness(CHAIN), "a", "b")
        for rows in (1, 3, 2):
            h.submit_only(rows)
        await asyncio.sleep(0)
        a, b = h.models["a"], h.models["b"]
        assert h.log == ["sent a"] and a.members == [3] and rows_of(a) == [6]
        sent = a.pending[0].request.inputs[0].data
        np.testing.assert_array_equal(sent, np.concatenate([expected(1), expected(3), expected(2)]))
        a.answer(lambda x: x * 10)  # one answer: the three requests' next steps go on as one request again
        assert h.log == ["sent a", "answered a", "sent b"] and b.members == [3] and rows_of(b) == [6]
        b.answer(lambda x: x + 1)
        assert [r.outputs[0].shape for r in h.results] == [(1, 2), (3, 2), (2, 2)]
        for r, rows in zip(h.results, (1, 3, 2)):
            np.testing.assert_array_equal(r.outputs[0].data, expected(rows) * 10 + 1)
        assert h.scheduler.pending_requests == 0 and h.scheduler.stats.success.count == 3
    run(scenario())


def test_the_steps_one_batchs_answers_make_ready_go_as_one_request_over_a_view_of_their_rows():
    async def scenario():
        h = grouping(Harness(CHAIN), "b")  # a answers each request alone, as a scheduler answers a batch
        for _ in range(3):
            h.submit_only(2)
        await asyncio.sleep(0)
        a, b = h.models["a"], h.models["b"]
        assert h.log == ["sent a"] * 3
        out = np.arange(12, dtype=np.float32).reshape(6, 2)  # the batch's output; each request's rows a view of it
        with gathering():  # what a model's scheduler does while it delivers one batch's answers
            for k in range(3):
                p = a.pending.pop(0)
                p.done(InferResponse("a", "1", [InferTensor("y", "FP32", (2, 2), out[2 * k:2 * k + 2])]))
            assert "sent b" not in h.log  # not before the last answer is out
        assert h.log[-1] == "sent b" and b.members == [3]
        sent = b.pending[0].request.inputs[0].data
        assert np.shares_memory(sent, out) and sent.shape == (6, 2)  # no copy: the rows lie in order in `out`
        b.answer()
        for k, r in enumerate(h.results):
            np.testing.assert_array_equal(r.outputs[0].data, out[2 * k:2 * k + 2] + 1)
    run(scenario())


def test_a_group_goes_in_requests_of_at_most_the_models_max_batch_size_rows():
    async def scenario():
        h = grouping(Harness(CHAIN), "a", max_batch_size=4)
        for rows in (2, 1, 2, 3, 1):
            h.submit_only(rows)
        await asyncio.sleep(0)
        a = h.models["a"]
        assert rows_of(a) == [3, 2, 4] and a.members == [2, 1, 2]  # in order: 2+1, 2 (+3 is over), 3+1
    run(scenario())


def test_requests_that_differ_in_shape_priority_or_parameters_go_apart_and_a_model_that_does_not_batch_gets_each():
    async def scenario():
        h = grouping(Harness(CHAIN), "a")
        h.submit_only(1)
        h.submit_only(1, priority=2)
        h.submit_only(1, parameters={"k": "v"})
        h.submit_only(1, priority=2)
        h.submit_only(2)
        await asyncio.sleep(0)
        a = h.models["a"]
        assert sorted(zip(a.members, rows_of(a))) == [(1, 1), (2, 2), (2, 3)]  # [1 + 2 rows], [2x priority 2], [k]
        plain = Harness(CHAIN)  # ScriptedModel: takes no groups
        for _ in range(3):
            plain.submit_only(1)
        await asyncio.sleep(0)
        assert plain.log == ["sent a"] * 3
    run(scenario())


def test_a_cancelled_member_leaves_the_group_and_the_group_is_withdrawn_when_none_is_left():
    async def scenario():
        h = grouping(Harness(CHAIN), "a")
        first, second = h.submit_only(1), h.submit_only(1)
        await asyncio.sleep(0)
        a = h.models["a"]
        h.scheduler.cancel(first)
        assert not a.pending[0].cancelled  # the other member still waits for it
        assert h.log[-1] == "withdrawn one of a"  # and the model counts one request fewer for the group
        h.scheduler.cancel(second)
        assert a.pending[0].cancelled and h.scheduler.pending_requests == 0
        cancelled_before = h.submit_only(1)
        h.scheduler.cancel(cancelled_before)
        h.submit_only(1)
        await asyncio.sleep(0)
        assert a.members == [2, 1]  # the cancelled one was left out before sending
        a.pending.pop(0)
        a.answer()
        assert len(h.results) == 0 and h.models["b"].log[-1] == "sent b"
    run(scenario())


def test_a_group_refused_or_failed_fails_each_request_naming_the_step():
    async def scenario():
        h = grouping(Harness(CHAIN), "a")
        h.models["a"].refuse = InferenceError(ErrorKind.UNAVAILABLE, "Exceeds maximum queue size")
        h.submit_only(1)
        h.submit_only(1)
        await asyncio.sleep(0)
        assert [e.message for e in h.results] == ["in ensemble 'ens', step 0 (model 'a'): Exceeds maximum queue "
                                                  "size"] * 2
        h.models["a"].refuse = None
        h.results.clear()
        h.submit_only(1)
        h.submit_only(1)
        await asyncio.sleep(0)
        h.models["a"].fail(InferenceError(ErrorKind.INTERNAL, "model 'a' failed: boom"))
        assert [e.kind for e in h.results] == [ErrorKind.INTERNAL] * 2
        assert h.scheduler.pending_requests == 0 and h.scheduler.stats.fail.count == 4
    run(scenario())


def test_parallel_steps_and_their_join_go_as_groups_too():
    async def scenario():
        h = grouping(Harness(DIAMOND), "a", "b", "c", "d")
        h.submit_only(1)
        h.submit_only(2)
        await asyncio.sleep(0)
        h.models["a"].answer()
        assert h.log == ["sent a", "answered a", "sent b", "sent c"]
        h.models["c"].answer()
        h.models["b"].answer()
        assert h.log[-1] == "sent d" and h.models["d"].members == [2]
        h.models["d"].answer()
        assert [r.outputs[0].shape for r in h.results] == [(1, 2), (2, 2)]
    run(scenario())


def test_joined_is_a_view_only_over_arrays_that_lie_in_order_in_one_array():
    base = np.arange(20, dtype=np.float32).reshape(10, 2)
    view = _joined([base[2:4], base[4:5], base[5:8]])
    assert np.shares_memory(view, base) and view.shape == (6, 2)
    np.testing.assert_array_equal(view, base[2:8])
    for parts in ([base[4:5], base[2:4]], [base[2:4], base[5:8]], [base[2:4], np.ones((1, 2), np.float32)],
                  [base[::2][:2], base[::2][2:3]]):
        out = _joined(parts)
        assert not np.shares_memory(out, base)
        np.testing.assert_array_equal(out, np.concatenate(parts))
    words = np.array([[b"a"], [b"bc"], [b"def"]], dtype=object)  # BYTES elements: copied, never a view
    out = _joined([words[0:1], words[1:3]])
    assert out.base is not words and out.tolist() == words.tolist()


@pytest.mark.slow
def test_through_the_core_one_turns_requests_run_as_one_batch_per_step_with_the_answers_by_hand(tmp_path):
    from gpud.examples import write_pipeline_example
    write_pipeline_example(tmp_path)
    rng = np.random.default_rng(7)
    images = [rng.integers(0, 256, (rows, 16), dtype=np.uint8) for rows in (1, 2, 1, 3, 1)]
    steps = ("preprocess", "classifier", "postprocess")
    with gpud.Server(tmp_path, node=NODE, placement_control="off") as s:
        before = {m: s.model_statistics(m)[0].stats for m in steps}
        answers: list[Future] = [Future() for _ in images]

        def submit_all() -> None:  # in the server's loop, all in one turn (as a front end reads a burst)
            for image, answer in zip(images, answers):
                request = InferRequest("pipeline", [InferTensor("IMAGE", "UINT8", image.shape, image)])
                s._parts.core.submit(request, answer.set_result)
        s._loop.call_soon_threadsafe(submit_all)
        got = [a.result(timeout=60) for a in answers]
        after = {m: s.model_statistics(m)[0].stats for m in steps}
    sessions = {m: ort.InferenceSession(str(tmp_path / m / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
                for m in steps}
    for image, response in zip(images, got):
        features = sessions["preprocess"].run(None, {"raw": image})[0]
        logits = sessions["classifier"].run(None, {"features": features})[0]
        probabilities, label = sessions["postprocess"].run(None, {"logits": logits})
        out = {t.name: t.data for t in response.outputs}
        np.testing.assert_allclose(out["PROBABILITIES"], probabilities, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(out["LABEL"], label)
    for m in steps:
        b, a = before[m], after[m]
        # five requests (eight rows), one batch: every request counted, as if each had been sent on its own
        assert (a.success.count - b.success.count, a.inference_count - b.inference_count,
                a.execution_count - b.execution_count) == (5, 8, 1), m


def test_an_answered_group_is_freed_at_once_not_left_to_the_cyclic_collector():
    # Its handle's callback holds the group: a group that kept its handle would live until a gc pass, with every
    # tensor it holds (and make the collector run far more often under load).
    async def scenario():
        h = grouping(Harness(CHAIN), "a")
        first = h.submit_only(1)
        h.submit_only(1)
        await asyncio.sleep(0)
        assert isinstance(first.in_flight[0][0], _Group)
        gc.collect()  # what earlier tests left to the collector
        gc.disable()
        try:
            h.models["a"].answer()
            assert not [o for o in gc.get_objects() if type(o) is _Group]  # freed by reference counting alone
        finally:
            gc.enable()
    run(scenario())


def test_requests_that_want_different_outputs_of_a_step_go_apart():
    # What a step asks its model for depends on the outputs its request wants (rule 2): requests that want
    # different ones must not share a step's request.
    steps = [s("a", {"x": "IN"}, {"y": "m", "z": "OUT2"}), s("b", {"x": "m"}, {"y": "OUT"})]

    async def scenario():
        h = grouping(Harness(steps, outputs=("OUT", "OUT2")), "a", "b")
        h.submit_only(1, outputs=["OUT"])
        h.submit_only(1)
        await asyncio.sleep(0)
        a = h.models["a"]
        assert sorted([o.name for o in p.request.outputs] for p in a.pending) == [["y"], ["y", "z"]]
        a.answer()
        a.answer()
        h.models["b"].answer()
        h.models["b"].answer()
        assert sorted(sorted(t.name for t in r.outputs) for r in h.results) == [["OUT"], ["OUT", "OUT2"]]
    run(scenario())


def test_a_step_at_its_max_inflight_requests_joins_a_group_when_a_slot_frees():
    async def scenario():
        h = grouping(Harness(CHAIN, max_inflight_requests=2), "a", "b")
        for _ in range(3):
            h.submit_only(1)
        await asyncio.sleep(0)
        a = h.models["a"]
        assert a.members == [2]  # the third waits for a slot of step a
        a.answer()  # two slots free: the third's step a goes; the two go on to b as one
        assert a.members == [2, 1] and h.models["b"].members == [2]
        a.answer()
        h.models["b"].answer()
        h.models["b"].answer()
        assert len(h.results) == 3 and all(isinstance(r, InferResponse) for r in h.results)
        assert h.scheduler._inflight == [0, 0]
    run(scenario())
