"""Two-dimensional (memory + compute) placement instances for the benchmark and the tests.

- `known_optimum(k, seed)`: k devices (80 GiB, one full GPU of compute) each split exactly into 2-6 instances in
  memory and, independently, in compute, every device 98-100% full in both; the instances are shuffled and offered to
  a node with more devices than needed. No plan uses fewer than k devices when the total fill exceeds k - 1 devices'
  worth in some dimension (true for k <= 50 at 98% fill: 0.98 k > k - 1), and k are enough by construction, so the
  optimum is k; for larger k the optimum is k or, rarely, k - 1, and the benchmark reports the plan against k.
- `random_2d(n, seed)`: n models of one instance each, memory uniform in 1-50% of a GPU and compute uniform in
  1-50%, independently: the optimum is unknown, the benchmark reports the gap to the lower bound.
"""
from __future__ import annotations

import random

from gpud.placement.model import COMPUTE_UNITS, Device, ModelDemand

GiB = 2**30
GPU_MEMORY_BYTES = 80 * GiB


def _split(total: int, parts: int, rng: random.Random, min_share: float = 0.02) -> list[int]:
    """`parts` positive integers adding up to `total`, each at least `min_share` of it."""
    while True:
        cuts = sorted(rng.random() for _ in range(parts - 1))
        shares = [b - a for a, b in zip([0.0] + cuts, cuts + [1.0])]
        if min(shares) >= min_share:
            break
    out = [int(s * total) for s in shares]
    out[-1] += total - sum(out)
    return out


def known_optimum(k: int, seed: int, per_device: tuple[int, int] = (2, 6), fill: tuple[float, float] = (0.98, 1.0),
                  spare_devices: float = 0.2) -> tuple[list[Device], list[ModelDemand]]:
    rng = random.Random(seed)
    sizes: list[tuple[int, int]] = []
    for _ in range(k):
        n = rng.randint(*per_device)
        memory = _split(int(GPU_MEMORY_BYTES * rng.uniform(*fill)), n, rng)
        compute = _split(int(COMPUTE_UNITS * rng.uniform(*fill)), n, rng)
        rng.shuffle(compute)
        sizes += zip(memory, compute)
    rng.shuffle(sizes)
    devices = [Device(f"gpu{j}", GPU_MEMORY_BYTES, 1.0) for j in range(k + max(2, int(k * spare_devices)))]
    demands = [ModelDemand(f"m{j}", m, 1, compute_fraction=c / COMPUTE_UNITS) for j, (m, c) in enumerate(sizes)]
    return devices, demands


def random_2d(n: int, seed: int, low: float = 0.01, high: float = 0.5) -> tuple[list[Device], list[ModelDemand]]:
    rng = random.Random(seed)
    demands = [ModelDemand(f"m{j}", int(GPU_MEMORY_BYTES * rng.uniform(low, high)), 1,
                           compute_fraction=round(rng.uniform(low, high), 6)) for j in range(n)]
    return [Device(f"gpu{j}", GPU_MEMORY_BYTES, 1.0) for j in range(n)], demands


# The 2-D sets the placement benches run: name -> (builder(seed) -> (devices, demands), known optimum or None).
SETS_2D = {
    "k25": (lambda seed: known_optimum(25, seed), 25),
    "k50": (lambda seed: known_optimum(50, seed), 50),
    "k100": (lambda seed: known_optimum(100, seed), 100),
    "r100": (lambda seed: random_2d(100, seed), None),
    "r200": (lambda seed: random_2d(200, seed), None),
    "r100w": (lambda seed: random_2d(100, seed, 0.1, 0.7), None),
}
