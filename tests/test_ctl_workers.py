"""gpudctl inspect's WORKERS section: each device worker's process and how often gpud lost it."""
from __future__ import annotations

from gpud.cli.inspect import render_inspect

BASE = {"server": {"version": "0.1.0"}, "device_source": "simulated", "devices": [], "models": []}


def test_workers_section_shows_pid_state_and_losses_by_cause():
    text = render_inspect(BASE | {"workers": [
        {"device": "gpu1/mig1.0", "pid": None, "alive": False, "restarts": 2, "failures": {"died": 0, "hung": 2}},
        {"device": "cpu", "pid": 4242, "alive": True, "restarts": 1, "failures": {"died": 1, "hung": 0}}]})
    lines = text.splitlines()
    start = lines.index("WORKERS")
    cpu, mig = lines[start + 2].split(), lines[start + 3].split()
    assert cpu == ["cpu", "4242", "up", "1", "0"]
    assert mig == ["gpu1/mig1.0", "-", "restarting", "0", "2"]


def test_no_workers_no_section():
    assert "WORKERS" not in render_inspect(BASE | {"workers": []})
    assert "WORKERS" not in render_inspect(BASE)
