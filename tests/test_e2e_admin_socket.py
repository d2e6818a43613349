"""The admin socket on the real daemon: with --admin-socket alone, loading, unloading and placing are refused over
TCP (HTTP 403, gRPC PERMISSION_DENIED, naming the socket) and served on the socket, where gpudctl reaches them with
--socket or GPUD_ADMIN_SOCKET; with a token too, TCP takes the token. The socket is 0660 and removed at exit."""
from __future__ import annotations

import os
import stat

import grpc
import pytest

from gpud.cli.main import main as gpudctl
from gpud.examples import write_example_repository
from gpud.proto import grpc_service_pb2 as pb
from gpud.proto import grpc_service_pb2_grpc as pb_grpc
from tests.daemon_harness import start_daemon
from tests.test_e2e_control_plane import TOKEN, get_status, post

pytestmark = pytest.mark.slow


@pytest.fixture
def repo(tmp_path):
    repo = tmp_path / "repo"
    write_example_repository(repo, ["mlp", "cnn"])
    return repo


def test_with_an_admin_socket_admin_actions_are_served_there_and_refused_over_tcp(repo, tmp_path, monkeypatch,
                                                                                 capsys):
    path = tmp_path / "admin.sock"
    daemon = start_daemon(repo, tmp_path, "--model-control-mode", "explicit", "--load-model", "*",
                          "--admin-socket", str(path))
    try:
        st = os.stat(path)
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o660
        for route, body in [("/v2/repository/models/cnn/unload", None), ("/v2/repository/models/cnn/load", None),
                            ("/v2/gpud/placement", {"placements": []})]:
            status, answer = post(daemon, route, body, token=TOKEN)
            assert status == 403 and f"served only on the admin socket {path}" in answer["error"], (route, answer)
        with grpc.insecure_channel(daemon.grpc_url) as channel:
            with pytest.raises(grpc.RpcError) as exc:
                pb_grpc.GRPCInferenceServiceStub(channel).RepositoryModelUnload(
                    pb.RepositoryModelUnloadRequest(model_name="cnn"), timeout=30)
            assert exc.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert get_status(daemon, "/v2/models/cnn/ready") == 200  # nothing changed
        # gpudctl over the socket: --socket, or GPUD_ADMIN_SOCKET
        assert gpudctl(["unload", "cnn", "--socket", str(path)]) == 0
        assert get_status(daemon, "/v2/models/cnn/ready") != 200
        monkeypatch.setenv("GPUD_ADMIN_SOCKET", str(path))
        assert gpudctl(["load", "cnn"]) == 0
        assert get_status(daemon, "/v2/models/cnn/ready") == 200
        capsys.readouterr()
        assert gpudctl(["inspect"]) == 0 and "cnn" in capsys.readouterr().out
        assert gpudctl(["place", "--devices", "live", "--models", "live", "--current", "live", "--apply"]) == 0
        monkeypatch.delenv("GPUD_ADMIN_SOCKET")
        # over HTTP, gpudctl is told where to go
        assert gpudctl(["unload", "cnn", "--url", daemon.http_url]) == 1
        assert f"served only on the admin socket {path}" in capsys.readouterr().err
    finally:
        assert daemon.stop() == 0, daemon.log()
    assert not path.exists()
    assert f"over TCP, load, unload and placement are served only on the admin socket {path}" in daemon.log()


def test_with_an_admin_socket_and_a_token_tcp_takes_the_token(repo, tmp_path):
    path = tmp_path / "admin.sock"
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    daemon = start_daemon(repo, tmp_path, "--model-control-mode", "explicit", "--load-model", "*",
                          "--admin-socket", str(path), "--admin-token-file", str(token_file))
    try:
        assert post(daemon, "/v2/repository/models/cnn/unload")[0] == 401
        assert post(daemon, "/v2/repository/models/cnn/unload", token=TOKEN)[0] == 200
        assert gpudctl(["load", "cnn", "--socket", str(path)]) == 0  # no token on the socket
        assert get_status(daemon, "/v2/models/cnn/ready") == 200
    finally:
        assert daemon.stop() == 0, daemon.log()


def test_a_socket_path_in_use_by_a_file_stops_start_up_with_the_reason(repo, tmp_path):
    import subprocess
    import sys

    from tests.daemon_harness import ROOT

    path = tmp_path / "admin.sock"
    path.write_text("not a socket")
    out = subprocess.run([sys.executable, "-m", "gpud.main", "--model-repository", str(repo), "--address",
                          "127.0.0.1", "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0",
                          "--node", str(ROOT / "config/nodes/dgx-a100-2gpu-mig.yaml"), "--admin-socket", str(path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert f"cannot start serving: [Errno 17] admin socket path {path} exists and is not a socket" in out.stderr
    assert path.read_text() == "not a socket"
