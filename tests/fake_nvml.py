"""A behavioural fake of the pynvml module, built from the data tables of real GPU models (gpud.placement.mig).

Same function names, argument orders, return shapes and error classes as pynvml (NVMLError with `.value`,
NVMLError_NotSupported, NVMLError_GpuIsLost, ...), so `NvmlBackend(nvml=FakeNvml(...))` runs the real code path.
Behaviour modelled on real drivers: a MIG-on GPU and its MIG devices answer NotSupported for utilization, MIG
devices also for power and temperature; empty MIG slots answer NotFound; power is in milliwatts.

Also modelled: clocks (MHz), the energy counter (mJ), ECC counters (NotSupported with ECC off), clock event
(throttle) reasons, PCIe throughput (KB/s), XID events delivered through event sets (Timeout when none is
pending), and GPM (Hopper or newer: the H100 answers isSupportedDevice=1, the A100 0; metrics need two samples of
the same device or GPU instance, taken in order).

Fault injection: `lose_gpu(index)`, `not_supported(fn, index=None)`, `remove_function(fn)`,
`queue_xid(index, xid, gpu_instance_id=None)`, `FakeNvml(driver="missing" | "not_loaded")`.
"""
from __future__ import annotations

import uuid as uuidlib
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from gpud.placement.mig import GpuModel, MigProfile, gpu_model, place_layout
from gpud.telemetry.power_model import POWER_SPECS

# The models the ready-made machines use; their data (NVML names, memory, MIG profiles) is gpud.placement.mig's table.
A100_SXM4_40GB = gpu_model("A100-SXM4-40GB")
A100_SXM4_80GB = gpu_model("A100-SXM4-80GB")
H100_SXM5_80GB = gpu_model("H100-80GB")
# Default enforced power limits (W) that nvidia-smi shows: gpud's power table (the simulated node's too).
POWER_LIMIT_W = {name: spec.limit_w for name, spec in POWER_SPECS.items()}
DEFAULT_POWER_LIMIT_W = 300.0

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25
nvmlMemory_v2 = 0x02000028  # pynvml's version constant of c_nvmlMemory_v2_t
NVML_DEVICE_MIG_DISABLE = 0
NVML_DEVICE_MIG_ENABLE = 1
NVML_TEMPERATURE_GPU = 0
NVML_CLOCK_GRAPHICS, NVML_CLOCK_SM, NVML_CLOCK_MEM = 0, 1, 2
NVML_MEMORY_ERROR_TYPE_CORRECTED, NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 0, 1
NVML_VOLATILE_ECC, NVML_AGGREGATE_ECC = 0, 1
NVML_PCIE_UTIL_TX_BYTES, NVML_PCIE_UTIL_RX_BYTES = 0, 1
nvmlEventTypeXidCriticalError = 0x8
NVML_GPM_METRICS_GET_VERSION = 1
NVML_GPM_METRIC_GRAPHICS_UTIL, NVML_GPM_METRIC_SM_UTIL = 1, 2
NVML_GPM_METRIC_PCIE_TX_PER_SEC, NVML_GPM_METRIC_PCIE_RX_PER_SEC = 20, 21  # MiB/s
# GPM is "Hopper or newer" (NVML docs): of the modelled GPUs only the H100.
GPM_MODELS = frozenset({H100_SXM5_80GB.nvml_name})
NO_GPU_INSTANCE = 0xFFFFFFFF  # event data gpuInstanceId when the event is not attributable to one


class NVMLError(Exception):
    def __init__(self, value: int):
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return f"NVML error {self.value}"


def _err(name: str, code: int) -> type[NVMLError]:
    def init(self: NVMLError) -> None:
        NVMLError.__init__(self, code)

    return type(name, (NVMLError,), {"__init__": init})


