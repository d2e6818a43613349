"""What the CPU-per-request benchmarks (core_cost.py, http_cost.py) share: the daemon's parts in this process on the
tiny MLP, and two arms (two trees, or one tree two ways) run alternately, one process each per round."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Coroutine
from typing import Any

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


def add_arguments(p: argparse.ArgumentParser, *, compiled_against_pure: bool = True) -> None:
    """The options every cost benchmark takes: the load, the rounds, a profile, and the two arms to compare."""
    p.add_argument("--requests", type=int, default=20000)
    p.add_argument("--warmup", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--profile", type=int, default=0, metavar="N")
    p.add_argument("--against", metavar="TREE", help="another checkout of gpud to compare with (the code before)")
    if compiled_against_pure:
        p.add_argument("--compiled-against-pure", action="store_true",
                       help="this tree compiled (gpud.compiled) against itself as pure Python")
    p.add_argument("--json", action="store_true", help=argparse.SUPPRESS)


def run_loop(coroutine: Coroutine[Any, Any, int]) -> int:
    """The daemon's event loop (gpud.main): uvloop where installed."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coroutine)
    return uvloop.run(coroutine)


def compare(script: str, args: argparse.Namespace, argv: list[str], load: str, columns: tuple[str, str, str],
            keys: tuple[str, str], unit: str) -> int:
    """Two arms, one process each per round, alternating which goes first; their medians and head / base.
    `--against TREE`: that checkout (base) and this one (head). `--compiled-against-pure`: this tree as pure Python
    (base, GPUD_PURE_PYTHON=1) and with its compiled request path (head; gpud.compiled, which must match the
    sources). Each run prints JSON with `keys` (the measured CPU per `unit` and its baseline's), "rps" and "rows"
    (and "compiled", for the second form); `columns` names the two and their difference; `load` describes a
    round."""
    if getattr(args, "compiled_against_pure", False):
        arms = {"base": (ROOT, {"GPUD_PURE_PYTHON": "1"}), "head": (ROOT, {"GPUD_PURE_PYTHON": "0"})}
        names = {"base": "pure Python", "head": "compiled"}
    else:
        arms = {"base": (os.path.abspath(args.against), {}), "head": (ROOT, {})}
        names = {"base": arms["base"][0], "head": ROOT}
    got = run_arms(script, arms, ["--rounds", "1", "--requests", str(args.requests), "--warmup", str(args.warmup),
                                  "--concurrency", str(args.concurrency), *argv], args.rounds)
    if getattr(args, "compiled_against_pure", False):
        for arm, results in got.items():
            if any(r["compiled"] != (arm == "head") for r in results):
                raise SystemExit(f"the {names[arm]} arm did not run {names[arm]}: build the request path first "
                                 "(python -m gpud.compiled.build)")
    measured, baseline = keys
    print(f"# {args.requests} {unit}s a round, {load}, {args.rounds} rounds an arm (alternating), medians; "
          f"base {names['base']}, head {names['head']}")
    widths = [max(11, len(c)) for c in columns]
    print(f"{'arm':5} {columns[0]:>{widths[0]}} {columns[1]:>{widths[1]}} {columns[2]:>{widths[2]}} {unit + 's/s':>8} "
          f"{'rows/batch':>10}  {columns[0]} each")
    med = {}
    for arm in ("base", "head"):
        rs = got[arm]
        m = {k: statistics.median(x[k] for x in rs) for k in (measured, baseline, "rps", "rows")}
        med[arm] = m
        each = ", ".join(f"{x[measured]:.1f}" for x in rs)
        print(f"{arm:5} {m[measured]:{widths[0]}.1f} {m[baseline]:{widths[1]}.1f} "
              f"{m[measured] - m[baseline]:{widths[2]}.1f} {m['rps']:8.0f} {m['rows']:10.1f}  {each}")
    print(f"head / base: CPU per {unit} {med['head'][measured] / med['base'][measured]:.2f}, "
          f"{unit}s/s {med['head']['rps'] / med['base']['rps']:.2f}")
    return 0
