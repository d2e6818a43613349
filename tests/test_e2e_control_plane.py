"""The closed control plane, end to end on the real daemon: by default (--model-control-mode none) the repository API
cannot load or unload models; with an admin token, load/unload/placement need it over HTTP and gRPC; model names that
could reach outside the repository are refused with 400 on every route that takes one; poll mode picks up a model
added to the repository."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import pytest

from gpud.examples import write_example_repository
from gpud.proto import grpc_service_pb2 as pb
from gpud.proto import grpc_service_pb2_grpc as pb_grpc
from tests.daemon_harness import start_daemon, wait_for

pytestmark = pytest.mark.slow
TOKEN = "s3cret-token-for-tests-0123456789"


def post(daemon, path: str, body: dict | None = None, token: str | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(f"http://{daemon.http_url}{path}", data=json.dumps(body or {}).encode(),
                                 method="POST", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            data = r.read()
            return r.status, json.loads(data) if data else {}
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def get_status(daemon, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://{daemon.http_url}{path}", timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.fixture
def repo(tmp_path):
    repo = tmp_path / "repo"
    write_example_repository(repo, ["mlp", "cnn"])
    return repo


def test_by_default_the_repository_api_cannot_change_models(repo, tmp_path):
    daemon = start_daemon(repo, tmp_path)
    try:
        status, body = post(daemon, "/v2/repository/models/cnn/unload")
        assert status == 503 and "--model-control-mode explicit" in body["error"]  # Triton's code
        assert get_status(daemon, "/v2/models/cnn/ready") == 200  # still served
        with grpc.insecure_channel(daemon.grpc_url) as channel:
            with pytest.raises(grpc.RpcError) as exc:
                pb_grpc.GRPCInferenceServiceStub(channel).RepositoryModelUnload(
                    pb.RepositoryModelUnloadRequest(model_name="cnn"), timeout=30)
            assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        assert daemon.stop() == 0, daemon.log()


def test_with_an_admin_token_model_control_and_placement_need_it(repo, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    daemon = start_daemon(repo, tmp_path, "--model-control-mode", "explicit", "--load-model", "mlp",
                          "--admin-token-file", str(token_file))
    try:
        assert get_status(daemon, "/v2/models/mlp/ready") == 200
        assert get_status(daemon, "/v2/models/cnn/ready") != 200  # explicit: only --load-model at start
        index = post(daemon, "/v2/repository/index")[1]
        assert {"name": "cnn", "version": "", "state": "UNAVAILABLE", "reason": "unloaded"} in index
        for path, body in [("/v2/repository/models/cnn/load", None), ("/v2/repository/models/mlp/unload", None),
                           ("/v2/gpud/placement", {"placements": []})]:
            for token in (None, "wrong-token-wrong-token"):
                status, answer = post(daemon, path, body, token)
                assert status == 401 and "admin token" in answer["error"], (path, token, answer)
        assert get_status(daemon, "/v2/models/cnn/ready") != 200  # nothing changed
        assert post(daemon, "/v2/repository/models/cnn/load", token=TOKEN)[0] == 200
        assert get_status(daemon, "/v2/models/cnn/ready") == 200
        with grpc.insecure_channel(daemon.grpc_url) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            with pytest.raises(grpc.RpcError) as exc:
                stub.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name="cnn"), timeout=30)
            assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
            stub.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name="cnn"), timeout=60,
                                       metadata=(("authorization", f"Bearer {TOKEN}"),))
        assert get_status(daemon, "/v2/models/cnn/ready") != 200
        # reading and inference need no token
        assert get_status(daemon, "/v2/gpud/inspect") == 200
        # gpudctl sends the token from --token-file (or $GPUD_ADMIN_TOKEN_FILE)
        from gpud.cli.main import main as gpudctl

        argv = ["place", "--devices", "live", "--models", "live", "--current", "live", "--apply",
                "--url", daemon.http_url]
        assert gpudctl(argv) != 0  # refused without the token
        assert gpudctl(argv + ["--token-file", str(token_file)]) == 0
    finally:
        assert daemon.stop() == 0, daemon.log()


@pytest.mark.parametrize("name", ["..", "%2E%2E", "..%2F..%2Fetc", ".hidden", "a%00b", "%2Fetc%2Fpasswd"])
def test_names_that_could_leave_the_repository_are_refused_on_every_route(repo, tmp_path_factory, name, request):
    daemon = request.getfixturevalue("explicit_daemon")
    routes = [("GET", f"/v2/models/{name}"), ("GET", f"/v2/models/{name}/ready"),
              ("GET", f"/v2/models/{name}/config"), ("GET", f"/v2/models/{name}/stats"),
              ("POST", f"/v2/models/{name}/infer"), ("POST", f"/v2/repository/models/{name}/load"),
              ("POST", f"/v2/repository/models/{name}/unload")]
    for method, path in routes:
        if method == "GET":
            status = get_status(daemon, path)
        else:
            status = post(daemon, path, {"inputs": []} if path.endswith("infer") else None)[0]
        assert status in (400, 404), (path, status)  # a route that cannot match ("/" in it) is a 404
        assert status != 500
    assert get_status(daemon, "/v2/health/ready") == 200


@pytest.fixture(scope="module")
def explicit_daemon(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("explicit")
    repo = tmp / "repo"
    write_example_repository(repo, ["mlp"])
    daemon = start_daemon(repo, tmp, "--model-control-mode", "explicit", "--load-model", "*")
    yield daemon
    assert daemon.stop() == 0, daemon.log()
    assert "Traceback" not in daemon.log()


def test_poll_mode_loads_a_model_added_to_the_repository(repo, tmp_path):
    daemon = start_daemon(repo, tmp_path, "--model-control-mode", "poll", "--repository-poll-secs", "0.5")
    try:
        assert get_status(daemon, "/v2/models/two_input/ready") == 404
        write_example_repository(repo, ["two_input"])
        wait_for(lambda: get_status(daemon, "/v2/models/two_input/ready") == 200, 60,
                 "the poll to load the new model")
        assert post(daemon, "/v2/repository/models/mlp/unload")[0] == 200  # the API works in poll mode too
    finally:
        assert daemon.stop() == 0, daemon.log()
    assert "repository poll: model two_input new" in daemon.log()