NVMLError_Uninitialized = _err("NVMLError_Uninitialized", NVML_ERROR_UNINITIALIZED)
NVMLError_InvalidArgument = _err("NVMLError_InvalidArgument", NVML_ERROR_INVALID_ARGUMENT)
NVMLError_NotSupported = _err("NVMLError_NotSupported", NVML_ERROR_NOT_SUPPORTED)
NVMLError_NotFound = _err("NVMLError_NotFound", NVML_ERROR_NOT_FOUND)
NVMLError_DriverNotLoaded = _err("NVMLError_DriverNotLoaded", NVML_ERROR_DRIVER_NOT_LOADED)
NVMLError_LibraryNotFound = _err("NVMLError_LibraryNotFound", NVML_ERROR_LIBRARY_NOT_FOUND)
NVMLError_FunctionNotFound = _err("NVMLError_FunctionNotFound", NVML_ERROR_FUNCTION_NOT_FOUND)
NVMLError_GpuIsLost = _err("NVMLError_GpuIsLost", NVML_ERROR_GPU_IS_LOST)
NVMLError_Timeout = _err("NVMLError_Timeout", NVML_ERROR_TIMEOUT)


@dataclass
class FakeMig:
    profile: str
    gpu_instance_id: int
    start: int = 0  # placement start slot on the memory-slot axis (mig_layout fills it in)
    compute_instance_id: int = 0
    memory_used_bytes: int = 0
    gpm_graphics_percent: float = 0.0  # what GPM reports for this GPU instance (H100 only)
    gpm_sm_percent: float = 0.0


@dataclass
class FakeGpu:
    model: GpuModel
    mig: list[FakeMig] | None = None  # None = MIG mode off
    memory_used_bytes: int = 0
    memory_reserved_bytes: int = 0  # what the driver keeps for itself: in v1's `used`, apart in v2
    utilization_percent: int = 0
    power_mw: int = 0
    temperature_c: int = 30
    lost: bool = False
    uuid: str = ""
    pci_bus_id: str = ""
    memory_utilization_percent: int = 0
    energy_mj: int = 0  # nvmlDeviceGetTotalEnergyConsumption, millijoules since driver load
    sm_clock_mhz: int = 1410
    memory_clock_mhz: int = 1593
    # (error type, counter type) -> count; None = ECC mode off (NotSupported)
    ecc: dict[tuple[int, int], int] | None = field(default_factory=dict)
    clock_event_reasons: int = 0x1  # idle
    supported_clock_event_reasons: int = 0x1FF
    pcie_tx_kb_per_s: int = 0
    pcie_rx_kb_per_s: int = 0
    gpm_graphics_percent: float = 0.0  # whole-GPU GPM activity (H100 only)
    gpm_sm_percent: float = 0.0
    gpm_pcie_tx_mib_per_s: float = 0.0
    gpm_pcie_rx_mib_per_s: float = 0.0
    events: list[SimpleNamespace] = field(default_factory=list)  # pending XID events (fault injection)


@dataclass(frozen=True)
class _Handle:
    gpu: int
    mig: int | None = None  # index into the GPU's MIG slot table


@dataclass(frozen=True)
class _GpuInstanceHandle:
    gpu: int
    gpu_instance_id: int


@dataclass
class _EventSet:
    gpus: list[int] = field(default_factory=list)
    freed: bool = False


@dataclass
class _GpmSample:
    """What a GPM sample buffer holds once filled: whose counters, in which order, and the activity then."""

    source: tuple[int, int | None] | None = None  # (gpu, GPU instance id or None for the whole GPU)
    seq: int = 0
    values: dict[int, float] = field(default_factory=dict)
    freed: bool = False


class _GpmMetric:
    __slots__ = ("metricId", "nvmlReturn", "value")

    def __init__(self) -> None:
        self.metricId = 0
        self.nvmlReturn = NVML_SUCCESS
        self.value = 0.0


class c_nvmlGpmMetricsGet_t:  # noqa: N801 - pynvml's ctypes struct name
    def __init__(self) -> None:
        self.version = 0
        self.numMetrics = 0
        self.sample1: _GpmSample | None = None
        self.sample2: _GpmSample | None = None
        self.metrics = [_GpmMetric() for _ in range(98)]  # NVML_GPM_METRIC_MAX


def mig_layout(model: GpuModel, profiles: list[str]) -> list[FakeMig]:
    """MIG devices for a layout, GPU instance ids 1.. in order (validated against the model's placements)."""
    starts = place_layout(model, profiles)
    if starts is None:
        raise ValueError(f"layout {profiles} is not valid on {model.nvml_name}")
    return [FakeMig(p, gi, start=s) for gi, (p, s) in enumerate(zip(profiles, starts), start=1)]


