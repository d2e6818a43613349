"""SIGHUP (the unit's ExecReload=) on the real daemon, under load from HTTP and gRPC clients: the settings file is
read again and its live settings applied, the repository re-read (a new version takes over with no gap, even in the
default model control mode none), zero requests fail; systemd hears RELOADING=1 / READY=1 with a STATUS= saying what
the reload did; a bad settings file is refused with a clear log line and changes nothing."""
from __future__ import annotations

import signal
import socket

import pytest
import yaml

from tests.daemon_harness import save, slow_model, start_daemon, wait_for
from tests.test_e2e_control import CONFIG, WIDTH, Load

pytestmark = pytest.mark.slow


def _received(server: socket.socket) -> list[str]:
    out = []
    while True:
        try:
            out.append(server.recv(4096).decode())
        except BlockingIOError:
            return out


def test_a_sighup_reload_under_load_fails_no_request_and_a_bad_settings_file_changes_nothing(tmp_path):
    repo = tmp_path / "repo"
    save(slow_model(width=WIDTH, layers=100), repo, "slow", CONFIG)
    settings = tmp_path / "gpud.yaml"
    settings.write_text(yaml.safe_dump({"log_level": "INFO", "hints_target_queue_seconds": 0.01}))
    notify_path = str(tmp_path / "notify.sock")
    notifications = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notifications.bind(notify_path)
    notifications.setblocking(False)
    daemon = start_daemon(repo, tmp_path, "--config", str(settings), "--placement-control", "off",
                          env={"NOTIFY_SOCKET": notify_path})

    def reloads() -> dict:
        return daemon.inspect()["reload"]

    def served() -> list[tuple[str, bool]]:
        return [(m["version"], m["state"] == "READY") for m in daemon.inspect()["models"] if m["name"] == "slow"]

    try:
        assert served() == [("1", True)] and reloads()["reloads"] == 0
        with Load(daemon, http_clients=2, grpc_clients=2) as load:
            wait_for(lambda: load.ok["http"] > 20 and load.ok["grpc"] > 20, 60, "requests served before the reload")
            # A new version in the repository, live settings changed, and one that needs a restart.
            save(slow_model(width=WIDTH, layers=100, seed=1), repo, "slow", version=2)
            settings.write_text(yaml.safe_dump({"log_level": "DEBUG", "hints_target_queue_seconds": 0.02,
                                                "http_max_connections": 5000, "default_max_queue_size": 100}))
            daemon.proc.send_signal(signal.SIGHUP)
            wait_for(lambda: reloads()["last"] is not None, 120, "the reload to finish")
            assert served() == [("2", True)]  # version 2 took over; version 1 drained and unloaded
            before = dict(load.ok)
            wait_for(lambda: load.ok["http"] > before["http"] + 20 and load.ok["grpc"] > before["grpc"] + 20, 60,
                     "requests served after the reload")
            first = reloads()["last"]
            assert first["refused"] is None
            assert first["applied"] == ["http_max_connections 10000 -> 5000", "log_level 'INFO' -> 'DEBUG'",
                                        "hints_target_queue_seconds 0.01 -> 0.02"]
            assert first["need_restart"] == ["default_max_queue_size 512 -> 100"]
            assert first["load"] == [{"model": "slow", "why": "changed"}]
            assert daemon.inspect()["hints"]["policy"]["target_queue_seconds"] == 0.02

            # A settings file that does not parse: refused, nothing changes, the repository is not read either.
            settings.write_text("log_level: [DEBUG\n")
            save(slow_model(width=WIDTH, layers=100, seed=2), repo, "slow", version=3)
            daemon.proc.send_signal(signal.SIGHUP)
            wait_for(lambda: reloads()["reloads"] == 2 and reloads()["last"]["refused"] is not None, 60,
                     "the second reload to be refused")
            assert served() == [("2", True)]
            assert daemon.inspect()["hints"]["policy"]["target_queue_seconds"] == 0.02
            before = dict(load.ok)
            wait_for(lambda: load.ok["http"] > before["http"] + 20 and load.ok["grpc"] > before["grpc"] + 20, 60,
                     "requests served after the refused reload")
        assert load.failures == [], load.failures[:5]
        assert load.ok["http"] > 60 and load.ok["grpc"] > 60
    finally:
        assert daemon.stop() == 0, daemon.log()
        messages = _received(notifications)
        notifications.close()
    log = daemon.log()
    assert "reload (SIGHUP): reading the settings from " in log
    assert "reload: default_max_queue_size changed in the settings (512 -> 100) but takes effect only at a restart" in log
    assert "reload done: 3 setting(s) applied, 1 need a restart (default_max_queue_size); repository: changed slow" in log
    assert f"reload refused: {settings}: not valid YAML" in log and "nothing changed" in log
    assert "Traceback" not in log
    # systemd: RELOADING=1, then READY=1 with what the reload did, twice; in order
    reloading = [i for i, m in enumerate(messages) if m.startswith("RELOADING=1\nMONOTONIC_USEC=")]
    statuses = [m for m in messages if "reload at" in m]
    assert len(reloading) == 2 and len(statuses) == 2, messages
    assert statuses[0].startswith("READY=1\nSTATUS=serving 1 model version(s); reload at ")
    assert statuses[0].endswith("3 setting(s) applied, 1 need a restart (default_max_queue_size); repository: changed slow")
    assert "reload refused, nothing changed: " in statuses[1] and "\n" not in statuses[1].split("STATUS=", 1)[1]
