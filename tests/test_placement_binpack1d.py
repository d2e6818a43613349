"""One-dimensional bin packing: heuristics, bounds, exact stages, and the reference instances (skipped without data)."""
from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest

from gpud.placement import binpack1d as b
from tests.fakes import FakeClock

DATA = Path(os.environ.get("GPUD_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data")) / "binpacking"


def _valid(sizes, cap, bins):
    assert sorted(i for bin_ in bins for i in bin_) == list(range(len(sizes)))
    assert all(sum(sizes[i] for i in bin_) <= cap for bin_ in bins)


class TestHeuristics:
    @pytest.mark.parametrize("sizes,cap,ffd,bfd", [
        # 6,5,4,3,2 into 10: FFD 6+4 | 5+3+2 -> 2 bins
        ([6, 5, 4, 3, 2], 10, 2, 2),
        # 7,6,5,2: FFD 7+2 | 6 | 5 -> 3; BFD same
        ([7, 6, 5, 2], 10, 3, 3),
        # four items of 5 pair up exactly: 2 bins
        ([5, 5, 5, 5], 10, 2, 2),
        ([], 10, 0, 0),
    ])
    def test_counts(self, sizes, cap, ffd, bfd):
        f, g = b.first_fit_decreasing(sizes, cap), b.best_fit_decreasing(sizes, cap)
        _valid(sizes, cap, f)
        _valid(sizes, cap, g)
        assert (len(f), len(g)) == (ffd, bfd)

    def test_rejects_oversized_item(self):
        with pytest.raises(ValueError, match="item 1: size 11 exceeds capacity 10"):
            b.first_fit_decreasing([3, 11], 10)


class TestBounds:
    @pytest.mark.parametrize("sizes,cap,l1,l2", [
        # sum 20 / 10 = 2; three items > 5 need three bins: L2 = 3
        ([6, 6, 6, 2], 10, 2, 3),
        # 4 * 3 = 12 -> ceil(12/10) = 2; nothing above half: L2 = L1 = 2
        ([3, 3, 3, 3], 10, 2, 2),
        # k = 4: 9 > 10-4 alone (1), 6 in (5, 6] (1, slack 4), 4+4=8 for [4,5]: ceil((8-4)/10) = 1 -> 3
        ([9, 6, 4, 4], 10, 3, 3),
    ])
    def test_l1_l2(self, sizes, cap, l1, l2):
        assert b.lower_bound_l1(sizes, cap) == l1
        assert b.lower_bound_l2(sizes, cap) == l2

    @pytest.mark.parametrize("sizes", [[4, 4, 3, 3, 2, 2, 2], [7, 5, 5, 3, 3, 2], [6, 6, 5, 4, 3, 3, 3]])
    def test_l2_never_exceeds_brute_force_optimum(self, sizes):
        cap = 10
        best = len(sizes)
        for labels in itertools.product(range(len(sizes)), repeat=len(sizes)):
            loads = {}
            for s, lab in zip(sizes, labels):
                loads[lab] = loads.get(lab, 0) + s
            if max(loads.values()) <= cap:
                best = min(best, len(loads))
            if best == b.lower_bound_l1(sizes, cap):
                break
        assert b.lower_bound_l2(sizes, cap) <= best


class TestSolve:
    def test_heuristics_only_is_honest(self):
        # 7,6,5,2 with capacity 10: FFD 3 bins; L2: three items > 5 -> 3: proven at once
        p = b.solve([7, 6, 5, 2], 10, time_limit_seconds=0, clock=FakeClock())
        assert (len(p.bins), p.lower_bound, p.optimal) == (3, 3, True)

    def test_local_search_without_highs_closes_gap(self):
        # FFD packs 3,3,2,2,2,2,2,2 (cap 6) as 3+3 | 2+2+2 | 2+2+2 ... already optimal; a harder one:
        sizes = [44, 24, 24, 22, 21, 17, 8, 8, 6, 6]  # sum 200, cap 50 -> L1 4; a perfect packing exists
        p = b.solve(sizes, 50, time_limit_seconds=1.0, clock=FakeClock(step=0.001), use_highs=False)
        _valid(sizes, 50, p.bins)
        assert p.lower_bound == 4
        assert p.optimal == (len(p.bins) == 4)

    @pytest.mark.skipif(not b.highs_available(), reason="scipy/HiGHS not installed")
    def test_arcflow_proves_better_than_simple_bound(self):
        # three 6s and three 5s and three 4s, cap 15: 6+5+4 thrice -> 3 bins = L1 (45/15)
        sizes = [6, 6, 6, 5, 5, 5, 4, 4, 4]
        res = b.solve_arcflow(sizes, 15, time_limit_seconds=5)
        assert res is not None and res.optimal and len(res.bins) == 3
        _valid(sizes, 15, res.bins)
        # a cut below the optimum is infeasible, which proves 3
        cut = b.solve_arcflow(sizes, 15, time_limit_seconds=5, max_bins=2)
        assert cut.bins is None and cut.lower_bound == 3


def _orlib(path: Path):
    lines = [x.strip() for x in path.read_text().splitlines() if x.strip()]
    n, p, out = int(lines[0]), 1, {}
    for _ in range(n):
        name = lines[p]
        cap, k, _best = map(int, lines[p + 1].split())
        out[name] = (cap, [int(float(x)) for x in lines[p + 2:p + 2 + k]])
        p += 2 + k
    return out


@pytest.mark.skipif(not (DATA / "falkenauer" / "binpack2.txt").exists(), reason="shared binpacking data absent")
@pytest.mark.skipif(not b.highs_available(), reason="scipy/HiGHS not installed")
class TestReferenceInstances:
    # u250_13: the simple bound says 102, the optimum is 103 (README of the data set); the arc-flow LP proves it.
    @pytest.mark.parametrize("name,optimum", [("u250_13", 103), ("u250_00", 99)])
    def test_u250_optimum_proven(self, name, optimum):
        import time
        cap, sizes = _orlib(DATA / "falkenauer" / "binpack2.txt")[name]
        p = b.solve(sizes, cap, time_limit_seconds=2.0, clock=time.perf_counter)
        _valid(sizes, cap, p.bins)
        assert (len(p.bins), p.lower_bound, p.optimal) == (optimum, optimum, True)
