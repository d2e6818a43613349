"""systemd/gpud.service: systemd accepts it, it is a notify service, and gpud speaks sd_notify."""
from __future__ import annotations

import shutil
import socket
import subprocess

import pytest

from gpud.systemd_notify import notify
from tests.daemon_harness import ROOT

UNIT = ROOT / "systemd" / "gpud.service"


def test_unit_is_a_notify_service_stopped_by_sigterm():
    text = UNIT.read_text()
    for line in ("Type=notify", "KillSignal=SIGTERM", "Restart=on-failure", "ExecStart=/usr/local/bin/gpud"):
        assert line in text


def test_systemd_analyze_verifies_the_unit(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze not installed (Debian package 'systemd')")
    # verify insists that ExecStart exists: point it at this checkout's gpud entry point.
    gpud = shutil.which("gpud") or str(ROOT / ".venv" / "bin" / "gpud")
    unit = tmp_path / "gpud.service"
    unit.write_text(UNIT.read_text().replace("/usr/local/bin/gpud", gpud))
    out = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    problems = [line for line in (out.stdout + out.stderr).splitlines()
                if "gpud.service" in line and "Documentation" not in line]
    assert out.returncode == 0 and problems == [], out.stdout + out.stderr


def test_sd_notify_reaches_the_socket(tmp_path, monkeypatch):
    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as server:
        server.bind(path)
        monkeypatch.setenv("NOTIFY_SOCKET", path)
        assert notify("READY=1")
        assert server.recv(64) == b"READY=1"


def test_sd_notify_is_silent_outside_systemd(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert notify("READY=1") is False
