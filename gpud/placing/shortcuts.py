"""Adds that this interval's steps would not reach, given their room by a few moves instead (pure; the placement
service's rescale uses it).

The incremental re-plan may place a new instance where room appears only after a re-pack. Such an add waits: for
the moves before it, capped per interval, or for good when part of the re-pack cannot run make-before-break; the
next interval re-plans anew from what the partial moves left, and the add can wait a whole load ramp
(docs/benchmarks.md, the objectives replay). Here each such add (the most urgent version first) is looked for a
device that one or two make-before-break moves of other versions' instances make room on now
(gpud.placement.shortcut); those steps come first, then what of the plan's adds and removals still fits. Versions
missing their latency objective are not moved to make room; for one of them, the spare instances of versions whose
objective holds with margin (the controller's claims) may go instead of moving (an eviction, logged as one).
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence

from gpud.placement import Assignment, Move
from gpud.placement.shortcut import Shortcut, ledger, room_by_few_moves
from gpud.placing.inputs import PlacementInputs


def unreached_adds(moves: Sequence[Move], todo: Sequence[Move], current: Sequence[Assignment]) -> list[Move]:
    """The re-plan's adds of new instances that are not among this interval's steps: waiting on the cap (behind
    moves, or other adds) or on room. Not the second half of a move the re-plan had to break (stopped, started
    again elsewhere): that instance runs now."""
    taken = {(m.model, m.instance) for m in todo}
    running = {(a.model, a.instance) for a in current}
    return [m for m in moves if m.kind == "add" and (m.model, m.instance) not in taken | running]


def shortcuts(adds: Sequence[Move], inputs: PlacementInputs, urgent: Collection[tuple[str, str]],
              rank: Callable[[Move], int], max_steps: int,
              spare: Mapping[str, int] | None = None) -> list[Shortcut]:
    """The ways to start `adds` now (their steps: `steps_of`), each after at most two make-before-break moves of
    other versions' instances (never an urgent one's) to devices with room now, the most urgent first (`rank`), at
    most `max_steps` steps in all; [] when there is no short way for any. For an add of an urgent version, `spare`
    (demand name -> how many of its instances its version may give up: the claims' spare instances) may be removed
    instead of moved: no load."""
    keep = {name for name in inputs.groups if inputs.version_of(name) in urgent}
    current = list(inputs.current)
    out: list[Shortcut] = []
    steps = 0
    for add in sorted(adds, key=lambda m: (rank(m), m.model, m.instance)):
        removable = dict(spare or {}) if inputs.version_of(add.model) in urgent else None
        found = room_by_few_moves(inputs.devices, inputs.demands, current, add.model, add.instance, keep=keep,
                                  removable=removable)
        if found is None or steps + len(found.steps) > max_steps:
            continue
        out.append(found)
        steps += len(found.steps)
        if spare:
            gone = [m.model for m in found.moves if m.kind == "remove"]
            spare = {k: n - gone.count(k) for k, n in spare.items()}
        current = found.applied(current)
    return out


def steps_of(found: Sequence[Shortcut]) -> list[Move]:
    """The shortcuts' steps, in order."""
    return [m for s in found for m in s.steps]


def then_what_still_fits(first: Sequence[Move], plan: Sequence[Move], inputs: PlacementInputs) -> list[Move]:
    """`first`, then the steps of `plan` (each orderable in the plan as it was) that still can be taken after it:
    an add or a move whose target still has room, a removal; not a step of an instance `first` added or moved."""
    by_name = {d.name: d for d in inputs.demands}
    state = ledger(inputs.devices, by_name, inputs.current)
    taken = set()
    for m in first:
        key = (m.model, m.instance)
        taken.add(key)
        if m.kind != "add":
            state.unreserve(*key)
        if m.to_device is not None:  # an add or a move (a removal: a spare instance let go)
            state.reserve(by_name[m.model], m.instance, m.to_device)
    out = list(first)
    for m in plan:
        key = (m.model, m.instance)
        if key in taken:
            continue
        if m.kind == "remove":
            state.unreserve(*key)
            out.append(m)
            continue
        assert m.to_device is not None  # an add or a move has a destination
        if m.model not in by_name or not state.fits(by_name[m.model], m.to_device):
            continue
        state.unreserve(*key)  # a move's old instance: gone once the new one serves (a no-op for an add)
        state.reserve(by_name[m.model], m.instance, m.to_device)
        out.append(m)
    return out
