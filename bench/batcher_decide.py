#!/usr/bin/env python3
"""What one arrival's decision costs the dynamic batcher as its queue fills, against the same decision with the
candidate batch listed (the way every decision was made before the fast path): CPU microseconds per arrival.

    .venv/bin/python bench/batcher_decide.py [--max-batch 64,256,1024] [--arrivals 20000] [--rounds 5]

One-row requests of one shape arrive 10 µs apart on a fake clock, each followed by a decision with an instance free
(Triton's rules: no lone dispatch, no quiet dispatch, a 100 ms delay), so the queue fills to the max batch before
each batch goes. Printed per max batch: both costs (best of the rounds) and their ratio.
"""
from __future__ import annotations

import argparse
import time

from gpud.executor import batcher
from gpud.executor.batcher import BatchQueue, Dispatch, QueuedRequest
from gpud.executor.model_config import DynamicBatching


def per_arrival_us(max_batch: int, arrivals: int, listing: bool) -> float:
    now = [0.0]
    q = BatchQueue(max_batch_size=max_batch, dynamic_batching=DynamicBatching(max_queue_delay_us=100_000),
                   clock=lambda: now[0], quiet_dispatch=False, dispatch_lone_request=False)
    requests = [QueuedRequest(payload=i, batch_rows=1, shape_key="k", priority=0, timeout_us=0)
                for i in range(arrivals)]
    start = time.perf_counter()
    for r in requests:
        now[0] += 1e-5
        q.enqueue(r)
        if listing:
            q._shared_key = batcher._MIXED  # noqa: SLF001 - the baseline: the candidate listed on each decision
        d = q.decide(1)
        assert isinstance(d, Dispatch) == (len(q) == 0)
    return (time.perf_counter() - start) / arrivals * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-batch", default="64,256,1024")
    p.add_argument("--arrivals", type=int, default=20000)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    print(f"{'max batch':>9} {'listed us/arrival':>18} {'fast us/arrival':>16} {'fast / listed':>14}")
    for mb in (int(x) for x in args.max_batch.split(",")):
        listed = min(per_arrival_us(mb, args.arrivals, True) for _ in range(args.rounds))
        fast = min(per_arrival_us(mb, args.arrivals, False) for _ in range(args.rounds))
        print(f"{mb:>9} {listed:>18.2f} {fast:>16.2f} {fast / listed:>14.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
