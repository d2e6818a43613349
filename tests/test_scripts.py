"""The README's scripts and examples: the venv setup the scripts share (scripts/_venv.sh) runs once however many
start together (pip and python are stand-ins here: no network, no real install), each script parses, and the
example models file plans as the README shows."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ["run", "test", "gpudctl", "_venv.sh", "install-perf-analyzer", "gpu-validate"]

FAKE_PYTHON3 = """#!/usr/bin/env bash
# python3 -m venv .venv: an environment whose pip logs each install
mkdir -p "$3/bin"
cat > "$3/bin/pip" <<'PIP'
#!/usr/bin/env bash
[ "$1" = install ] && [ "$3" = --upgrade ] && exit 0
echo "start $$" >> pip.log
for i in $(seq 1 2000); do :; done
echo "end $$" >> pip.log
PIP
printf '#!/bin/sh\\n' > "$3/bin/python"
chmod +x "$3/bin/pip" "$3/bin/python"
"""


@pytest.mark.parametrize("script", SCRIPTS)
def test_scripts_parse(script):
    assert subprocess.run(["bash", "-n", str(ROOT / "scripts" / script)]).returncode == 0


@pytest.mark.skipif(shutil.which("flock") is None, reason="flock (util-linux) not installed")
def test_setups_started_together_install_once(tmp_path):
    (tmp_path / "pyproject.toml").write_text("")
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(FAKE_PYTHON3)
    (bin_dir / "python3").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    setup = f'. "{ROOT}/scripts/_venv.sh" && ensure_venv "[test]" .venv/.installed-test'
    procs = [subprocess.Popen(["bash", "-c", setup], cwd=tmp_path, env=env) for _ in range(4)]
    assert [p.wait(timeout=60) for p in procs] == [0, 0, 0, 0]
    log = [line.split()[0] for line in (tmp_path / "pip.log").read_text().splitlines()]
    assert log == ["start", "end"]  # one install; the others waited for it and found it done
    assert (tmp_path / ".venv" / ".installed-test").exists()


def test_the_example_models_file_plans_on_a_preset():
    from gpud.cli.main import main

    assert main(["place", "--devices", "dgx-a100-80gb", "--models", str(ROOT / "config" / "models.example.yaml"),
                 "-o", "json"]) == 0


def test_shuffle_runs_the_tests_in_an_order_its_seed_repeats():
    """tests/conftest.py's --shuffle (what .ci/run uses to catch order dependence, issue 24)."""
    import sys

    def order(*extra: str) -> list[str]:
        out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only",
                              *extra, "tests/test_examples.py", "tests/test_first_run.py"],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        return [line for line in out.stdout.splitlines() if "::" in line]

    plain, shuffled = order(), order("--shuffle", "7")
    assert sorted(shuffled) == sorted(plain) and shuffled != plain and order("--shuffle", "7") == shuffled
    assert subprocess.run(["bash", "-n", str(ROOT / ".ci" / "run")]).returncode == 0
