"""nvidia-smi for a FakeNvml machine: what the real tool would print for it, as a gpud.cli.check.smi Runner, or as an
executable script (for the command-line path). Readings can be overridden to inject a disagreement."""
from __future__ import annotations


import stat
from pathlib import Path

from gpud.cli.check.smi import FIELDS, SmiError
from tests.fake_nvml import POWER_LIMIT_W, DEFAULT_POWER_LIMIT_W, FakeNvml, _Handle

MIB = 2**20


def query_gpu_csv(fake: FakeNvml, overrides: dict[tuple[int, str], str] | None = None) -> str:
    """`nvidia-smi --query-gpu=<FIELDS> --format=csv,noheader,nounits` for the machine; `overrides` replaces
    (GPU index, field) values."""
    lines = []
    for i, g in enumerate(fake.gpus):
        na = "[GPU requires reset]" if g.lost else None
        used = g.memory_used_bytes if g.mig is None else sum(m.memory_used_bytes for m in g.mig)
        values = {
            "index": str(i), "name": g.model.nvml_name, "uuid": g.uuid, "pci.bus_id": g.pci_bus_id,
            "memory.total": na or str(g.model.memory_bytes // MIB),
            "memory.used": na or str(used // MIB),  # nvidia-smi leaves the driver's reserved memory out
            "power.draw": na or f"{g.power_mw / 1000:.2f}",
            "power.limit": na or f"{POWER_LIMIT_W.get(g.model.nvml_name, DEFAULT_POWER_LIMIT_W):.2f}",
            "utilization.gpu": na or ("[N/A]" if g.mig is not None else str(g.utilization_percent)),
            "temperature.gpu": na or str(g.temperature_c),
            "clocks.sm": na or str(g.sm_clock_mhz), "clocks.mem": na or str(g.memory_clock_mhz),
            "mig.mode.current": ("[N/A]" if not g.model.profiles else "Enabled" if g.mig is not None else "Disabled"),
        }
        for (index, name), value in (overrides or {}).items():
            if index == i:
                values[name] = value
        lines.append(", ".join(values[f] for f in FIELDS))
    return "\n".join(lines) + "\n"


def list_gpus(fake: FakeNvml) -> str:
    """`nvidia-smi -L`: each GPU, and its MIG devices indented under it."""
    lines = []
    for i, g in enumerate(fake.gpus):
        lines.append(f"GPU {i}: {g.model.nvml_name} (UUID: {g.uuid})")
        for k, m in enumerate(g.mig or []):
            lines.append(f"  MIG {m.profile:<12} Device {k:>2}: (UUID: {fake._mig_uuid(_Handle(i, k))})")
    return "\n".join(lines) + "\n"


def runner(fake: FakeNvml, overrides: dict[tuple[int, str], str] | None = None):
    def run(args: list[str]) -> str:
        if args == ["-L"]:
            return list_gpus(fake)
        if args[0].startswith("--query-gpu="):
            asked = tuple(args[0].removeprefix("--query-gpu=").split(","))
            if asked != FIELDS or args[1:] != ["--format=csv,noheader,nounits"]:
                raise SmiError(f"the fake nvidia-smi answers only gpudctl check's query, not {args}")
            return query_gpu_csv(fake, overrides)
        raise SmiError(f"the fake nvidia-smi does not know {args}")

    return run


def write_executable(path: Path, fake: FakeNvml, overrides: dict[tuple[int, str], str] | None = None) -> Path:
    """A script that prints what nvidia-smi would for the machine, for `gpudctl check --nvidia-smi PATH`."""
    query = path.with_suffix(".query")
    listing = path.with_suffix(".list")
    query.write_text(query_gpu_csv(fake, overrides))
    listing.write_text(list_gpus(fake))
    path.write_text(f'#!/bin/sh\ncase "$1" in\n  -L) cat "{listing}" ;;\n  --query-gpu=*) cat "{query}" ;;\n'
                    f'  *) echo "unknown argument $1" >&2; exit 2 ;;\nesac\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path



