"""scripts/gpu-validate, the parts that run without a GPU: the plan it prints (--dry-run) and the report it writes
when the node cannot run the GPU steps."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEPS = ["venv", "onnxruntime-gpu", "providers", "node", "check", "harness", "daemon", "ensemble", "gpu-tests",
         "report"]


def test_dry_run_prints_every_step_and_runs_nothing(tmp_path):
    venv, out = tmp_path / "venv-gpu", tmp_path / "out"
    proc = subprocess.run([str(ROOT / "scripts" / "gpu-validate"), "--dry-run", "--venv", str(venv), "--out",
                           str(out)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    numbered = [line.split(":")[0].split(". ", 1)[1] for line in text.splitlines() if line[:1].isdigit()]
    assert numbered == STEPS
    for words in (f"{venv}/bin/python -m pip install -q -e '{ROOT}[gpu,test]'",  # the gpu extra
                  "pip uninstall -y -q onnxruntime onnxruntime-gpu",  # the CPU build's files out of the way
                  "'onnxruntime-gpu[cuda,cudnn]>=1.31.1'",
                  "-m gpud.cli.main check --expect-gpu",
                  "bench/serving/gpu.py --duration 5",
                  "--metrics-url 'http://127.0.0.1:<metrics port>/metrics'",
                  "bench/ensemble_bench.py --kind gpu --repeat 5",
                  "-m pytest -q -m gpu",
                  f"{out}/report.md"):
        assert words in text, words
    assert not venv.exists() and not out.exists()


def test_without_a_gpu_the_report_says_what_failed_and_what_was_skipped(tmp_path):
    """With the project's CPU venv: the providers step fails (no CUDA EP), so the GPU steps are skipped, and the
    report says so."""
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_validate.py"), "--skip-install", "--venv",
                           str(Path(sys.executable).parent.parent), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = (out / "report.md").read_text()
    assert "| providers | onnxruntime offers the CUDA EP" in report and "FAILED (exit 1)" in report
    for step in ("node", "check", "harness", "daemon", "ensemble", "gpu-tests"):
        assert f"| {step} |" in report and report.split(f"| {step} |")[1].split("\n")[0].rstrip().endswith(
            "| skipped | 0 |"), step
    assert "CPUExecutionProvider" in (out / "providers.txt").read_text()
