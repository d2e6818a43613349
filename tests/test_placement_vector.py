"""Memory + compute (+ instance cap) packing: table-driven optima with their arithmetic, the lower bounds, spread by
contention, the known-optimum sets, and properties (capacities never exceeded, bound <= plan, proofs only when the
bound meets the plan, checked against brute force on small problems)."""
from __future__ import annotations

import itertools
import os
import sys

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from gpud.placement import binpack1d
from gpud.placement.framework import NodeState, contention, eligible_devices
from gpud.placement.model import COMPUTE_UNITS, Constraints, Device, ModelDemand, compute_units
from gpud.placement.solver import PlannerConfig, plan
from gpud.placement.vector import SlackParams, conflict_clique, dimension_bounds, min_bin_slack
from tests.fakes import FakeClock

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import placement_sets  # noqa: E402

GiB = 2**30
HIGHS = binpack1d.highs_available()


def gpu(id_, mem_gib=80, compute=1.0, **kw) -> Device:
    return Device(id_, mem_gib * GiB, compute, **kw)


def model(name, mem_gib, n=1, compute=0.0, **cons) -> ModelDemand:
    return ModelDemand(name, int(mem_gib * GiB), instances=n, compute_fraction=compute,
                       constraints=Constraints(**cons) if cons else Constraints())


def check(devices, demands, p) -> None:
    """Every dimension of every device within capacity, every instance placed once or explained, bound <= plan."""
    state = NodeState(devices)
    by_name = {d.name: d for d in demands}
    for a in p.placements:
        assert state.filter_device(by_name[a.model], a.device) == [], a
        state.reserve(by_name[a.model], a.instance, a.device)
    for dev in devices:
        cap = state.capacity[dev.id]
        assert state.used_memory[dev.id] <= cap.memory_bytes
        assert state.used_compute[dev.id] <= cap.compute_units
        assert cap.instances is None or len(state.members[dev.id]) <= cap.instances
    keys = sorted([(a.model, a.instance) for a in p.placements] + [(u.model, u.instance) for u in p.unplaced])
    assert keys == sorted((d.name, i) for d in demands for i in range(d.instances))
    assert p.lower_bound <= p.devices_used == len({a.device for a in p.placements})
    assert p.lower_bound == max((v for _, v in p.bounds), default=0) or p.optimal
    if p.optimal:
        assert p.lower_bound == p.devices_used and p.gap == 0 and p.proof_seconds is not None


# -- table-driven optima ----------------------------------------------------------------------------------------

CASES = [
    pytest.param(
        [gpu(f"g{i}") for i in range(4)], [model("a", 10, 5, compute=0.4)], 3,
        # memory: 5 x 10 = 50 of 80 GiB -> 1 GPU; compute: 5 x 0.4 = 2.0 -> 2 GPUs, but 3 x 0.4 = 1.2 > 1, so two per
        # GPU at most: ceil(5 / 2) = 3 (the conflict-free bound says 2: the exact solver proves 3)
        id="compute-binds-two-per-gpu"),
    pytest.param(
        [gpu(f"g{i}") for i in range(4)], [model("mem", 50, 2, compute=0.2), model("cu", 20, 2, compute=0.7)], 2,
        # one 50 GiB / 0.2 with one 20 GiB / 0.7 fill a GPU to 70 GiB and 0.9: 2 GPUs; memory alone (140 GiB) needs
        # 2, and two "mem" (100 GiB) or two "cu" (1.4) never share
        id="complementary-pairs"),
    pytest.param(
        [gpu(f"g{i}") for i in range(6)],
        [model("big-mem", 60, 2, compute=0.1), model("big-cu", 10, 2, compute=0.8), model("small", 10, 2, compute=0.1)],
        2,
        # big-mem + big-cu + small = 80 GiB and 1.0 compute exactly: two GPUs hold everything, filled 100% in both
        id="exact-fill-both-dimensions"),
    pytest.param(
        [gpu(f"g{i}", instance_cap=2) for i in range(5)], [model("tiny", 1, 7, compute=0.05)], 4,
        # memory 7 GiB and compute 0.35 fit one GPU; the cap of 2 instances per device makes it ceil(7 / 2) = 4
        id="instance-cap-binds"),
    pytest.param(
        [gpu("big", 80), gpu("s0", 10, 1 / 7, kind="mig", parent_id="p"), gpu("s1", 10, 1 / 7, kind="mig",
                                                                             parent_id="p")],
        [model("svc", 8, 2, compute=1 / 7, kinds=frozenset({"mig"}))], 2,
        # must run on MIG: one 8 GiB / 1/7 instance per 10 GiB / 1/7 slice -> both slices
        id="mig-only"),
]


@pytest.mark.parametrize("devices,demands,optimum", CASES)
def test_table_optimum_proven(devices, demands, optimum):
    p = plan(devices, demands, config=PlannerConfig(time_limit_seconds=5))
    check(devices, demands, p)
    assert not p.unplaced and p.devices_used == optimum
    if HIGHS:
        assert p.optimal and p.lower_bound == optimum


