"""nvidia-smi as the reference: what the driver's own tool says about each GPU and its MIG devices.

Two calls, both stable, documented interfaces: `nvidia-smi --query-gpu=FIELDS --format=csv,noheader,nounits` (one
line per GPU) and `nvidia-smi -L` (GPUs and their MIG devices with profile and UUID). The command runner is
injected (`Runner`), so tests drive this with canned outputs or a fake executable.
"""
from __future__ import annotations

import csv
import io
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field

# The query fields, in order; `nvidia-smi --help-query-gpu` documents each.
FIELDS = ("index", "name", "uuid", "pci.bus_id", "memory.total", "memory.used", "power.draw", "power.limit",
          "utilization.gpu", "temperature.gpu", "clocks.sm", "clocks.mem", "mig.mode.current")
_NA = {"", "[N/A]", "N/A", "[Not Supported]", "Not Supported", "[Unknown Error]", "[GPU requires reset]"}

Runner = Callable[[list[str]], str]
"""Runs nvidia-smi with these arguments and returns its standard output; raises SmiError when it cannot."""


class SmiError(RuntimeError):
    """nvidia-smi could not be run or its output not read; the message says which."""


@dataclass(frozen=True)
class SmiMig:
    gpu_index: int
    profile: str  # "3g.40gb" (a compute instance smaller than its GPU instance: "1c.3g.40gb")
    uuid: str


@dataclass(frozen=True)
class SmiGpu:
    """One GPU as nvidia-smi reports it; None where it says N/A. Units as nvidia-smi prints them."""

    index: int
    name: str
    uuid: str
    pci_bus_id: str
    memory_total_mib: int | None
    memory_used_mib: int | None
    power_draw_w: float | None
    power_limit_w: float | None
    utilization_percent: float | None
    temperature_c: float | None
    sm_clock_mhz: float | None
    memory_clock_mhz: float | None
    mig_enabled: bool | None  # None: the GPU has no MIG mode
    mig_devices: tuple[SmiMig, ...] = field(default=())


def subprocess_runner(executable: str = "nvidia-smi", timeout_s: float = 30.0) -> Runner:
    """A Runner that executes nvidia-smi (found on PATH unless a path is given)."""

    def run(args: list[str]) -> str:
        exe = shutil.which(executable)
        if exe is None:
            raise SmiError(f"{executable} not found (it comes with the NVIDIA driver)")
        try:
            proc = subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise SmiError(f"{executable} {' '.join(args)} did not answer within {timeout_s:.0f} s") from None
        except OSError as exc:
            raise SmiError(f"cannot run {executable}: {exc}") from None
        if proc.returncode != 0:
            said = (proc.stderr or proc.stdout).strip().splitlines()
            raise SmiError(f"{executable} {' '.join(args)} exited {proc.returncode}: "
                           f"{said[-1] if said else 'no message'}")
        return proc.stdout

    return run


def _number(text: str) -> float | None:
    text = text.strip()
    if text in _NA:
        return None
    try:
        return float(text)
    except ValueError:
        return None


def parse_query(text: str) -> list[SmiGpu]:
    """Rows of `--query-gpu=<FIELDS> --format=csv,noheader,nounits`. SmiError for a line that is not one."""
    gpus = []
    for row in csv.reader(io.StringIO(text), skipinitialspace=True):
        if not row:
            continue
        if len(row) != len(FIELDS):
            raise SmiError(f"nvidia-smi answered {len(row)} fields where {len(FIELDS)} were asked: {row!r}")
        v = dict(zip(FIELDS, (c.strip() for c in row)))
        try:
            index = int(v["index"])
        except ValueError:
            raise SmiError(f"nvidia-smi answered a GPU index {v['index']!r}") from None
        total, used = _number(v["memory.total"]), _number(v["memory.used"])
        mig = v["mig.mode.current"].lower()
        gpus.append(SmiGpu(
            index=index, name=v["name"], uuid=v["uuid"], pci_bus_id=v["pci.bus_id"],
            memory_total_mib=int(total) if total is not None else None,
            memory_used_mib=int(used) if used is not None else None,
            power_draw_w=_number(v["power.draw"]), power_limit_w=_number(v["power.limit"]),
            utilization_percent=_number(v["utilization.gpu"]), temperature_c=_number(v["temperature.gpu"]),
            sm_clock_mhz=_number(v["clocks.sm"]), memory_clock_mhz=_number(v["clocks.mem"]),
            mig_enabled=True if mig == "enabled" else False if mig == "disabled" else None,
        ))
    return gpus


_GPU_LINE = re.compile(r"^GPU (\d+): .*\(UUID: (GPU-[^)]+)\)")
_MIG_LINE = re.compile(r"^\s+MIG (\S+)\s+Device\s+\d+: \(UUID: (MIG-[^)]+)\)")


def parse_list(text: str) -> list[SmiMig]:
    """MIG devices from `nvidia-smi -L` (each indented under its GPU's line)."""
    out: list[SmiMig] = []
    gpu: int | None = None
    for line in text.splitlines():
        if m := _GPU_LINE.match(line):
            gpu = int(m.group(1))
        elif (m := _MIG_LINE.match(line)) and gpu is not None:
            out.append(SmiMig(gpu, m.group(1), m.group(2)))
    return out


def query(run: Runner) -> list[SmiGpu]:
    """Every GPU with its MIG devices, as nvidia-smi reports them now."""
    gpus = parse_query(run([f"--query-gpu={','.join(FIELDS)}", "--format=csv,noheader,nounits"]))
    migs = parse_list(run(["-L"])) if any(g.mig_enabled for g in gpus) else []
    return [SmiGpu(**{**g.__dict__, "mig_devices": tuple(m for m in migs if m.gpu_index == g.index)})
            for g in gpus]
