"""Security checks on the real daemon that tests/test_e2e_control_plane.py does not make: path traversal through the
version routes, the placement route and every gRPC RPC that takes a model name; load refused over gRPC without the
token; load refused over both protocols by default (--model-control-mode none); the default itself. Nothing that is
refused changes anything, and nothing is logged as an error."""
from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request

import grpc
import pytest

from gpud.examples import write_example_repository
from gpud.main import build_parser, resolve_settings
from gpud.proto import grpc_service_pb2 as pb
from gpud.proto import grpc_service_pb2_grpc as pb_grpc
from tests.daemon_harness import start_daemon
from tests.fuzz_support import TOKEN, assert_clean_log, start_fuzz_daemon

pytestmark = pytest.mark.slow
TRAVERSALS = ["..", "../mlp", "../../etc/passwd", "/etc/passwd", ".hidden", "a\0b", "mlp/../mlp", "\\..\\x", "."]
TIMEOUT_S = 30


def request(daemon, method: str, path: str, body: dict | None = None, token: str | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
    req = urllib.request.Request(f"http://{daemon.http_url}{path}", data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as r:
            raw = r.read()
            return r.status, json.loads(raw) if raw else {}
    except urllib.error.HTTPError as e:
        raw = e.read()
        return e.code, json.loads(raw) if raw else {}


def quoted(name: str) -> str:
    return urllib.parse.quote(name, safe="")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = start_fuzz_daemon(tmp_path_factory.mktemp("security"))  # explicit mode, every model loaded, a token
    yield d
    assert d.stop() == 0, d.log()
    assert_clean_log(d)


def inspect_instances(daemon) -> list:
    return sorted((m["name"], len(m.get("instances", []))) for m in daemon.inspect()["models"])


@pytest.mark.parametrize("name", TRAVERSALS)
def test_traversal_in_version_routes_and_placement_is_refused_and_changes_nothing(daemon, name):
    before = inspect_instances(daemon)
    for tail in ("", "/ready", "/config", "/stats"):
        for path in (f"/v2/models/{quoted(name)}/versions/1{tail}", f"/v2/models/mlp/versions/{quoted(name)}{tail}"):
            status, _ = request(daemon, "GET", path)
            assert status in (400, 404), (path, status)
    for path in (f"/v2/models/{quoted(name)}/versions/1/infer", f"/v2/models/mlp/versions/{quoted(name)}/infer"):
        status, _ = request(daemon, "POST", path, {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 256],
                                                                "data": [0.0] * 256}]})
        assert status in (400, 404), (path, status)
    status, answer = request(daemon, "POST", "/v2/gpud/placement",
                             {"placements": [{"model": name, "instance": 0, "device": "cpu"}]}, TOKEN)
    assert status == 400, answer
    assert inspect_instances(daemon) == before


@pytest.mark.parametrize("name", TRAVERSALS)
def test_traversal_in_every_grpc_rpc_that_takes_a_model_name(daemon, name):
    token = (("authorization", f"Bearer {TOKEN}"),)
    with grpc.insecure_channel(daemon.grpc_url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        calls = [
            (stub.ModelMetadata, pb.ModelMetadataRequest(name=name), None),
            (stub.ModelConfig, pb.ModelConfigRequest(name=name), None),
            (stub.ModelStatistics, pb.ModelStatisticsRequest(name=name), None),
            (stub.ModelMetadata, pb.ModelMetadataRequest(name="mlp", version=name), None),
            (stub.ModelInfer, pb.ModelInferRequest(model_name=name, inputs=[pb.ModelInferRequest.InferInputTensor(
                name="input", datatype="FP32", shape=[1, 256])], raw_input_contents=[b"\0" * 1024]), None),
            (stub.RepositoryModelLoad, pb.RepositoryModelLoadRequest(model_name=name), token),
            (stub.RepositoryModelUnload, pb.RepositoryModelUnloadRequest(model_name=name), token),
        ]
        for method, message, metadata in calls:
            with pytest.raises(grpc.RpcError) as e:
                method(message, timeout=TIMEOUT_S, metadata=metadata)
            assert e.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), \
                (method, e.value.code(), e.value.details())
        try:  # an unknown model is "not ready" (Triton's answer); a name that is no model name is refused
            assert not stub.ModelReady(pb.ModelReadyRequest(name=name), timeout=TIMEOUT_S).ready
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e
        assert stub.ModelReady(pb.ModelReadyRequest(name="mlp"), timeout=TIMEOUT_S).ready


def test_grpc_load_needs_the_token(daemon):
    with grpc.insecure_channel(daemon.grpc_url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for metadata in (None, (("authorization", "Bearer wrong-token-wrong-token"),), (("authorization", TOKEN),)):
            with pytest.raises(grpc.RpcError) as e:
                stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="mlp"), timeout=TIMEOUT_S,
                                         metadata=metadata)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, metadata


def test_the_default_model_control_mode_is_none():
    assert resolve_settings(build_parser().parse_args([])).model_control_mode == "none"


def test_by_default_load_is_refused_over_both_protocols(tmp_path):
    repo = tmp_path / "repo"
    write_example_repository(repo, ["mlp"])
    daemon = start_daemon(repo, tmp_path, node=None)  # no --model-control-mode: none
    try:
        status, answer = request(daemon, "POST", "/v2/repository/models/mlp/load")
        assert status == 503 and "--model-control-mode" in answer["error"]  # Triton's code
        with grpc.insecure_channel(daemon.grpc_url) as channel:
            with pytest.raises(grpc.RpcError) as e:
                pb_grpc.GRPCInferenceServiceStub(channel).RepositoryModelLoad(
                    pb.RepositoryModelLoadRequest(model_name="mlp"), timeout=TIMEOUT_S)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert request(daemon, "GET", "/v2/models/mlp/ready")[0] == 200
    finally:
        assert daemon.stop() == 0, daemon.log()
    assert_clean_log(daemon)
