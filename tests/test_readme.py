"""Every example in the README runs as written (issue 24, item 5): its shell and Python code blocks (and the `$ `
commands of its transcripts) are read from README.md itself and run, in order, against a daemon this test starts
as `./scripts/run` does (no --model-repository: the example models, in ~/.cache/gpud/example-models, on the demo
node; with --allow-client-shm and a trace file, as the shared-memory and tracing examples say), with `localhost:8000/8001/8002` pointed at that daemon's ports and a home of its own. Each command must exit 0
and print what its `# -> TEXT` comment says. A command that is not run is listed in NOT_RUN with why: a new example
that is neither runs or fails here, so the README cannot drift from what gpud does."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.daemon_harness import ROOT, start_daemon

pytestmark = pytest.mark.slow
DEMO_NODE = "config/nodes/dgx-a100-2gpu-mig.yaml"  # what ./scripts/run uses without a driver

# Commands (by how they start) and code blocks (by their first line) the test does not run, and why.
NOT_RUN = {
    "./scripts/run": "starts the daemon, as this test does itself",
    "./scripts/test": "the test suite this test is part of",
    "gpud --model-repository": "a daemon in the foreground (this test's daemon is one; tests/test_e2e_* start more)",
    "gpud --config": "a daemon in the foreground (config/gpud.yaml: tests/test_settings_cli.py)",
    "gpud --node": "a daemon in the foreground, '...' stands for the other flags",
    "gpudctl check": "minutes of checks on every device (tests/test_check.py)",
    "nvidia-mig-parted": "NVIDIA's tool on a GPU node",
    "import base64, numpy as np, tritonclient.grpc as grpcclient": "CUDA shared memory: a GPU and cuda-python "
                                                                   "(tests/test_cuda_shared_memory_gpu.py makes the "
                                                                   "same calls on one)",
    "for step, chunk in enumerate(chunks):": "a fragment: a sequence model 'asr' and its audio chunks "
                                            "(tests/test_sequence_e2e.py runs sequences through tritonclient)",
}


@dataclass(frozen=True)
class Example:
    line: int  # in README.md
    kind: str  # "sh" or "python"
    text: str

    @property
    def expected(self) -> str | None:
        """What its `# -> TEXT` comment says it prints (a shell command's)."""
        m = re.search(r"#\s*->\s*(.+)$", self.text)
        return m.group(1).strip() if m else None


def readme_examples(readme: str) -> list[Example]:
    """The README's runnable examples in order: each command of a ```sh block (a command spans the lines its quotes
    span), each ```python block whole, and each `$ ` line of a plain block (a transcript)."""
    out = []
    for m in re.finditer(r"^```(\w*)\n(.*?)^```", readme, re.S | re.M):
        lang, body = m.group(1), m.group(2)
        first = readme[:m.start()].count("\n") + 2  # the block's first line
        if lang == "python":
            out.append(Example(first, "python", body))
        elif lang == "sh":
            pending, start = "", first
            for k, line in enumerate(body.splitlines()):
                if not pending:
                    start = first + k
                pending += line + "\n"
                if pending.strip() and _complete(pending):
                    out.append(Example(start, "sh", pending.strip()))
                    pending = ""
            assert not pending, f"README.md line {start}: a command whose quotes never close"
        elif lang == "":
            out += [Example(first + k, "sh", line[2:]) for k, line in enumerate(body.splitlines())
                    if line.startswith("$ ")]
    return out


def _complete(command: str) -> bool:
    try:
        shlex.split(command, comments=True)
    except ValueError:  # no closing quotation: the command goes on on the next line
        return False
    return not command.rstrip().endswith("\\")


def why_not_run(example: Example) -> str | None:
    return next((why for start, why in NOT_RUN.items() if example.text.startswith(start)), None)


def test_every_readme_example_is_run_or_says_why_not():
    # Without a daemon: the list of examples is what the README holds, and NOT_RUN names nothing it no longer has.
    examples = readme_examples((ROOT / "README.md").read_text())
    assert len([e for e in examples if e.kind == "python"]) >= 3 and len(examples) >= 15
    used = {start for start in NOT_RUN for e in examples if e.text.startswith(start)}
    assert used == set(NOT_RUN), f"NOT_RUN names commands the README no longer has: {set(NOT_RUN) - used}"


def test_the_readme_examples_run_as_written(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    work = tmp_path / "work"  # relative paths (config/, scripts/) resolve as in a checkout; what a command writes stays
    work.mkdir()
    for name in ("config", "scripts"):
        (work / name).symlink_to(ROOT / name)
    env = {"HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache")}
    # --allow-client-shm: the README's shared-memory example says to start gpud so; it changes nothing else
    daemon = start_daemon(None, tmp_path, "--allow-client-shm", "true", "--trace-config",
                          f"triton,file={tmp_path / 'trace.json'}", node=DEMO_NODE, env=env)
    ports = {"8000": daemon.ports["http"], "8001": daemon.ports["grpc"], "8002": daemon.ports["metrics"]}
    run_env = {**os.environ, **env, "GPUD_URL": daemon.http_url,
               "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    ran, failures = 0, []
    try:
        assert (home / ".cache" / "gpud" / "example-models" / "pipeline").is_dir()  # where the README says
        for ex in readme_examples((ROOT / "README.md").read_text()):
            if why_not_run(ex) is not None:
                continue
            code = re.sub(r"localhost:(800[012])", lambda m: f"127.0.0.1:{ports[m.group(1)]}", ex.text)
            cmd = ["bash", "-c", code] if ex.kind == "sh" else [sys.executable, "-c", code]
            out = subprocess.run(cmd, cwd=work, env=run_env, capture_output=True, text=True, timeout=300)
            ran += 1
            said = out.stdout + out.stderr
            if out.returncode != 0 or out.stdout.lstrip().startswith('{"error"') or "Traceback" in said:
                failures.append(f"README.md line {ex.line} ({ex.kind}) exit {out.returncode}:\n{ex.text}\n{said}")
            elif ex.expected is not None and ex.expected not in said:
                failures.append(f"README.md line {ex.line}: expected {ex.expected!r} in:\n{said}")
            if ex.text.startswith("gpudctl place --devices live --models live --strategy spread --apply"):
                devices = {i["device"] for m in daemon.inspect()["models"] for i in m["instances"]}
                if len(devices) != 5:  # what the README says the spread plan does on the demo node
                    failures.append(f"README.md line {ex.line}: the instances are on {sorted(devices)}, not 5")
    finally:
        assert daemon.stop() == 0, daemon.log()
    assert not failures, "\n\n".join(failures)
    assert ran >= 14
