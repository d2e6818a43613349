"""Room for one instance by a few make-before-break moves, from the placement as it is now.

A full re-plan may put an urgent instance where room appears only after a long re-pack, and a re-pack of 15-20
steps is rarely all orderable make-before-break: the instance that needed room waits for it interval after interval
(docs/benchmarks.md, the objectives replay). This looks for the shortest way instead: a device where the instance
fits once one or two of the instances on it have been started elsewhere, each where it fits now, then stopped there
(or, where the caller allows it, removed: a spare instance). Every step can run at once, in order, with nothing
stopped before its replacement serves."""
from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from itertools import combinations

from gpud.placement.framework import NodeState, static_reasons
from gpud.placement.model import Assignment, Device, ModelDemand, Move

MAX_SHORTCUT_MOVES = 2  # more than this and the full re-plan's packing is the better guide


@dataclass(frozen=True)
class Shortcut:
    """Steps that give `add` its room: `moves` (make-before-break moves and removals of spare instances, in order),
    then the add itself."""
    moves: tuple[Move, ...]
    add: Move
    moved_bytes: int  # memory loaded again elsewhere: what the moves cost

    @property
    def cost(self) -> tuple[int, int, int]:
        loads = sum(1 for m in self.moves if m.kind == "move")
        return loads, len(self.moves), self.moved_bytes

    @property
    def steps(self) -> tuple[Move, ...]:
        return (*self.moves, self.add)

    def applied(self, current: Sequence[Assignment]) -> list[Assignment]:
        """`current` once these steps are done."""
        moved = {(m.model, m.instance): m.to_device for m in self.moves if m.kind == "move"}
        gone = {(m.model, m.instance) for m in self.moves if m.kind == "remove"}
        assert self.add.to_device is not None  # an add has a destination
        return [*(Assignment(a.model, a.instance, moved.get((a.model, a.instance)) or a.device) for a in current
                  if (a.model, a.instance) not in gone),
                Assignment(self.add.model, self.add.instance, self.add.to_device)]


def ledger(devices: Sequence[Device], by_name: dict[str, ModelDemand], current: Sequence[Assignment]) -> NodeState:
    """What `current` holds on each device."""
    state = NodeState(devices)
    for a in current:
        d = by_name.get(a.model) or ModelDemand(a.model, 0, instances=0)
        if a.device in state.devices and (a.model, a.instance) not in state.where:
            state.reserve(d, a.instance, a.device)
    return state


def _target(state: NodeState, demand: ModelDemand, away_from: str) -> str | None:
    """The healthy device other than `away_from` where `demand` fits now, the fullest such one first (best fit, so
    larger holes stay for larger instances)."""
    best: tuple[int, str] | None = None
    for dev_id in state.order:
        if dev_id == away_from or static_reasons(demand, state.devices[dev_id]) or not state.fits(demand, dev_id):
            continue
        left = state.capacity[dev_id].memory_bytes - state.used_memory[dev_id] - demand.memory_bytes
        if best is None or left < best[0]:
            best = (left, dev_id)
    return None if best is None else best[1]


def room_by_few_moves(devices: Sequence[Device], demands: Sequence[ModelDemand], current: Sequence[Assignment],
                      model: str, instance: int, *, max_moves: int = MAX_SHORTCUT_MOVES,
                      keep: Collection[str] = (), removable: Mapping[str, int] | None = None) -> Shortcut | None:
    """The cheapest way to start instance `instance` of demand `model` by at most `max_moves` moves of other
    instances, each to a device where it fits now: fewest loads first (a move loads, a removal does not), then
    fewest steps, then least memory moved. None when there is no such way. `keep`: demands whose instances must not
    move. `removable`: demand -> how many of its instances may simply be removed instead (spare ones)."""
    by_name = {d.name: d for d in demands}
    demand = by_name[model]
    base = ledger(devices, by_name, current)
    best: Shortcut | None = None
    for dev_id in base.order:
        device = base.devices[dev_id]
        if static_reasons(demand, device):
            continue
        if base.fits(demand, dev_id):
            return Shortcut((), Move("add", model, instance, to_device=dev_id), 0)
        movable = sorted(((name, inst) for (name, inst) in base.members[dev_id]
                          if name != model and name not in keep and name in by_name),
                         key=lambda k: (-by_name[k[0]].memory_bytes, k))
        for n in range(1, max_moves + 1):
            for group in combinations(movable, n):
                found = _try(devices, by_name, current, demand, instance, dev_id, group, removable or {})
                if found is not None and (best is None or found.cost < best.cost):
                    best = found
    return best


def _try(devices: Sequence[Device], by_name: dict[str, ModelDemand], current: Sequence[Assignment],
         demand: ModelDemand, instance: int, dev_id: str, group: Sequence[tuple[str, int]],
         removable: Mapping[str, int]) -> Shortcut | None:
    state = ledger(devices, by_name, current)
    moves: list[Move] = []
    budget = dict(removable)
    for name, inst in group:  # the largest first (the order `movable` has), each where it fits with the others
        d = by_name[name]
        if budget.get(name, 0) > 0:
            budget[name] -= 1
            moves.append(Move("remove", name, inst, from_device=dev_id, note=f"spare: room for {demand.name}"))
            continue
        to = _target(state, d, away_from=dev_id)
        if to is None:
            return None
        # Make-before-break: the copy is reserved on its target while the original still holds its room here.
        state.reserve(d, -1 - len(moves), to)
        moves.append(Move("move", name, inst, from_device=dev_id, to_device=to,
                          note=f"room for {demand.name} on {dev_id}"))
    for name, inst in group:
        state.unreserve(name, inst)
    if not state.fits(demand, dev_id):
        return None
    return Shortcut(tuple(moves), Move("add", demand.name, instance, to_device=dev_id,
                                       note=f"after {len(moves)} move(s) off {dev_id}"),
                    sum(by_name[m.model].memory_bytes for m in moves if m.kind == "move"))