def test_time_limit_zero_is_the_greedy_and_says_so():
    devices, demands = placement_sets.known_optimum(10, 0)
    p = plan(devices, demands, config=PlannerConfig(time_limit_seconds=0))
    check(devices, demands, p)
    assert p.method == "greedy" and p.first_plan_seconds <= p.elapsed_seconds


# -- lower bounds -----------------------------------------------------------------------------------------------

class TestBounds:
    def _bounds(self, devices, demands):
        state = NodeState(devices)
        eligible = {d.name: eligible_devices(d, devices, state.capacity) for d in demands}
        items = [(d, i) for d in demands for i in range(d.instances)]
        return dimension_bounds(devices, items, state, eligible)

    def test_l2_per_dimension(self):
        # memory: three 41 GiB instances on 80 GiB GPUs: L1 = ceil(123 / 80) = 2, L2 = 3 (each is > 40 GiB)
        # compute: 3 x 0.2 = 0.6 -> 1
        b = self._bounds([gpu(f"g{i}") for i in range(4)], [model("a", 41, 3, compute=0.2)])
        assert b["memory"] == 3 and b["compute"] == 1

    def test_unequal_devices_use_the_largest_first(self):
        # 90 GiB in all: the 80 GiB GPU and one 10 GiB slice are the fewest devices that add up to it -> 2
        b = self._bounds([gpu("big", 80), gpu("s0", 10, 1 / 7, kind="mig"), gpu("s1", 10, 1 / 7, kind="mig")],
                         [model("a", 9, 10)])
        assert b["memory"] == 2

    def test_instance_caps(self):
        # caps 3 + 2 + 2: seven instances need all three devices
        devs = [gpu("a", instance_cap=3), gpu("b", instance_cap=2), gpu("c", instance_cap=2)]
        assert self._bounds(devs, [model("m", 1, 7)])["instances"] == 3

    def test_conflicts_across_dimensions(self):
        # a (50 GiB, 0.1) and b (10 GiB, 0.6): two a's exceed memory, two b's exceed compute, a + b fits -> the
        # largest set of pairwise conflicting instances is {a, a} or {b, b}: 2; with c (45 GiB, 0.5) conflicting
        # with both a (95 GiB) and b (1.1): {a, a, c}? c + c = 90 GiB conflicts too -> {a, a, c, c} = 4
        devs = [gpu(f"g{i}") for i in range(6)]
        demands = [model("a", 50, 2, compute=0.1), model("b", 10, 2, compute=0.6), model("c", 45, 2, compute=0.5)]
        state = NodeState(devs)
        eligible = {d.name: eligible_devices(d, devs, state.capacity) for d in demands}
        items = [(d, i) for d in demands for i in range(d.instances)]
        assert conflict_clique(items, state, eligible) == 4

    def test_no_device_accepts_both(self):
        # x runs only on g0, y only on g1: they never share, whatever their sizes
        devs = [gpu("g0"), gpu("g1")]
        demands = [model("x", 1, devices=frozenset({"g0"})), model("y", 1, devices=frozenset({"g1"}))]
        assert self._bounds(devs, demands)["conflicts"] == 2


# -- minimum bin slack ------------------------------------------------------------------------------------------

def test_min_bin_slack_finds_the_exact_split_best_fit_misses():
    # 25 GPUs each split exactly in memory and compute (99 instances): best fit decreasing closes devices on
    # whatever fits next and needs 26; minimum bin slack looks for the subset that fills each device and finds 25
    devices, demands = placement_sets.known_optimum(25, 1)
    greedy = plan(devices, demands, config=PlannerConfig(time_limit_seconds=0))
    state = NodeState(devices)
    eligible = {d.name: eligible_devices(d, devices, state.capacity) for d in demands}
    items = [(d, i) for d in demands for i in range(d.instances)]
    built = min_bin_slack(devices, items, eligible, 0, params=SlackParams(), deadline=float("inf"), clock=FakeClock())
    assert greedy.devices_used > 25  # best fit: 26 on this instance
    assert len(built.where) == len(items) and len(built.used_devices()) == 25


def test_min_bin_slack_gives_up_at_the_deadline():
    devices, demands = placement_sets.known_optimum(25, 1)
    state = NodeState(devices)
    eligible = {d.name: eligible_devices(d, devices, state.capacity) for d in demands}
    items = [(d, i) for d in demands for i in range(d.instances)]
    assert min_bin_slack(devices, items, eligible, 0, params=SlackParams(node_budget=10**9, stop_fill=2.0),
                         deadline=0.5, clock=FakeClock(step=1.0)) is None  # read every 1024 nodes


@pytest.mark.parametrize("k,seed", [(25, 0), (25, 1), (25, 2), (50, 0)])
def test_known_optimum_sets_reach_and_prove_k(k, seed):
    # k devices split exactly in memory and compute at 98-100% fill: sum > 0.98 k > k - 1 devices' worth in both
    # dimensions, so ceil(sum / capacity) = k proves the k found
    devices, demands = placement_sets.known_optimum(k, seed)
    p = plan(devices, demands, config=PlannerConfig(time_limit_seconds=20))
    check(devices, demands, p)
    assert p.devices_used == k and p.optimal and p.lower_bound == k


