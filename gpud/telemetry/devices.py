"""The device interface every other package sees: what a device is, one sample of it, and who provides them.

Two backends implement `DeviceBackend`: `gpud.telemetry.nvml.NvmlBackend` (a real driver) and
`gpud.telemetry.simulated.SimulatedBackend` (a node description). Both always include the host CPU as a device, so
models can be placed on it like on any GPU or MIG instance.

Ids are gpud's own and stable across restarts for the same hardware layout:
  "gpu0", "gpu1"        physical GPU by NVML index
  "gpu1/mig1.0"         MIG instance: parent id + "/mig" + GPU instance id + "." + compute instance id
  "cpu"                 the host CPU
"""
from __future__ import annotations

import os
import platform
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from gpud.placement.model import DeviceKind  # one definition of the kinds, in the lowest package

CPU_DEVICE_ID = "cpu"

# A GPU with MIG on is cut into 7 compute slices (A100, A30 has 4, H100, H200); compute_fraction is slices / 7.
MIG_COMPUTE_SLICES = 7

# XIDs that report trouble with a GPU or its memory (NVIDIA's XID catalog): 13 graphics engine exception, 31 memory
# page fault, 43 GPU stopped processing, 45 preemptive cleanup, 48 double-bit ECC error, 63/64 row remapping event /
# failure, 74 NVLink error, 79 fallen off the bus, 94/95 contained / uncontained ECC error, 119 GSP timeout. Every GPU
# whose XID events are watched exports these at 0 from the start, so a first event is a counter going 0 -> 1 that
# increase() sees, not a series that appears at 1; other codes appear when they happen.
WATCHED_XIDS = (13, 31, 43, 45, 48, 63, 64, 74, 79, 94, 95, 119)
# (error_type, counter_type) of the ECC counters a GPU with ECC on reports (NVML's volatile and aggregate counts)
ECC_COUNTER_KEYS = (("corrected", "volatile"), ("uncorrected", "volatile"), ("corrected", "aggregate"),
                    ("uncorrected", "aggregate"))


def gpu_device_id(index: int) -> str:
    return f"gpu{index}"


def mig_device_id(parent_id: str, gpu_instance_id: int, compute_instance_id: int) -> str:
    return f"{parent_id}/mig{gpu_instance_id}.{compute_instance_id}"


@dataclass(frozen=True)
class DeviceInfo:
    """What a device is. Static for the life of the backend (MIG re-layout means a new backend)."""

    id: str  # gpud id, see module docstring
    kind: DeviceKind
    index: int  # NVML GPU index; the parent's index for a MIG instance; -1 for the CPU
    name: str  # "NVIDIA A100-SXM4-80GB"; for the CPU the processor model
    uuid: str  # "GPU-..." / "MIG-..."; "" for the CPU
    pci_bus_id: str  # "00000000:07:00.0"; the parent's for MIG; "" for the CPU
    memory_total_bytes: int
    parent_id: str | None = None  # set only for MIG instances
    mig_profile: str | None = None  # "3g.40gb" for MIG instances
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None
    compute_fraction: float = 1.0  # share of the physical GPU's compute: 1.0 GPU/CPU, slices / 7 for MIG
    mig_enabled: bool = False  # a GPU with MIG on is not a leaf: its MIG instances are
    simulated: bool = False
    # Human-facing labels (gpu model, mig profile, parent). A dict is not hashable: keep it out of __hash__.
    labels: Mapping[str, str] = field(default_factory=dict, hash=False, compare=False)

    @property
    def is_leaf(self) -> bool:
        """True for what a model instance can be placed on: a GPU with MIG off, a MIG instance, the CPU."""
        return not (self.kind == "gpu" and self.mig_enabled)


