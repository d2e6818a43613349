#!/usr/bin/env python3
"""How gpud's dynamic batcher forms batches under closed-loop load: this tree against another, interleaved.

    .venv/bin/python bench/serving/batching.py --against /path/to/other/tree [--concurrency 1,8,64] [--rounds 3]
        [--seconds 6] [--gpud-args "--http-processes 1"] [--batching adaptive|triton]

wrk drives gpud (run.py's harness: the tiny MLP, max batch 64, 3 ms queue delay, one 1x256 FP32 row per request,
KServe binary over HTTP) at each concurrency, each point on a fresh daemon, the two trees alternating. The other tree
runs from its own directory with PYTHONPATH set to it, under this tree's interpreter. Rows per batch come from the
statistics extension (inference_count / execution_count). Printed: each round, then the medians and this tree's
ratios to the other's (requests/s, p99).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

import models  # noqa: E402
import run  # noqa: E402

POINT = r"""
import json, os, sys, urllib.request
sys.path.insert(0, sys.argv[1])
import run
workdir, repo, body_file, header_len, c, seconds = sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), \
    int(sys.argv[6]), float(sys.argv[7])
server = run.GpudServer(workdir, repo, tuple(sys.argv[8:]))
server.start()
try:
    target = next(t for t in server.targets() if t.label == "gpud http-binary")
    r = run.run_wrk(run.ensure_wrk(), server, target, "mlp", c, seconds, body_file, header_len, workdir)
    url = f"http://127.0.0.1:{server.http_port}/v2/models/mlp/stats"
    stats = json.load(urllib.request.urlopen(url, timeout=10))["model_stats"][0]
finally:
    server.stop()
print(json.dumps({"rps": r["requests"] / (r["duration_us"] / 1e6), "p50": r["p50_us"] / 1e3,
                  "p99": r["p99_us"] / 1e3, "rows": stats["inference_count"] / max(1, stats["execution_count"])}))
"""


def point(tree: str, workdir: str, repo: str, body_file: str, header_len: int, c: int, seconds: float,
          gpud_args: list[str]) -> dict:
    env = dict(os.environ, PYTHONPATH=tree)
    out = subprocess.run([sys.executable, "-c", POINT, HERE, workdir, repo, body_file, str(header_len), str(c),
                          str(seconds), *gpud_args], cwd=tree, env=env, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"point failed in {tree}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--against", required=True, help="the other tree (a git worktree of another commit)")
    p.add_argument("--concurrency", default="1,8,64")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--gpud-args", default="", help="more gpud flags for both trees")
    p.add_argument("--batching", choices=("adaptive", "triton"), default="adaptive",
                   help="the model's gpud_batching (adaptive: gpud's default)")
    args = p.parse_args(argv)
    trees = {"this": ROOT, "other": os.path.abspath(args.against)}
    with tempfile.TemporaryDirectory(prefix="gpud-batching-") as workdir:
        repo = os.path.join(workdir, "models")
        models.write_repository(repo)
        with open(os.path.join(repo, "mlp", "config.pbtxt"), "a") as f:
            f.write(f'parameters {{ key: "gpud_batching" value: {{ string_value: "{args.batching}" }} }}\n')
        body, header_len = run.kserve_binary(np.random.default_rng(0).standard_normal(256).astype(np.float32))
        body_file = os.path.join(workdir, "body")
        with open(body_file, "wb") as f:
            f.write(body)
        results: dict[tuple[str, int], list[dict]] = {}
        for c in [int(x) for x in args.concurrency.split(",")]:
            for i in range(args.rounds):
                order = ("this", "other") if i % 2 == 0 else ("other", "this")
                for name in order:
                    r = point(trees[name], workdir, repo, body_file, header_len, c, args.seconds,
                              args.gpud_args.split())
                    results.setdefault((name, c), []).append(r)
                    print(f"c={c:<3} round {i + 1} {name:5} {r['rps']:8.0f} req/s  p50 {r['p50']:6.2f} ms  "
                          f"p99 {r['p99']:6.2f} ms  {r['rows']:5.1f} rows/batch", flush=True)
    print(f"\n# medians of {args.rounds} rounds; this = {ROOT}, other = {trees['other']}")
    print(f"{'c':>3} {'tree':5} {'req/s':>8} {'p50 ms':>7} {'p99 ms':>7} {'rows/batch':>10} {'req/s ratio':>11} "
          f"{'p99 ratio':>9}")
    for (name, c), rs in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0] != "this")):
        med = {k: statistics.median(r[k] for r in rs) for k in ("rps", "p50", "p99", "rows")}
        other = {k: statistics.median(r[k] for r in results[("other", c)]) for k in ("rps", "p99")}
        ratio = f"{med['rps'] / other['rps']:11.2f} {med['p99'] / other['p99']:9.2f}" if name == "this" else ""
        print(f"{c:3d} {name:5} {med['rps']:8.0f} {med['p50']:7.2f} {med['p99']:7.2f} {med['rows']:10.1f} {ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
