"""The type checker over all of gpud/, the linter over gpud/, the replay and the tests (settings in pyproject.toml):
mypy catches a scheduler that no longer fits the Scheduler protocol, a wrong return type, an Optional used unchecked;
ruff catches unused names, blind excepts without a reason, closures over loop variables and the like. Both are
installed by the [test] extra."""
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


def test_ruff_is_clean_on_gpud_the_replay_and_the_tests():
    # the replay runs gpud's own control plane; the tests with long lines and fixtures allowed (pyproject.toml)
    out = _run("ruff", "check", "gpud", "bench/replay", "tests")
    assert out.returncode == 0, out.stdout + out.stderr
