"""gpudctl inspect's WORKERS section: each device worker's process, its state and how often gpud lost it."""
from __future__ import annotations

from gpud.cli.inspect import render_inspect

BASE = {"server": {"version": "0.1.0"}, "device_source": "simulated", "devices": [], "models": []}


def test_workers_section_shows_pid_state_and_losses_by_cause():
    text = render_inspect(BASE | {"workers": [
        {"device": "gpu1/mig1.0", "pid": None, "alive": False, "restarts": 2, "failures": {"died": 0, "hung": 2}},
        {"device": "cpu", "pid": 4242, "alive": True, "restarts": 1, "failures": {"died": 1, "hung": 0}},
        {"device": "gpu0", "pid": 77, "alive": False, "restarts": 3, "failures": {"died": 3, "hung": 0},
         "unhealthy_reason": "crash loop: its worker died 3 times within 120 s (last: exit code 1)"}]})
    lines = text.splitlines()
    start = lines.index("WORKERS")
    cpu, gpu0, mig = (lines[start + k].split() for k in (2, 3, 4))
    assert cpu == ["cpu", "4242", "up", "1", "0"]
    assert gpu0 == ["gpu0", "77", "crashloop", "3", "0"]  # given up on: not restarted again
    assert mig == ["gpu1/mig1.0", "-", "restarting", "0", "2"]


def test_instances_in_the_servers_own_process_say_so():
    text = render_inspect(BASE | {"workers": [
        {"device": "cpu", "pid": 99, "alive": True, "restarts": 0, "failures": {"died": 0, "hung": 0},
         "in_process": True}]})
    lines = text.splitlines()
    assert lines[lines.index("WORKERS") + 2].split() == ["cpu", "99", "in-process", "0", "0"]


def test_no_workers_no_section():
    assert "WORKERS" not in render_inspect(BASE | {"workers": []})
    assert "WORKERS" not in render_inspect(BASE)
