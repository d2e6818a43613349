"""HTTP header plans (gpud.api.http_infer._BinaryPlan) used as request signatures by the schedulers'
PreparedCache, with requested-output subsets, several models sharing one header, and batched answers encoded from
views into one copy."""
from __future__ import annotations

import asyncio
import copy

import numpy as np
import orjson
import pytest
import tritonclient.http as httpclient

from gpud.executor.model_config import DynamicBatching, ModelConfig, TensorSpec
from gpud.executor.dynamic_scheduler import DynamicScheduler
from gpud.executor.types import ErrorKind, InferenceError, InferResponse
from gpud.api.http_infer import INFER_HEADER_CONTENT_LENGTH, decode_infer_request, encode_infer_response
from tests.test_scheduler_edges import Worker, _instance

M = ModelConfig(name="m", max_batch_size=8, inputs=(TensorSpec("x", "FP32", (2,)),),
                outputs=(TensorSpec("y", "FP32", (2,)), TensorSpec("z", "FP32", (2,))),
                dynamic_batching=DynamicBatching())
NARROW = ModelConfig(name="n", max_batch_size=8, inputs=(TensorSpec("x", "FP32", (3,)),),
                     outputs=(TensorSpec("y", "FP32", (3,)),), dynamic_batching=DynamicBatching())

HEADER = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "parameters": {"binary_data_size": 8}}],
          "outputs": [{"name": "z", "parameters": {"binary_data": True}}], "id": "same"}


def _body(values) -> tuple[bytes, str]:
    header = orjson.dumps(HEADER)
    return header + np.asarray(values, np.float32).tobytes(), str(len(header))


def _decode(values, model: str):
    body, length = _body(values)
    return decode_infer_request(body, length, model, "")


@pytest.fixture
def schedulers():
    worker = Worker()
    made = []
    out = {}
    for config in (M, NARROW):
        s = DynamicScheduler(config, "1")
        inst = _instance(worker, config)
        s.add_instance(inst)
        made.append(inst)
        out[config.name] = s
    yield out, worker
    for inst in made:
        inst.close_segments()


def test_one_header_for_two_models_is_validated_per_model_and_answered_per_request(schedulers):
    sched, worker = schedulers

    async def run():
        answers: dict[int, bytes] = {}
        requests = {}
        # The same header for a model whose input it does not fit: refused each time, by that model only.
        for _ in range(2):
            with pytest.raises(InferenceError) as e:
                sched["n"].submit(_decode([1, 2], "n"), lambda r: pytest.fail("answered"))
            assert e.value.kind is ErrorKind.INVALID_ARGUMENT
        outputs_before = None
        for i in range(4):
            request = _decode([i, 10 * i], "m")
            requests[i] = request
            if outputs_before is None:
                outputs_before = copy.deepcopy(request.outputs), dict(request.parameters)

            def done(result, i=i, request=request):
                assert isinstance(result, InferResponse), result
                answers[i] = encode_infer_response(result, request)

            sched["m"].submit(request, done)
        assert len({id(r.signature) for r in requests.values()}) == 1  # one plan: one validation reused
        worker.finish()  # request 0 alone
        worker.finish()  # requests 1-3 together: answers are views into one copy
        assert sorted(answers) == [0, 1, 2, 3]
        for i, encoded in answers.items():
            result = httpclient.InferResult.from_response_body(
                encoded.body, header_length=int(encoded.headers[INFER_HEADER_CONTENT_LENGTH]))
            doc = result.get_response()
            assert [o["name"] for o in doc["outputs"]] == ["z"] and doc["id"] == "same"
            assert doc["model_name"] == "m"
            np.testing.assert_array_equal(result.as_numpy("z"), [[i + 100, 10 * i + 100]])
        # Nothing shared across the plan's requests was changed by validating, batching or encoding them.
        assert (requests[3].outputs, requests[3].parameters) == outputs_before
        assert len(requests[0].signature.answers) == 1
        # And model n, given the plan that model m validated, still refuses it.
        with pytest.raises(InferenceError):
            sched["n"].submit(_decode([5, 6], "n"), lambda r: pytest.fail("answered"))

    asyncio.run(run())


def test_the_encoded_header_cache_is_per_model(schedulers):
    sched, worker = schedulers
    request = _decode([1, 2], "m")
    from gpud.executor.types import InferTensor
    z = InferTensor("z", "FP32", (1, 2), np.array([[3, 4]], np.float32))
    first = encode_infer_response(InferResponse("m", "1", [z], id="same"), request)
    other = encode_infer_response(InferResponse("other", "1", [z], id="same"), _decode([1, 2], "other"))
    assert orjson.loads(first.body[:int(first.headers[INFER_HEADER_CONTENT_LENGTH])])["model_name"] == "m"
    assert orjson.loads(other.body[:int(other.headers[INFER_HEADER_CONTENT_LENGTH])])["model_name"] == "other"