def nvml_profile_index(model: GpuModel, spec: MigProfile) -> int:
    """NVML_GPU_INSTANCE_PROFILE_* (the argument of nvmlDeviceGetGpuInstanceProfileInfo; values from nvml.h):
    1/2/3/4/7 slices = 0/1/2/3/4, 1 slice +me = 7 (REV1), 2 slices +me = 8 (REV1), 1 slice with 2 memory
    slices = 9 (REV2)."""
    if spec.media_extensions:
        return {1: 7, 2: 8}[spec.compute_slices]
    if spec.compute_slices == 1 and spec.memory_slices == 2:  # 1g.20gb on A100-80GB (there is none on A30)
        return 9
    return {1: 0, 2: 1, 3: 2, 4: 3, 7: 4}[spec.compute_slices]


class FakeNvml:
    """The fake module. Attribute names mirror pynvml; instances are independent machines."""

    # error classes and constants as module attributes, like pynvml
    NVMLError = NVMLError
    NVMLError_NotSupported = NVMLError_NotSupported
    NVMLError_NotFound = NVMLError_NotFound
    NVMLError_GpuIsLost = NVMLError_GpuIsLost
    NVMLError_LibraryNotFound = NVMLError_LibraryNotFound
    NVMLError_DriverNotLoaded = NVMLError_DriverNotLoaded
    NVMLError_FunctionNotFound = NVMLError_FunctionNotFound
    NVMLError_Uninitialized = NVMLError_Uninitialized
    NVML_DEVICE_MIG_ENABLE = NVML_DEVICE_MIG_ENABLE
    NVML_DEVICE_MIG_DISABLE = NVML_DEVICE_MIG_DISABLE
    NVML_TEMPERATURE_GPU = NVML_TEMPERATURE_GPU
    NVMLError_Timeout = NVMLError_Timeout
    NVML_SUCCESS = NVML_SUCCESS
    NVML_GPM_METRICS_GET_VERSION = NVML_GPM_METRICS_GET_VERSION
    c_nvmlGpmMetricsGet_t = c_nvmlGpmMetricsGet_t
    nvmlMemory_v2 = nvmlMemory_v2

    # MIG slots per GPU (nvmlDeviceGetMaxMigDeviceCount on A100/H100 is 7)
    MAX_MIG_DEVICES = 7

    def __init__(self, gpus: list[FakeGpu] | None = None, driver: str = "ok", record_calls: bool = True):
        self.gpus = gpus or []
        self.driver = driver  # "ok" | "missing" (no libnvidia-ml.so.1) | "not_loaded" (no kernel module)
        self.initialized = 0  # nvmlInit minus nvmlShutdown calls
        self.init_calls = 0
        self.calls: list[str] = []
        self.record_calls = record_calls  # off for benchmarks: the list would grow without bound
        self.event_sets: list[_EventSet] = []
        self.gpm_samples: list[_GpmSample] = []
        self._gpm_seq = 0
        self._not_supported: set[tuple[str, int | None]] = set()
        self._removed: set[str] = set()
        for i, g in enumerate(self.gpus):
            g.uuid = g.uuid or f"GPU-{uuidlib.uuid5(uuidlib.NAMESPACE_OID, f'fake-gpu-{i}')}"
            g.pci_bus_id = g.pci_bus_id or f"00000000:{0x07 + 8 * i:02X}:00.0"

    # -- fault injection -----------------------------------------------------------------------------------
    def lose_gpu(self, index: int) -> None:
        self.gpus[index].lost = True

    def not_supported(self, fn: str, index: int | None = None) -> None:
        """Make `fn` answer NotSupported (for GPU `index`, or every GPU)."""
        self._not_supported.add((fn, index))

    def queue_xid(self, index: int, xid: int, gpu_instance_id: int | None = None,
                  compute_instance_id: int | None = None) -> None:
        """The driver reports XID `xid` on GPU `index` (attributed to a GPU instance if given): every event set
        registered for XID events on that GPU receives it."""
        gi = NO_GPU_INSTANCE if gpu_instance_id is None else gpu_instance_id
        ci = NO_GPU_INSTANCE if compute_instance_id is None else compute_instance_id
        for es in self.event_sets:
            if index in es.gpus and not es.freed:
                self.gpus[index].events.append(SimpleNamespace(
                    set=es, device=_Handle(index), eventType=nvmlEventTypeXidCriticalError, eventData=xid,
                    gpuInstanceId=gi, computeInstanceId=ci))

    def remove_function(self, fn: str) -> None:
        """The driver library lacks `fn`: it answers FunctionNotFound (an older driver than the bindings)."""
        self._removed.add(fn)

    # -- plumbing ----------------------------------------------------------------------------------------------
    def __getattribute__(self, name: str) -> Any:
        attr = object.__getattribute__(self, name)
        if name.startswith("nvml") and callable(attr):
            removed = object.__getattribute__(self, "_removed")
            calls = object.__getattribute__(self, "calls")

            record = object.__getattribute__(self, "record_calls")

            def call(*args: Any) -> Any:
                if record:
                    calls.append(name)
                if name in removed:
                    raise NVMLError_FunctionNotFound()
                return attr(*args)

            return call
        return attr

    def _check(self, fn: str, handle: Any = None) -> FakeGpu | None:
        if self.initialized <= 0:
            raise NVMLError_Uninitialized()
        if handle is None:
            return None
        gpu_index = handle.gpu
        gpu = self.gpus[gpu_index]
        if gpu.lost:
            raise NVMLError_GpuIsLost()
        if (fn, gpu_index) in self._not_supported or (fn, None) in self._not_supported:
            raise NVMLError_NotSupported()
        return gpu

    def _mig(self, handle: _Handle) -> FakeMig:
        gpu = self.gpus[handle.gpu]
        assert gpu.mig is not None and handle.mig is not None
        return gpu.mig[handle.mig]

    def _mig_uuid(self, handle: _Handle) -> str:
        m = self._mig(handle)
        return f"MIG-{uuidlib.uuid5(uuidlib.NAMESPACE_OID, f'{self.gpus[handle.gpu].uuid}/{m.gpu_instance_id}')}"

    # -- library -------------------------------------------------------------------------------------------------
    def nvmlInit(self) -> None:
        self.init_calls += 1
        if self.driver == "missing":
            raise NVMLError_LibraryNotFound()
        if self.driver == "not_loaded":
            raise NVMLError_DriverNotLoaded()
        self.initialized += 1

    def nvmlShutdown(self) -> None:
        if self.initialized <= 0:
            raise NVMLError_Uninitialized()
        self.initialized -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        self._check("nvmlSystemGetDriverVersion")
        return "550.127.05"

    # -- devices -------------------------------------------------------------------------------------------------
    def nvmlDeviceGetCount(self) -> int:
        self._check("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        self._check("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.gpus):
            raise NVMLError_InvalidArgument()
        if self.gpus[index].lost:
            raise NVMLError_GpuIsLost()
        return _Handle(index)

    def nvmlDeviceGetName(self, handle: _Handle) -> str:
        gpu = self._check("nvmlDeviceGetName", handle)
        assert gpu is not None
        if handle.mig is not None:
            m = self._mig(handle)
            gi_slices = m.profile.split("g.")[0]
            ci = self._ci_slices(handle)
            prefix = f"{ci}c." if ci != int(gi_slices) else ""
            return f"{gpu.model.nvml_name} MIG {prefix}{m.profile}"
        return gpu.model.nvml_name

    def _ci_slices(self, handle: _Handle) -> int:
        return int(self._mig(handle).profile.split("g.")[0])

    def nvmlDeviceGetUUID(self, handle: _Handle) -> str:
        gpu = self._check("nvmlDeviceGetUUID", handle)
        assert gpu is not None
        return self._mig_uuid(handle) if handle.mig is not None else gpu.uuid

    def nvmlDeviceGetPciInfo(self, handle: _Handle) -> SimpleNamespace:
        gpu = self._check("nvmlDeviceGetPciInfo", handle)
        assert gpu is not None
        return SimpleNamespace(busId=gpu.pci_bus_id.encode())  # pynvml gives the c_char array as bytes

    def nvmlDeviceGetMemoryInfo(self, handle: _Handle, version: Any = None) -> SimpleNamespace:
        """pynvml's signature: without `version` the v1 struct, whose `used` includes the memory the driver
        reserves (as real drivers report it); with version=nvmlMemory_v2 (nvmlDeviceGetMemoryInfo_v2) the v2
        struct, with `reserved` apart: what nvidia-smi shows as Used."""
        gpu = self._check("nvmlDeviceGetMemoryInfo", handle)
        assert gpu is not None
        if handle.mig is not None:
            m = self._mig(handle)
            total = gpu.model.profile(m.profile).memory_bytes
            used, reserved = m.memory_used_bytes, 0
        else:
            total = gpu.model.memory_bytes
            used = gpu.memory_used_bytes if gpu.mig is None else sum(m.memory_used_bytes for m in gpu.mig)
            reserved = gpu.memory_reserved_bytes
        if version is None:
            return SimpleNamespace(total=total, used=used + reserved, free=total - used - reserved)
        if "nvmlDeviceGetMemoryInfo_v2" in self._removed:
            raise NVMLError_FunctionNotFound()  # a driver older than the v2 struct
        if version != nvmlMemory_v2:
            raise NVMLError(NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        return SimpleNamespace(version=version, total=total, reserved=reserved, used=used,
                               free=total - used - reserved)

    def nvmlDeviceGetUtilizationRates(self, handle: _Handle) -> SimpleNamespace:
        gpu = self._check("nvmlDeviceGetUtilizationRates", handle)
        assert gpu is not None
        if gpu.mig is not None:  # nvidia-smi shows GPU-Util N/A with MIG on; MIG devices have none either
            raise NVMLError_NotSupported()
        return SimpleNamespace(gpu=gpu.utilization_percent, memory=gpu.memory_utilization_percent)

    def _whole_gpu(self, fn: str, handle: _Handle) -> FakeGpu:
        """Checks for calls that only a physical GPU answers (a MIG device handle gets NotSupported)."""
        gpu = self._check(fn, handle)
        assert gpu is not None
        if handle.mig is not None:
            raise NVMLError_NotSupported()
        return gpu

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: _Handle) -> int:
        return self._whole_gpu("nvmlDeviceGetTotalEnergyConsumption", handle).energy_mj

    def nvmlDeviceGetClockInfo(self, handle: _Handle, clock_type: int) -> int:
        gpu = self._whole_gpu("nvmlDeviceGetClockInfo", handle)
        if clock_type in (NVML_CLOCK_GRAPHICS, NVML_CLOCK_SM):
            return gpu.sm_clock_mhz
        if clock_type == NVML_CLOCK_MEM:
            return gpu.memory_clock_mhz
        raise NVMLError_InvalidArgument()

    def nvmlDeviceGetTotalEccErrors(self, handle: _Handle, error_type: int, counter_type: int) -> int:
        gpu = self._whole_gpu("nvmlDeviceGetTotalEccErrors", handle)
        if gpu.ecc is None:
            raise NVMLError_NotSupported()  # ECC mode off
        if error_type not in (0, 1) or counter_type not in (0, 1):
            raise NVMLError_InvalidArgument()
        return gpu.ecc.get((error_type, counter_type), 0)

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: _Handle) -> int:
        return self._whole_gpu("nvmlDeviceGetCurrentClocksEventReasons", handle).clock_event_reasons

    def nvmlDeviceGetSupportedClocksEventReasons(self, handle: _Handle) -> int:
        return self._whole_gpu("nvmlDeviceGetSupportedClocksEventReasons", handle).supported_clock_event_reasons

    def nvmlDeviceGetPcieThroughput(self, handle: _Handle, counter: int) -> int:
        gpu = self._whole_gpu("nvmlDeviceGetPcieThroughput", handle)
        if counter == NVML_PCIE_UTIL_TX_BYTES:
            return gpu.pcie_tx_kb_per_s
        if counter == NVML_PCIE_UTIL_RX_BYTES:
            return gpu.pcie_rx_kb_per_s
        raise NVMLError_InvalidArgument()

    # -- events ------------------------------------------------------------------------------------------------
    def nvmlEventSetCreate(self) -> _EventSet:
        self._check("nvmlEventSetCreate")
        es = _EventSet()
        self.event_sets.append(es)
        return es

    def nvmlDeviceRegisterEvents(self, handle: _Handle, event_types: int, event_set: _EventSet) -> None:
        self._whole_gpu("nvmlDeviceRegisterEvents", handle)
        if event_types & ~nvmlEventTypeXidCriticalError:
            raise NVMLError_NotSupported()  # only XID events are modelled
        event_set.gpus.append(handle.gpu)

    def nvmlEventSetWait_v2(self, event_set: _EventSet, timeout_ms: int) -> SimpleNamespace:
        self._check("nvmlEventSetWait_v2")
        if event_set.freed:
            raise NVMLError_InvalidArgument()
        for index in event_set.gpus:
            self._check("nvmlEventSetWait_v2", _Handle(index))  # a lost GPU answers GpuIsLost
            events = self.gpus[index].events
            for k, ev in enumerate(events):
                if ev.set is event_set:
                    return events.pop(k)
        raise NVMLError_Timeout()  # nothing pending; the fake never waits, whatever the timeout

    def nvmlEventSetFree(self, event_set: _EventSet) -> None:
        self._check("nvmlEventSetFree")
        event_set.freed = True

    # -- GPM -----------------------------------------------------------------------------------------------------
    def nvmlGpmQueryDeviceSupport(self, handle: _Handle) -> SimpleNamespace:
        gpu = self._whole_gpu("nvmlGpmQueryDeviceSupport", handle)
        return SimpleNamespace(version=1, isSupportedDevice=int(gpu.model.nvml_name in GPM_MODELS))

    def nvmlGpmSampleAlloc(self) -> _GpmSample:
        self._check("nvmlGpmSampleAlloc")
        sample = _GpmSample()
        self.gpm_samples.append(sample)
        return sample

    def nvmlGpmSampleFree(self, sample: _GpmSample) -> None:
        self._check("nvmlGpmSampleFree")
        sample.freed = True

    def _fill(self, sample: _GpmSample, source: tuple[int, int | None], values: dict[int, float]) -> _GpmSample:
        if sample.freed:
            raise NVMLError_InvalidArgument()
        self._gpm_seq += 1
        sample.source, sample.seq, sample.values = source, self._gpm_seq, values
        return sample

    def nvmlGpmSampleGet(self, handle: _Handle, sample: _GpmSample) -> _GpmSample:
        gpu = self._whole_gpu("nvmlGpmSampleGet", handle)
        if gpu.model.nvml_name not in GPM_MODELS:
            raise NVMLError_NotSupported()
        return self._fill(sample, (handle.gpu, None), {
            NVML_GPM_METRIC_GRAPHICS_UTIL: gpu.gpm_graphics_percent, NVML_GPM_METRIC_SM_UTIL: gpu.gpm_sm_percent,
            NVML_GPM_METRIC_PCIE_TX_PER_SEC: gpu.gpm_pcie_tx_mib_per_s,
            NVML_GPM_METRIC_PCIE_RX_PER_SEC: gpu.gpm_pcie_rx_mib_per_s})

    def nvmlGpmMigSampleGet(self, handle: _Handle, gpu_instance_id: int, sample: _GpmSample) -> _GpmSample:
        gpu = self._whole_gpu("nvmlGpmMigSampleGet", handle)  # takes the parent GPU's handle
        if gpu.model.nvml_name not in GPM_MODELS:
            raise NVMLError_NotSupported()
        mig = next((m for m in gpu.mig or [] if m.gpu_instance_id == gpu_instance_id), None)
        if mig is None:
            raise NVMLError_NotFound()
        # PCIe is a whole-GPU quantity: a GPU instance sample has none (NotSupported per metric)
        return self._fill(sample, (handle.gpu, gpu_instance_id), {
            NVML_GPM_METRIC_GRAPHICS_UTIL: mig.gpm_graphics_percent, NVML_GPM_METRIC_SM_UTIL: mig.gpm_sm_percent})

    def nvmlGpmMetricsGet(self, request: c_nvmlGpmMetricsGet_t) -> c_nvmlGpmMetricsGet_t:
        self._check("nvmlGpmMetricsGet")
        s1, s2 = request.sample1, request.sample2
        if (request.version != NVML_GPM_METRICS_GET_VERSION or s1 is None or s2 is None or s1.source is None
                or s1.source != s2.source or s1.seq >= s2.seq):
            raise NVMLError_InvalidArgument()  # two samples of the same thing, in order
        self._check("nvmlGpmMetricsGet", _Handle(s2.source[0]))
        for m in request.metrics[: request.numMetrics]:
            # the activity the device had between the two samples: what was set when the second one was taken
            if m.metricId in s2.values:
                m.value, m.nvmlReturn = s2.values[m.metricId], NVML_SUCCESS
            else:
                m.value, m.nvmlReturn = 0.0, NVML_ERROR_NOT_SUPPORTED
        return request

    def nvmlDeviceGetPowerUsage(self, handle: _Handle) -> int:
        gpu = self._check("nvmlDeviceGetPowerUsage", handle)
        assert gpu is not None
        if handle.mig is not None:
            raise NVMLError_NotSupported()
        return gpu.power_mw

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: _Handle) -> int:
        gpu = self._check("nvmlDeviceGetEnforcedPowerLimit", handle)
        assert gpu is not None
        if handle.mig is not None:
            raise NVMLError_NotSupported()
        return int(POWER_LIMIT_W.get(gpu.model.nvml_name, DEFAULT_POWER_LIMIT_W) * 1000)

    def nvmlDeviceGetTemperature(self, handle: _Handle, sensor: int) -> int:
        gpu = self._check("nvmlDeviceGetTemperature", handle)
        assert gpu is not None
        if handle.mig is not None:
            raise NVMLError_NotSupported()
        return gpu.temperature_c

    # -- MIG -------------------------------------------------------------------------------------------------
    def nvmlDeviceGetMigMode(self, handle: _Handle) -> list[int]:
        gpu = self._check("nvmlDeviceGetMigMode", handle)
        assert gpu is not None
        if not gpu.model.profiles:
            raise NVMLError_NotSupported()
        mode = NVML_DEVICE_MIG_ENABLE if gpu.mig is not None else NVML_DEVICE_MIG_DISABLE
        return [mode, mode]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: _Handle) -> int:
        gpu = self._check("nvmlDeviceGetMaxMigDeviceCount", handle)
        assert gpu is not None
        return self.MAX_MIG_DEVICES if gpu.model.profiles else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: _Handle, index: int) -> _Handle:
        gpu = self._check("nvmlDeviceGetMigDeviceHandleByIndex", handle)
        assert gpu is not None
        if gpu.mig is None:
            raise NVMLError_InvalidArgument()
        if not 0 <= index < len(gpu.mig):
            raise NVMLError_NotFound()
        return _Handle(handle.gpu, index)

    def nvmlDeviceIsMigDeviceHandle(self, handle: _Handle) -> int:
        self._check("nvmlDeviceIsMigDeviceHandle", handle)
        return int(handle.mig is not None)

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, handle: _Handle) -> _Handle:
        self._check("nvmlDeviceGetDeviceHandleFromMigDeviceHandle", handle)
        if handle.mig is None:
            raise NVMLError_InvalidArgument()
        return _Handle(handle.gpu)

    def nvmlDeviceGetGpuInstanceId(self, handle: _Handle) -> int:
        self._check("nvmlDeviceGetGpuInstanceId", handle)
        if handle.mig is None:
            raise NVMLError_InvalidArgument()
        return self._mig(handle).gpu_instance_id

    def nvmlDeviceGetComputeInstanceId(self, handle: _Handle) -> int:
        self._check("nvmlDeviceGetComputeInstanceId", handle)
        if handle.mig is None:
            raise NVMLError_InvalidArgument()
        return self._mig(handle).compute_instance_id

    def nvmlDeviceGetGpuInstanceById(self, handle: _Handle, gpu_instance_id: int) -> _GpuInstanceHandle:
        gpu = self._check("nvmlDeviceGetGpuInstanceById", handle)
        assert gpu is not None
        if gpu.mig is None or all(m.gpu_instance_id != gpu_instance_id for m in gpu.mig):
            raise NVMLError_NotFound()
        return _GpuInstanceHandle(handle.gpu, gpu_instance_id)

    def nvmlGpuInstanceGetInfo(self, gi: _GpuInstanceHandle) -> SimpleNamespace:
        gpu = self._check("nvmlGpuInstanceGetInfo", _Handle(gi.gpu))
        assert gpu is not None and gpu.mig is not None
        m = next(m for m in gpu.mig if m.gpu_instance_id == gi.gpu_instance_id)
        spec = gpu.model.profile(m.profile)
        return SimpleNamespace(device=_Handle(gi.gpu), id=gi.gpu_instance_id, profileId=spec.profile_id,
                               placement=SimpleNamespace(start=m.start, size=spec.memory_slices))

    def _profile_info(self, gpu: FakeGpu, spec: Any) -> SimpleNamespace:
        return SimpleNamespace(id=spec.profile_id, isP2pSupported=0, sliceCount=spec.compute_slices,
                               instanceCount=spec.max_count, memorySizeMB=spec.memory_mib,
                               name=f"MIG {spec.name}")

    def nvmlDeviceGetGpuInstanceProfileInfo(self, handle: _Handle, profile: int, version: int = 2) -> SimpleNamespace:
        gpu = self._check("nvmlDeviceGetGpuInstanceProfileInfo", handle)
        assert gpu is not None
        for spec in gpu.model.profiles:
            if nvml_profile_index(gpu.model, spec) == profile:
                return self._profile_info(gpu, spec)
        raise NVMLError_NotSupported()

    def nvmlDeviceGetGpuInstanceProfileInfoById(self, handle: _Handle, profile_id: int) -> SimpleNamespace:
        gpu = self._check("nvmlDeviceGetGpuInstanceProfileInfoById", handle)
        assert gpu is not None
        for spec in gpu.model.profiles:
            if spec.profile_id == profile_id:
                return self._profile_info(gpu, spec)
        raise NVMLError_NotSupported()


