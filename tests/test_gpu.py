"""On a real GPU (marked `gpu`; skipped without an NVIDIA driver, a GPU and onnxruntime-gpu): gpud's GPU path against
the hardware. scripts/gpu-validate runs these in its venv; docs/gpu-validation.md records the results."""
from __future__ import annotations

import io
import json

import pytest

from gpud.cli.check.command import check_main
from gpud.cli.check.devices import compare_devices, observe
from gpud.cli.check.report import Status
from gpud.cli.check.smi import SmiError, query, subprocess_runner
from gpud.telemetry.devices import NoUsage
from gpud.telemetry.discovery import open_nvml


def _gpu_or_reason() -> str | None:
    backend, reason = open_nvml(NoUsage())
    if backend is None:
        return reason
    backend.close()
    try:
        import onnxruntime as ort
    except ImportError:
        return "onnxruntime is not installed"
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return "onnxruntime here has no CUDAExecutionProvider (install the gpu extra: scripts/gpu-validate)"
    return None


_WHY_NOT = _gpu_or_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_WHY_NOT is not None, reason=f"needs a GPU: {_WHY_NOT}")]


def test_nvml_readings_equal_nvidia_smi():
    backend, _ = open_nvml(NoUsage())
    try:
        smi = query(subprocess_runner())
    except SmiError as exc:
        pytest.skip(f"nvidia-smi: {exc}")
    rows = compare_devices(observe(backend), smi)
    backend.close()
    failed = [r for r in rows if r.status is Status.FAIL]
    assert not failed, "\n".join(f"{r.device} {r.item}: gpud {r.gpud}, nvidia-smi {r.reference}: {r.reason}"
                                 for r in failed)
    assert {r.item for r in rows if r.status is Status.PASS} >= {"memory.total", "memory.used", "power.draw"}


def test_gpudctl_check_passes_on_the_first_gpu_device():
    backend, _ = open_nvml(NoUsage())
    leaf = next(d.id for d in backend.leaf_devices() if d.kind in ("gpu", "mig"))
    backend.close()
    out = io.StringIO()
    code = check_main(["--expect-gpu", "--devices", leaf, "--seconds", "2", "--json"], out=out)
    report = json.loads(out.getvalue())
    failed = [r for r in report["rows"] if r["status"] == "fail"]
    assert code == 0, json.dumps(failed, indent=1)
    provider = next(r for r in report["rows"] if r["item"] == "provider" and r["device"] == leaf)
    assert provider["gpud"] in ("CUDAExecutionProvider", "TensorrtExecutionProvider")
