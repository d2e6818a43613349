"""What the CPU-per-request benchmarks (core_cost.py, http_cost.py) share: the daemon's parts in this process on the
tiny MLP, and two arms (two trees, or one tree two ways) run alternately, one process each per round."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))  # this checkout of gpud


@contextlib.asynccontextmanager
async def mlp_parts(prefix: str) -> AsyncIterator:
    """gpud's parts (gpud.wiring), started, serving run.py's tiny MLP from a repository of its own (the MLP in a
    real worker process); shut down and removed at the end."""
    from gpud import wiring
    from gpud.settings import Settings, prepare_settings

    import models

    workdir = tempfile.mkdtemp(prefix=prefix)
    try:
        repo = os.path.join(workdir, "models")
        models.write_repository(repo)
        shutil.rmtree(os.path.join(repo, "heavy"))
        settings = Settings(model_repository=repo, allow_metrics=False, placement_control="off", json_processes=0,
                            log_level="WARNING")
        parts = wiring.build(prepare_settings(settings))
        await parts.start()
        try:
            yield parts
        finally:
            await parts.shutdown(5.0)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def rows_per_batch(before: tuple[int, int], after: tuple[int, int]) -> float:
    """Rows per batch between two (inference_count, execution_count) readings of a model's statistics."""
    return (after[0] - before[0]) / max(1, after[1] - before[1])


def run_arms(script: str, arms: dict[str, tuple[str, dict[str, str]]], argv: list[str],
             rounds: int) -> dict[str, list[dict]]:
    """`script --json argv` once per round in each arm ("base", "head": (tree, extra environment)), alternating
    which goes first; each run's last line of output, read as JSON, by arm. Each run imports its tree's gpud (and
    its workers start from that tree)."""
    got: dict[str, list[dict]] = {arm: [] for arm in arms}
    for r in range(rounds):
        for arm in (("base", "head") if r % 2 == 0 else ("head", "base")):
            tree, extra = arms[arm]
            env = dict(os.environ, PYTHONPATH=tree, **extra)
            out = subprocess.run([sys.executable, os.path.abspath(script), "--json", *argv], cwd=tree, env=env,
                                 capture_output=True, text=True, timeout=600)
            if out.returncode != 0:
                raise SystemExit(f"{arm} ({tree}) failed:\n{out.stderr[-3000:]}")
            got[arm].append(json.loads(out.stdout.strip().splitlines()[-1]))
    return got
