"""The type checker and the linter over all of gpud/ (settings in pyproject.toml): mypy catches a scheduler that no
longer fits the Scheduler protocol, a wrong return type, an Optional used unchecked; ruff catches unused names,
blind excepts without a reason and the like. Both are installed by the [test] extra."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(module: str, *args: str) -> subprocess.CompletedProcess:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (the [test] extra installs it)")
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


def test_mypy_is_clean_on_gpud():
    out = _run("mypy")  # files and settings: [tool.mypy]
    assert out.returncode == 0, out.stdout + out.stderr


def test_ruff_is_clean_on_gpud_and_the_replay():
    out = _run("ruff", "check", "gpud", "bench/replay")  # the replay runs gpud's own control plane
    assert out.returncode == 0, out.stdout + out.stderr