# -- ready-made machines ----------------------------------------------------------------------------------------
def dgx_a100_2gpu_mig(**kw: Any) -> FakeNvml:
    """2x A100-SXM4-80GB; gpu1 in MIG mode: 3g.40gb + 2g.20gb + 2x 1g.10gb (same as the default node file)."""
    return FakeNvml([
        FakeGpu(A100_SXM4_80GB, memory_used_bytes=1 << 30, utilization_percent=37, power_mw=123_456,
                temperature_c=41, memory_utilization_percent=12, energy_mj=5_000_250, sm_clock_mhz=1410,
                memory_clock_mhz=1593, ecc={(0, 0): 3, (1, 0): 0, (0, 1): 17, (1, 1): 1},
                clock_event_reasons=0x4 | 0x40, pcie_tx_kb_per_s=2_000, pcie_rx_kb_per_s=500_000),
        FakeGpu(A100_SXM4_80GB, mig=mig_layout(A100_SXM4_80GB, ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"]),
                power_mw=88_000, temperature_c=35),
    ], **kw)


def a100_40gb_and_h100(**kw: Any) -> FakeNvml:
    """A100-SXM4-40GB (MIG 4g.20gb + 2g.10gb + 1g.5gb) and an H100 80GB HBM3 with MIG off."""
    return FakeNvml([
        FakeGpu(A100_SXM4_40GB, mig=mig_layout(A100_SXM4_40GB, ["4g.20gb", "2g.10gb", "1g.5gb"])),
        FakeGpu(H100_SXM5_80GB, utilization_percent=100, power_mw=699_000, temperature_c=70,
                gpm_graphics_percent=97.0, gpm_sm_percent=81.5, gpm_pcie_tx_mib_per_s=3.0,
                gpm_pcie_rx_mib_per_s=250.0),
    ], **kw)


def hgx_h100_mig(gpus: int = 2, profiles: tuple[str, ...] = ("3g.40gb", "2g.20gb", "1g.10gb"),
                 **kw: Any) -> FakeNvml:
    """`gpus` x H100 80GB HBM3, each in MIG mode with `profiles` (GPM available: Hopper). GPM reports 60 %
    graphics activity and 40 % SM activity for every GPU and GPU instance."""
    machines = []
    for i in range(gpus):
        migs = mig_layout(H100_SXM5_80GB, list(profiles))
        for m in migs:
            m.gpm_graphics_percent, m.gpm_sm_percent = 60.0, 40.0
        machines.append(FakeGpu(H100_SXM5_80GB, mig=migs, power_mw=350_000, temperature_c=50,
                                energy_mj=1_000_000 * (i + 1), gpm_graphics_percent=60.0, gpm_sm_percent=40.0))
    return FakeNvml(machines, **kw)
