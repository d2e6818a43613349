"""End to end: `gpudctl place` of a model repository on a node description, offline, is the placement the daemon
makes of the same repository on the same node (one translation of repository, devices and pins, both ways)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gpud.examples import write_example_repository
from tests.daemon_harness import ROOT, start_daemon

pytestmark = pytest.mark.slow
NODE = "config/nodes/hgx-h100-4gpu-mig.yaml"  # 2 whole H100, one cut 2x 3g.40gb, one cut 7x 1g.10gb


@pytest.fixture
def repo(tmp_path):
    repo = tmp_path / "repo"
    write_example_repository(repo)
    # mlp: two instances pinned to GPU 3 (its MIG slices) and one on the CPU: two demands, pins resolved to MIG ids
    cfg = (repo / "mlp" / "config.pbtxt").read_text()
    start = cfg.index("instance_group")
    end = cfg.index("]", start) + 1
    (repo / "mlp" / "config.pbtxt").write_text(
        cfg[:start] + "instance_group [ { count: 2, kind: KIND_GPU, gpus: [3] }, { count: 1, kind: KIND_CPU } ]"
        + cfg[end:])
    # two_input: three instances, wherever the strategy puts them
    (repo / "two_input" / "config.pbtxt").write_text((repo / "two_input" / "config.pbtxt").read_text()
                                                     + "\ninstance_group [ { count: 3 } ]\n")
    return repo


@pytest.mark.parametrize("strategy", ["pack", "spread"])
def test_offline_plan_is_what_the_daemon_does(repo, tmp_path, strategy):
    out = subprocess.run([sys.executable, "-m", "gpud.cli", "place", "--devices", str(ROOT / NODE), "--models",
                          str(repo), "--strategy", strategy, "-o", "json"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    planned = sorted((p["model"], p["instance"], p["device"]) for p in json.loads(out.stdout)["placements"])
    assert ("mlp:1:1", 0, "cpu") in planned  # the CPU group
    assert sorted(d for m, _, d in planned if m == "mlp:1:0") == sorted(
        d for m, _, d in planned if m == "mlp:1:0" and d.startswith("gpu3/mig"))  # pinned to GPU 3
    assert len(planned) == 2 + 1 + 3 + 1  # mlp 2 + 1, two_input 3, cnn 1

    daemon = start_daemon(repo, tmp_path, "--placement-strategy", strategy, node=NODE)
    try:
        data = daemon.inspect()
        # the daemon's current placement, in the planner's names (gpud.inspect_view publishes it)
        live = sorted((p["model"], p["instance"], p["device"]) for p in data["placement"]["placements"])
        assert live == planned
        # and in its own terms: mlp's instances 0, 1 on GPU 3's slices, instance 2 on the CPU
        mlp = next(m for m in data["models"] if m["name"] == "mlp")
        assert sorted(i["index"] for i in mlp["instances"]) == [0, 1, 2]
        assert next(i["device"] for i in mlp["instances"] if i["index"] == 2) == "cpu"
        assert all(m["state"] == "READY" for m in data["models"])
    finally:
        assert daemon.stop() == 0, daemon.log()
