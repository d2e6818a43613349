"""The latency within which a share of a batching model's requests finish (the quantile a latency objective bounds),
predicted from the arrival rate, the instance count and the batch time by size. Pure: a queueing approximation the
hints size instances by (gpud.scaling.hints.objective_recommendation), not a measurement.

Why not the typical request: the objective bounds the 99th percentile, and a batching model's tail grows long before
its mean does (a ranker whose mean is 42 ms at 80% of its full-batch capacity has a 99th percentile of 86 ms).

The model: Poisson arrivals at `arrival_per_s`, `instances` instances taking batches of up to B rows from one queue
as soon as they are free (gpud's dynamic batcher with no queue delay), a batch of b rows running t(b) (the line).
1. Its batch: the batch the load forms, b = r t(b) for the rate per instance r (the rows that arrive while one
   batch runs make the next), within [1, B]. A request runs t(b).
2. Before that, an instance to come free. When b > 1 every instance is always busy (its next batch fills while it
   runs); at b = 1 all are busy with Erlang C's probability C(c, lambda t(1)). A request that finds them all busy
   waits for the first to finish, the least of c residuals each uniform over t(b):
   P(R > x) = P_busy (1 - x / t(b))^c.
3. Beyond that, whole rounds while more wait than one round takes: a backlog makes full batches, c B rows every
   t(B), and the queue of such a bulk server has a geometric tail, P(N > n) ~ rho z^-n with rho = lambda t(B) / (c B)
   and z > 1 the root of c B ln z = lambda t(B) (z - 1) (the M/D^B/1 queue's); n requests ahead drain in
   n t(B) / (c B).
The quantile adds the share's quantile of 2 and of 3 (conservative: the two rarely coincide). Against the replay's
discrete-event model (bench/replay/des.py, Poisson arrivals, the three measured kinds, 1-4 instances, 2-90% of
full-batch capacity) it is 0.88-1.28x the measured 99th percentile, most points 1.0-1.2x (docs/benchmarks.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from gpud.executor.objective import DEFAULT_SHARE  # the share an objective bounds unless it says otherwise


@dataclass(frozen=True)
class BatchLine:
    """A batch's run time by its rows: intercept_s + slope_s * rows (least squares over measured sizes)."""

    intercept_s: float
    slope_s: float

    def seconds(self, rows: float) -> float:
        return self.intercept_s + self.slope_s * rows


def erlang_c(servers: int, offered: float) -> float:
    """The probability that an arrival finds all `servers` busy, for an offered load of `offered` (arrival rate x
    service time, in servers): Erlang's C formula; 1 when the load is at or past the servers."""
    if offered <= 0:
        return 0.0
    if offered >= servers:
        return 1.0
    term = total = 1.0  # sum of offered^i / i! for i < servers
    for i in range(1, servers):
        term *= offered / i
        total += term
    last = term * offered / servers * servers / (servers - offered)
    return last / (total + last)


def backlog_decay(rows_per_round: float, arrivals_per_round: float) -> float:
    """ln z for the root z > 1 of rows_per_round ln z = arrivals_per_round (z - 1): how fast the chance of a longer
    backlog falls, per request in it (P(N > n) ~ z^-n). Needs arrivals_per_round < rows_per_round (else inf load)."""
    if not 0 < arrivals_per_round < rows_per_round:
        raise ValueError(f"needs 0 < arrivals ({arrivals_per_round}) < rows per round ({rows_per_round})")

    def above(z: float) -> bool:  # f(z) = rows ln z - arrivals (z - 1) > 0: z is below the root (f is concave)
        return rows_per_round * math.log(z) > arrivals_per_round * (z - 1)

    lo, hi = 1.0, 2.0
    while above(hi):
        lo, hi = hi, 2 * hi
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if above(mid) else (lo, mid)
    return math.log((lo + hi) / 2)


def predicted_latency_s(arrival_per_s: float, instances: int, line: BatchLine, max_batch_size: int,
                        share: float = DEFAULT_SHARE) -> float:
    """The latency (queue + compute) within which `share` of the requests finish with `instances` sharing
    `arrival_per_s` (see the module docstring); inf: they cannot keep up. A model that does not batch
    (max_batch_size 0) runs one request a batch."""
    if instances <= 0:
        return math.inf if arrival_per_s > 0 else 0.0
    largest = max(1, max_batch_size)
    a, c = max(0.0, line.intercept_s), max(0.0, line.slope_s)
    t_full = a + c * largest
    if t_full <= 0:
        return 0.0
    rho = arrival_per_s * t_full / (instances * largest)  # of the full-batch capacity
    if rho >= 1:
        return math.inf
    rate = arrival_per_s / instances
    rows = float(largest) if rate * c >= 1 else min(float(largest), max(1.0, rate * a / (1 - rate * c)))
    t_batch = a + c * rows
    over = 1 - share  # the share of requests past the quantile
    busy = 1.0 if rows > 1 else erlang_c(instances, arrival_per_s * (a + c))
    residual_s = t_batch * (1 - (over / busy) ** (1 / instances)) if busy > over else 0.0
    rounds_s = 0.0
    if rho > over:
        capacity = instances * largest
        rounds_s = t_full / capacity * math.log(rho / over) / backlog_decay(capacity, arrival_per_s * t_full)
    return t_batch + residual_s + rounds_s


def instances_for_objective(arrival_per_s: float, line: BatchLine, max_batch_size: int, objective_s: float,
                            limit: int, share: float = DEFAULT_SHARE) -> int | None:
    """The fewest instances (1..limit) whose predicted `share` quantile is within `objective_s`; None: not even
    `limit`."""
    for n in range(1, max(1, limit) + 1):
        if predicted_latency_s(arrival_per_s, n, line, max_batch_size, share) <= objective_s:
            return n
    return None
