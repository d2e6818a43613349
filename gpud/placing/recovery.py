"""Putting back what a lost device held is recovery, not scaling (pure; the placement service's rescale uses it).

A device is lost when the driver reports it so or when gpud gave up on its worker (a crash loop). `placement.diff`
removes each instance there first and adds its replacement elsewhere later. Here:
- that pair becomes one move off the lost device, made before broken: the lost instance (down, but what keeps its
  version's requests queued rather than refused) goes only once its replacement serves, so a load that fails
  leaves it there and the next interval tries again;
- the steps of a recovery are never held back by the controller's steps-per-interval limit: every model the device
  held is served again within one interval plus its load time where the node has room. Only scaling steps are
  capped, and a capped one that frees room (a removal or a move) is still taken when a recovery step comes after it,
  since that step may count on the room.
"""
from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import replace

from gpud.placement import Move


def recovering(m: Move, lost: Collection[str]) -> bool:
    """Whether `m` puts back (or, with no room elsewhere, lets go of) an instance of a lost device."""
    return m.from_device is not None and m.from_device in lost


def as_moves_off_lost_devices(moves: Sequence[Move], lost: Collection[str]) -> list[Move]:
    """`moves` with each removal of an instance on a lost device and that instance's later add elsewhere made one
    move from the lost device, at the add's place. A lost instance with no replacement keeps its removal."""
    replaced = {(m.model, m.instance) for m in moves if m.kind == "add"}
    lost_at = {(m.model, m.instance): m.from_device for m in moves
               if m.kind == "remove" and recovering(m, lost) and (m.model, m.instance) in replaced}
    out = []
    for m in moves:
        key = (m.model, m.instance)
        if key not in lost_at:
            out.append(m)
        elif m.kind == "add":
            out.append(replace(m, kind="move", from_device=lost_at[key], note="device lost or unhealthy"))
        # else: the removal, done by the move once the replacement serves
    return out


def steps_for_interval(moves: Sequence[Move], lost: Collection[str], max_scaling_steps: int) -> list[Move]:
    """The steps to take this interval, in order: every recovery step, and at most `max_scaling_steps` others (more
    only where a recovery step after it may need the room a removal or a move frees)."""
    last_recovery = max((k for k, m in enumerate(moves) if recovering(m, lost)), default=-1)
    taken: list[Move] = []
    scaling = 0
    for k, m in enumerate(moves):
        if recovering(m, lost):
            taken.append(m)
        elif scaling < max_scaling_steps or (k < last_recovery and m.kind != "add"):
            taken.append(m)
            scaling += 1
    return taken
