"""Run `promtool check metrics` on an exposition when promtool is installed (CI has Debian's prometheus)."""
from __future__ import annotations

import shutil
import subprocess

import pytest

# DCGM-exporter's label name `modelName` is camelCase, and gpud keeps it so DCGM queries and legends port;
# promtool's lint says so. That lint is the one problem a gpud exposition may have: anything else fails.
DCGM_LABEL_LINT = "label names should be written in 'snake_case' not 'camelCase'"


def promtool_problems(exposition: bytes | str) -> list[str]:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not on PATH (Debian package 'prometheus' provides it)")
    data = exposition.encode() if isinstance(exposition, str) else exposition
    proc = subprocess.run([promtool, "check", "metrics"], input=data, capture_output=True, timeout=60)
    lines = (proc.stdout + proc.stderr).decode().splitlines()
    return [line for line in lines if line.strip() and DCGM_LABEL_LINT not in line]


def promtool_check(exposition: bytes | str) -> None:
    problems = promtool_problems(exposition)
    assert problems == [], "\n".join(problems)