@dataclass(frozen=True)
class DeviceReading:
    """One sample of a device. None means "not available" (NVML said NotSupported, or the simulated node has no
    such sensor): never a fake 0, so a dashboard shows a gap instead of a lie."""

    utilization_ratio: float | None = None  # 0..1 over the driver's (or the executor's) last sample window
    memory_used_bytes: int | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    temperature_c: float | None = None
    healthy: bool = True  # False once the driver reported the GPU lost (NVML_ERROR_GPU_IS_LOST)
    # -- richer readings (NVML only; appended after the original fields so positional use stays valid) -------
    memory_utilization_ratio: float | None = None  # share of time device memory was read or written, 0..1
    memory_free_bytes: int | None = None
    energy_joules: float | None = None  # monotonic since the driver loaded (NVML counts millijoules)
    sm_clock_hz: float | None = None
    memory_clock_hz: float | None = None
    clock_event_reasons: int | None = None  # NVML bitmask of why clocks are held down now (throttle reasons)
    clock_event_reasons_supported: int | None = None  # bitmask of the reasons this GPU can report
    pcie_tx_bytes_per_second: float | None = None  # from the GPU
    pcie_rx_bytes_per_second: float | None = None  # to the GPU
    gr_engine_active_ratio: float | None = None  # GPM (Hopper+): share of time any graphics/compute work ran
    sm_active_ratio: float | None = None  # GPM (Hopper+): share of SMs busy
    # (error_type "corrected" | "uncorrected", counter_type "volatile" | "aggregate") -> count, as NVML counts.
    # Mappings are not hashable: kept out of __hash__ like DeviceInfo.labels.
    ecc_errors: Mapping[tuple[str, str], int] = field(default_factory=dict, hash=False)
    xid_errors: Mapping[int, int] = field(default_factory=dict, hash=False)  # XID code -> events since gpud started


@runtime_checkable
class UsageSource(Protocol):
    """What gpud itself knows about a device's use: the executor implements it from the memory its model instances
    really hold and the time its workers were really busy. Used for the CPU device and for simulated GPUs."""

    def memory_used_bytes(self, device_id: str) -> int | None: ...

    def utilization_ratio(self, device_id: str) -> float | None: ...

    def unhealthy_reason(self, device_id: str) -> str | None:
        """Why gpud itself gave up on the device (its worker crash-loops), or None: the device then reads
        healthy=False whatever the driver says."""
        ...


class NoUsage:
    """A UsageSource that knows nothing: every reading is N/A. The default until the executor is wired in."""

    def memory_used_bytes(self, device_id: str) -> int | None:
        return None

    def utilization_ratio(self, device_id: str) -> float | None:
        return None

    def unhealthy_reason(self, device_id: str) -> str | None:
        return None


@runtime_checkable
class DeviceBackend(Protocol):
    @property
    def source(self) -> str:
        """"nvml" or "simulated:<node file>"."""
        ...

    def devices(self) -> list[DeviceInfo]:
        """Every device: each GPU followed by its MIG instances, then the CPU."""
        ...

    def leaf_devices(self) -> list[DeviceInfo]:
        """What models can be placed on: GPUs with MIG off, MIG instances, the CPU."""
        ...

    def sample(self, device_id: str) -> DeviceReading:
        """One reading; never raises for a known device (a lost GPU reads healthy=False). KeyError if unknown."""
        ...

    def sample_all(self) -> Mapping[str, DeviceReading]:
        """One sampling pass over every device, by id (what a scrape reads: nvitop's oneshot). A device it leaves
        out is sampled on its own with `sample`."""
        ...

    def close(self) -> None: ...


def leaf_devices(devices: Iterable[DeviceInfo]) -> list[DeviceInfo]:
    return [d for d in devices if d.is_leaf]


def _cpu_model_name() -> str:
    # /proc/cpuinfo names the processor ("AMD EPYC 7742 64-Core Processor"); platform.processor() is often just
    # "x86_64" on Linux, so it is only the fallback.
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "CPU"


def cpu_device(*, simulated: bool = False) -> DeviceInfo:
    """The host CPU as a device; memory is the host's total RAM (psutil)."""
    import psutil  # imported here so that `import gpud.telemetry.devices` stays cheap

    cores = psutil.cpu_count(logical=True) or os.cpu_count() or 1
    name = _cpu_model_name()
    return DeviceInfo(
        id=CPU_DEVICE_ID,
        kind="cpu",
        index=-1,
        name=name,
        uuid="",
        pci_bus_id="",
        memory_total_bytes=int(psutil.virtual_memory().total),
        simulated=simulated,
        labels={"model": name, "logical_cores": str(cores)},
    )


def format_device_tree(devices: Iterable[DeviceInfo]) -> list[str]:
    """One line per device, MIG instances indented under their GPU: for logs and `gpudctl inspect`."""
    lines = []
    for d in devices:
        gib = d.memory_total_bytes / 2**30
        if d.kind == "mig":
            lines.append(f"  └─ {d.id}: MIG {d.mig_profile} ({gib:.2f} GiB, {d.compute_fraction:.3f} of the GPU) "
                         f"{d.uuid}")
        elif d.kind == "gpu":
            mig = ", MIG on" if d.mig_enabled else ""
            lines.append(f"{d.id}: {d.name} ({gib:.2f} GiB{mig}) {d.uuid} {d.pci_bus_id}".rstrip())
        else:
            lines.append(f"{d.id}: {d.name} ({gib:.2f} GiB RAM)")
    return lines
