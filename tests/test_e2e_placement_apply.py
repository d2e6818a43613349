"""End to end: `gpudctl place --devices live --models live --current live --apply` re-places a running gpud's
instances make-before-break, and a bad placement changes nothing."""
from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.http as httpclient

from gpud.examples import write_example_repository
from tests.daemon_harness import ROOT, start_daemon

pytestmark = pytest.mark.slow


@pytest.fixture
def daemon(tmp_path):
    repo = tmp_path / "repo"
    write_example_repository(repo)
    d = start_daemon(repo, tmp_path)  # pack (the default): every instance on one device
    yield d
    assert d.stop() == 0, d.log()


def _placement(daemon) -> dict[str, str]:
    return {m["name"]: m["instances"][0]["device"] for m in daemon.inspect()["models"]}


def _infer_mlp(daemon) -> np.ndarray:
    client = httpclient.InferenceServerClient(daemon.http_url)
    inp = httpclient.InferInput("input", [1, 256], "FP32")
    inp.set_data_from_numpy(np.ones((1, 256), np.float32))
    return client.infer("mlp", [inp]).as_numpy("output")


def test_spread_plan_applied_to_a_live_gpud(daemon):
    before = _placement(daemon)
    assert len(set(before.values())) == 1, before
    reference = _infer_mlp(daemon)

    def place(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "gpud.cli", "place", "--devices", "live", "--models", "live",
                               "--strategy", "spread", "--time-limit", "0", "-o", "json", "--apply",
                               "--url", daemon.http_url, *extra], capture_output=True, text=True, timeout=120,
                              cwd=ROOT)

    # From the live placement, the fewest moves that satisfy the demand is none: everything fits where it is.
    out = place("--current", "live")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "applied: 0 instance(s) started, 0 stopped" in out.stderr
    assert _placement(daemon) == before
    # A fresh spread plan moves instances off the one device pack used, and the daemon ends up exactly where the
    # plan says. (Which devices: the plan scores memory fill with footprints measured at load, which vary by host.)
    out = place()
    assert out.returncode == 0, out.stdout + out.stderr
    assert "applied:" in out.stderr
    planned = {p["model"]: p["device"] for p in json.loads(out.stdout)["placements"]}
    after = _placement(daemon)
    assert after == planned
    assert len(set(after.values())) >= 2, f"spread should use more than one device: {after}"
    assert all(len(m["instances"]) == 1 and m["instances"][0]["ready"] for m in daemon.inspect()["models"])
    np.testing.assert_allclose(_infer_mlp(daemon), reference, rtol=1e-6)


@pytest.mark.parametrize("body, status, message", [
    ({"placements": [{"model": "mlp", "instance": 0, "device": "gpu9"}]}, 400, "unknown device 'gpu9'"),
    ({"placements": [{"model": "nope", "instance": 0, "device": "gpu0"}]}, 404, "unknown model"),
    ({"placements": [{"model": "mlp", "instance": 0, "device": "gpu0"},
                     {"model": "mlp", "instance": 0, "device": "cpu"}]}, 400, "placed twice"),
    ({"placements": "all of them"}, 400, "must be a list"),
])
def test_a_bad_placement_changes_nothing(daemon, body, status, message):
    before = daemon.inspect()["models"]
    req = urllib.request.Request(f"http://{daemon.http_url}/v2/gpud/placement", data=json.dumps(body).encode(),
                                 method="POST")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=60)
    assert err.value.code == status
    assert message in json.loads(err.value.read())["error"]
    assert [m["instances"] for m in daemon.inspect()["models"]] == [m["instances"] for m in before]
