"""Run `promtool check metrics` on an exposition when promtool is installed (CI has Debian's prometheus)."""
from __future__ import annotations

import shutil
import subprocess

import pytest


def promtool_check(exposition: bytes) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not on PATH (Debian package 'prometheus' provides it)")
    proc = subprocess.run([promtool, "check", "metrics"], input=exposition, capture_output=True, timeout=60)
    # promtool exits 1 for lint problems too; show them all so a failure explains itself
    assert proc.returncode == 0, (proc.stdout + proc.stderr).decode()