# -- spread by contention ---------------------------------------------------------------------------------------

class TestSpread:
    SPREAD = PlannerConfig(strategy="spread", time_limit_seconds=0)

    def test_small_models_take_the_idle_slice_not_the_busy_gpu(self):
        # big GPU 80 GiB; slice 10 GiB, 1/7. First instance: big (contention 1/80) vs slice (1/10) -> big.
        # Second: big would hold two instances (instance share 1/2 -> score 50), the idle slice 1 GiB of 10 (0.1 ->
        # 90) -> slice
        devs = [gpu("big", 80), gpu("slice", 10, 1 / 7, kind="mig", parent_id="p")]
        p = plan(devs, [model("a", 1), model("b", 1)], config=self.SPREAD)
        assert {a.device for a in p.placements} == {"big", "slice"}

    def test_a_model_that_would_fill_the_slice_goes_next_to_the_other(self):
        # second instance 9 GiB: slice 9/10 -> contention 0.9 (score 10); big: two instances -> 0.5 (score 50)
        devs = [gpu("big", 80), gpu("slice", 10, 1 / 7, kind="mig", parent_id="p")]
        p = plan(devs, [model("a", 9), model("b", 9)], config=self.SPREAD)
        assert [a.device for a in p.placements] == ["big", "big"]

    def test_compute_share_balances(self):
        # three GPUs; instances of 0.5 compute: each to its own GPU (0.5) before any doubles up (1.0)
        p = plan([gpu(f"g{i}") for i in range(3)], [model("m", 1, 3, compute=0.5)], config=self.SPREAD)
        assert len({a.device for a in p.placements}) == 3

    def test_contention_is_the_largest_share(self):
        state = NodeState([gpu("g", 10)])
        state.reserve(model("a", 2, compute=0.7), 0, "g")
        # after adding b (1 GiB, 0.1): memory 3/10 = 0.3, compute 0.8, instances (2 - 1) / 2 = 0.5 -> 0.8
        assert contention(state, "g", model("b", 1, compute=0.1)) == pytest.approx(0.8)


# -- properties -------------------------------------------------------------------------------------------------

@st.composite
def small_problems(draw):
    n_dev = draw(st.integers(1, 4))
    devices = [Device(f"d{k}", draw(st.integers(4, 12)) * GiB, draw(st.sampled_from([1.0, 0.5, 3 / 7])),
                      instance_cap=draw(st.sampled_from([None, None, 1, 2, 3]))) for k in range(n_dev)]
    demands = [ModelDemand(f"m{j}", draw(st.integers(1, 8)) * GiB, instances=draw(st.integers(1, 2)),
                           compute_fraction=draw(st.sampled_from([0.0, 0.1, 0.25, 0.4, 0.6])))
               for j in range(draw(st.integers(1, 3)))]
    return devices, demands


def brute_force_optimum(devices, demands) -> int | None:
    """The fewest devices that hold every instance, by trying every assignment; None if none holds them all."""
    items = [(d, i) for d in demands for i in range(d.instances)]
    best = None
    for choice in itertools.product(range(len(devices)), repeat=len(items)):
        state = NodeState(devices)
        ok = True
        for (d, i), k in zip(items, choice):
            if not state.fits(d, devices[k].id):
                ok = False
                break
            state.reserve(d, i, devices[k].id)
        if ok:
            used = len(state.used_devices())
            best = used if best is None else min(best, used)
    return best


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(small_problems())
def test_property_bound_plan_and_proof_against_brute_force(problem):
    devices, demands = problem
    p = plan(devices, demands, config=PlannerConfig(time_limit_seconds=0.5))
    check(devices, demands, p)
    if p.unplaced:
        return
    opt = brute_force_optimum(devices, demands)
    assert opt is not None
    assert p.lower_bound <= opt <= p.devices_used  # the bound is a real bound
    if p.optimal:
        assert p.devices_used == opt  # a proof is never claimed for a plan that is not optimal


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(5, 40), st.integers(0, 10_000), st.sampled_from(["pack", "spread"]))
def test_property_random_2d_within_every_capacity(n, seed, strategy):
    devices, demands = placement_sets.random_2d(n, seed)
    p = plan(devices, demands, config=PlannerConfig(strategy=strategy, time_limit_seconds=0.2))
    check(devices, demands, p)
    assert not p.unplaced
    # compute units are exact integers: each device's sum is compared without rounding
    assert all(compute_units(d.compute_fraction) <= COMPUTE_UNITS for d in demands)


def test_the_exact_solver_is_a_main_dependency():
    """`pip install .` (no extras) must bring HiGHS: scipy is in [project].dependencies, not only in an extra."""
    import tomllib

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    names = [dep.split(">")[0].split("=")[0].split("<")[0].split(";")[0].strip().lower()
             for dep in project["dependencies"]]
    assert "scipy" in names
    from gpud.placement.solver import EXACT_SOLVER
    assert EXACT_SOLVER == "highs"  # installed here, as pip installs it
