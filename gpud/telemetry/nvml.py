"""The NVML backend. Every NVML call goes through one choke point, `NvmlSession.query` (module-level
`nvml_query` for the default session), the way nvitop's `libnvml.nvmlQuery` does:

- lazy `nvmlInit` on the first query, `nvmlShutdown` at interpreter exit (or `close()`);
- NotSupported / NotFound -> the `default` (the `NA` sentinel unless told otherwise): a MIG device has no
  utilization or power reading, and that must never crash a scrape;
- FunctionNotFound (old driver, or a pynvml without the function) -> default, logged once per function;
- GpuIsLost -> default, and the device is remembered as lost: its readings say healthy=False from then on;
- anything else -> default, logged once per (function, error). Nothing raises out of `query`.

`pynvml` is imported lazily so a CPU-only install works without nvidia-ml-py. The module is injectable
(`NvmlBackend(nvml=fake)`), which is how tests drive this file without a GPU.
"""
from __future__ import annotations

import atexit
import logging
import math
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from gpud.telemetry.devices import (
    CPU_DEVICE_ID,
    MIG_COMPUTE_SLICES,
    WATCHED_XIDS,
    DeviceInfo,
    DeviceReading,
    NoUsage,
    UsageSource,
    cpu_device,
    gpu_device_id,
    leaf_devices,
    mig_device_id,
)

log = logging.getLogger(__name__)

# nvmlReturn_t values (nvml.h). Errors are matched by code, not by class, so a fake module only needs an
# exception with a `.value` (pynvml's NVMLError subclasses all carry one).
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10  # nvmlEventSetWait: no event ready within the timeout
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18

NVML_DEVICE_MIG_ENABLE = 1
NVML_TEMPERATURE_GPU = 0
NVML_SUCCESS = 0

# nvmlClockType_t (values in MHz)
NVML_CLOCK_SM = 1
NVML_CLOCK_MEM = 2
# nvmlMemoryErrorType_t / nvmlEccCounterType_t (nvmlDeviceGetTotalEccErrors)
NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0  # reset when the driver loads
NVML_AGGREGATE_ECC = 1  # for the life of the board
ECC_COUNTERS = (  # (error_type, counter_type) names as exported, and their NVML arguments
    (("corrected", "volatile"), NVML_MEMORY_ERROR_TYPE_CORRECTED, NVML_VOLATILE_ECC),
    (("uncorrected", "volatile"), NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC),
    (("corrected", "aggregate"), NVML_MEMORY_ERROR_TYPE_CORRECTED, NVML_AGGREGATE_ECC),
    (("uncorrected", "aggregate"), NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_AGGREGATE_ECC),
)
# nvmlPcieUtilCounter_t: nvmlDeviceGetPcieThroughput answers KB/s, measured over a 20 ms window inside the call
NVML_PCIE_UTIL_TX_BYTES = 0
NVML_PCIE_UTIL_RX_BYTES = 1
PCIE_KB_BYTES = 1024  # NVML says "KB" at "1KB granularity"; read as KiB like nvidia-smi's KB/s
# Events
NVML_EVENT_TYPE_XID_CRITICAL_ERROR = 0x8  # nvmlEventTypeXidCriticalError
MAX_EVENTS_PER_DRAIN = 64  # bounds one scrape's work; the rest is read at the next one
# GPM (Hopper or newer): metric ids from nvml.h nvmlGpmMetricId_t
NVML_GPM_METRIC_GRAPHICS_UTIL = 1  # percent of time any compute/graphics work was active
NVML_GPM_METRIC_SM_UTIL = 2  # percent of SMs busy
NVML_GPM_METRIC_PCIE_TX_PER_SEC = 20  # MiB/s from the GPU
NVML_GPM_METRIC_PCIE_RX_PER_SEC = 21  # MiB/s to the GPU
GPM_METRICS = (NVML_GPM_METRIC_GRAPHICS_UTIL, NVML_GPM_METRIC_SM_UTIL, NVML_GPM_METRIC_PCIE_TX_PER_SEC,
               NVML_GPM_METRIC_PCIE_RX_PER_SEC)
# NVML computes GPM metrics from two samples; closer than its internal refresh the difference is noise, so a
# second scrape within this interval reuses the previous values instead of taking a new sample.
GPM_MIN_INTERVAL_S = 0.1

# nvmlClocksEventReason* bits (formerly nvmlClocksThrottleReason*, same values) -> exported `reason` label
CLOCK_EVENT_REASONS = (
    (0x1, "gpu_idle"),
    (0x2, "applications_clocks_setting"),
    (0x4, "sw_power_cap"),
    (0x8, "hw_slowdown"),
    (0x10, "sync_boost"),
    (0x20, "sw_thermal_slowdown"),
    (0x40, "hw_thermal_slowdown"),
    (0x80, "hw_power_brake_slowdown"),
    (0x100, "display_clock_setting"),
)

# Errors at nvmlInit that mean "this machine has no usable NVIDIA driver": discovery falls back to simulation.
_NO_DRIVER_REASONS = {
    NVML_ERROR_LIBRARY_NOT_FOUND: "the NVML library (libnvidia-ml.so.1) was not found: no NVIDIA driver installed",
    NVML_ERROR_DRIVER_NOT_LOADED: "the NVIDIA kernel driver is not loaded",
    NVML_ERROR_LIB_RM_VERSION_MISMATCH: "the NVML library and the loaded kernel driver versions differ "
    "(driver upgraded without reboot or module reload)",
    NVML_ERROR_NO_PERMISSION: "no permission to open the NVIDIA device files",
}


class NaType:
    """The "not available" sentinel: prints N/A, is falsy, and acts as NaN in arithmetic (nvitop's NA)."""

    _instance: NaType | None = None

    def __new__(cls) -> NaType:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "N/A"

    __str__ = __repr__

    def __bool__(self) -> bool:
        return False

    def __float__(self) -> float:
        return float("nan")

    def __reduce__(self) -> str:
        return "NA"


NA = NaType()


def _error_code(exc: BaseException) -> int | None:
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


class NvmlSession:
    """One NVML library state: the module, whether it is initialized, what was already logged, what is lost."""

    def __init__(self, nvml: Any = None, logger: logging.Logger | None = None):
        self._nvml = nvml
        self._log = logger or log
        self._lock = threading.RLock()
        self._initialized = False
        self._init_error: str | None = None
        self._logged: set[tuple[str, int | None]] = set()
        self.lost_device_ids: set[str] = set()

    # -- lifecycle -------------------------------------------------------------------------------------------
    @property
    def module(self) -> Any:
        return self._nvml

    def init(self) -> str | None:
        """Initialize once. Returns None when NVML is usable, else a sentence saying why not."""
        with self._lock:
            if self._initialized:
                return None
            if self._init_error is not None:
                return self._init_error
            if self._nvml is None:
                try:
                    import pynvml  # lazy: the CPU install has no nvidia-ml-py
                except ImportError:
                    self._init_error = "the Python NVML bindings (nvidia-ml-py, module pynvml) are not installed"
                    return self._init_error
                self._nvml = pynvml
            try:
                self._nvml.nvmlInit()
            except Exception as exc:  # noqa: BLE001 - any failure to init means "no NVML", reported as a reason
                code = _error_code(exc)
                reason = _NO_DRIVER_REASONS.get(code) if code is not None else None
                self._init_error = reason or f"nvmlInit failed: {exc!r}"
                return self._init_error
            self._initialized = True
            atexit.register(self.shutdown)
            return None

    def shutdown(self) -> None:
        with self._lock:
            if not self._initialized:
                return
            self._initialized = False
            atexit.unregister(self.shutdown)
            try:
                self._nvml.nvmlShutdown()
            except Exception as exc:  # noqa: BLE001 - shutting down must not fail the caller
                self._log.debug("nvmlShutdown failed: %r", exc)

    # -- the choke point ---------------------------------------------------------------------------------------
    def query(self, fn: str | Callable[..., Any], *args: Any, default: Any = NA, device_id: str | None = None) -> Any:
        """Call an NVML function by name (or a callable) and map every failure to `default`. Never raises.
        `device_id` names the gpud device the call is about, so a GpuIsLost can mark it."""
        if self.init() is not None:
            return default
        name = fn if isinstance(fn, str) else getattr(fn, "__name__", repr(fn))
        try:
            func = getattr(self._nvml, fn) if isinstance(fn, str) else fn
        except AttributeError:
            self._log_once(name, NVML_ERROR_FUNCTION_NOT_FOUND, "NVML function %s not found in the bindings: its "
                           "readings are N/A", name)
            return default
        try:
            return func(*args)
        except Exception as exc:  # noqa: BLE001 - the contract is "never raises"; mapped below
            code = _error_code(exc)
            if code in (NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_NOT_FOUND, NVML_ERROR_TIMEOUT):
                # expected: MIG devices lack most sensors, empty MIG slots are NotFound, an empty event set
                # polled with timeout 0 answers Timeout
                return default
            if code == NVML_ERROR_FUNCTION_NOT_FOUND:
                self._log_once(name, code, "NVML function %s not found in the driver library: its readings are "
                               "N/A (driver older than the bindings)", name)
                return default
            if code == NVML_ERROR_GPU_IS_LOST:
                if device_id is not None and device_id not in self.lost_device_ids:
                    self.lost_device_ids.add(device_id)
                    self._log.error("GPU %s is lost (NVML_ERROR_GPU_IS_LOST in %s): marked unhealthy", device_id, name)
                return default
            self._log_once(name, code, "NVML %s failed: %r; reading is N/A", name, exc)
            return default

    def _log_once(self, name: str, code: int | None, msg: str, *args: Any) -> None:
        key = (name, code)
        if key not in self._logged:
            self._logged.add(key)
            self._log.warning(msg, *args)


_default_session = NvmlSession()


def nvml_query(fn: str | Callable[..., Any], *args: Any, default: Any = NA, device_id: str | None = None) -> Any:
    """The choke point over the process-wide session (real pynvml). Never raises."""
    return _default_session.query(fn, *args, default=default, device_id=device_id)


def _text(value: Any) -> str:
    if value is NA or value is None:
        return ""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)


_PROFILE_RE = re.compile(r"(?:(\d+)c\.)?(\d+)g\.(\d+gb(?:\+\w+)?)")


def parse_mig_profile(text: str) -> tuple[str, float] | None:
    """"MIG 3g.40gb" / "NVIDIA A100-SXM4-80GB MIG 1c.3g.40gb" -> ("3g.40gb", compute fraction). A compute
    instance smaller than its GPU instance ("1c.") gets only its own slices."""
    m = _PROFILE_RE.search(text)
    if m is None:
        return None
    ci_slices, gi_slices, mem = m.groups()
    profile = f"{gi_slices}g.{mem}"
    slices = int(ci_slices or gi_slices)
    return profile, slices / MIG_COMPUTE_SLICES


class NvmlBackend:
    """DeviceBackend over NVML. Enumerates once (lazily); `sample` reads the live values each call."""

    def __init__(self, nvml: Any = None, usage: UsageSource | None = None, logger: logging.Logger | None = None,
                 session: NvmlSession | None = None, clock: Callable[[], float] = time.monotonic,
                 pcie_legacy: bool = True):
        """`clock` (seconds, monotonic) times GPM sample intervals. `pcie_legacy=False` skips
        nvmlDeviceGetPcieThroughput on GPUs without GPM: each such call measures a 20 ms window inside the call."""
        self._log = logger or log
        self._session = session or (NvmlSession(nvml, self._log) if nvml is not None else _default_session)
        self._usage = usage or NoUsage()
        self._clock = clock
        self._pcie_legacy = pcie_legacy
        self._devices: list[DeviceInfo] | None = None
        self._handles: dict[str, Any] = {}
        self._by_id: dict[str, DeviceInfo] = {}
        # state kept across scrapes
        self._mig_by_instance: dict[tuple[str, int, int], str] = {}  # (gpu id, GI id, CI id) -> MIG device id
        self._event_sets: dict[str, Any] = {}  # gpu id -> NVML event set, or NA where XID events are unavailable
        self._xid_counts: dict[str, dict[int, int]] = {}  # device id -> XID code -> events seen
        self._gpm_supported: dict[str, bool] = {}  # gpu id -> GPM support (static per GPU)
        self._gpm: dict[str, _GpmTracker] = {}  # device id -> previous GPM sample
        self._supported_reasons: dict[str, Any] = {}  # gpu id -> supported clock event reasons bitmask (static)
        self._memory_v2: bool | None = None  # whether nvmlDeviceGetMemoryInfo_v2 answers (None: not asked yet)
        self._pcie_pool: ThreadPoolExecutor | None = None
        self._lock = threading.RLock()  # one sampling pass at a time: GPM and event state are shared

    @property
    def source(self) -> str:
        return "nvml"

    @property
    def session(self) -> NvmlSession:
        return self._session

    def unavailable_reason(self) -> str | None:
        """None when NVML initializes; else why not (no library, no driver, ...). Used by discovery."""
        return self._session.init()

    def gpu_count(self) -> int:
        return len([d for d in self.devices() if d.kind == "gpu"])

    # -- enumeration -------------------------------------------------------------------------------------------
    def devices(self) -> list[DeviceInfo]:
        if self._devices is None:
            self._devices = self._enumerate()
            self._by_id = {d.id: d for d in self._devices}
        return list(self._devices)

    def leaf_devices(self) -> list[DeviceInfo]:
        return leaf_devices(self.devices())

    def _enumerate(self) -> list[DeviceInfo]:
        q = self._session.query
        out: list[DeviceInfo] = []
        count = q("nvmlDeviceGetCount", default=0) if self._session.init() is None else 0
        for index in range(count):
            gid = gpu_device_id(index)
            handle = q("nvmlDeviceGetHandleByIndex", index, device_id=gid)
            if handle is NA:
                # Lost at enumeration, or a permission problem: still list it (so healthy=0 is exported).
                self._log.warning("GPU %d: no NVML handle; listed as unhealthy", index)
                self._session.lost_device_ids.add(gid)
                out.append(DeviceInfo(id=gid, kind="gpu", index=index, name="", uuid="", pci_bus_id="",
                                      memory_total_bytes=0, labels={"gpu_model": ""}))
                continue
            self._handles[gid] = handle
            name = _text(q("nvmlDeviceGetName", handle, device_id=gid))
            uuid = _text(q("nvmlDeviceGetUUID", handle, device_id=gid))
            pci = q("nvmlDeviceGetPciInfo", handle, device_id=gid)
            pci_bus_id = _text(getattr(pci, "busId", "")) if pci is not NA else ""
            mem = self._memory_info(handle, gid)
            total = int(mem.total) if mem is not NA else 0
            mode = q("nvmlDeviceGetMigMode", handle, device_id=gid)  # [current, pending]; NA on non-MIG GPUs
            mig_on = mode is not NA and int(mode[0]) == NVML_DEVICE_MIG_ENABLE
            out.append(DeviceInfo(id=gid, kind="gpu", index=index, name=name, uuid=uuid, pci_bus_id=pci_bus_id,
                                  memory_total_bytes=total, mig_enabled=mig_on, labels={"gpu_model": name}))
            if mig_on:
                out.extend(self._enumerate_mig(index, gid, handle, name, pci_bus_id))
        out.append(cpu_device())
        return out

    def _enumerate_mig(self, index: int, gid: str, handle: Any, gpu_name: str, pci_bus_id: str) -> list[DeviceInfo]:
        q = self._session.query
        out = []
        max_count = q("nvmlDeviceGetMaxMigDeviceCount", handle, default=0, device_id=gid)
        for mig_index in range(int(max_count)):
            # Slots without a MIG device answer NotFound -> NA: the index space is sparse.
            mh = q("nvmlDeviceGetMigDeviceHandleByIndex", handle, mig_index, device_id=gid)
            if mh is NA:
                continue
            gi = q("nvmlDeviceGetGpuInstanceId", mh, device_id=gid)
            ci = q("nvmlDeviceGetComputeInstanceId", mh, device_id=gid)
            if gi is NA or ci is NA:
                self._log.warning("%s MIG slot %d: no GPU/compute instance id; skipped", gid, mig_index)
                continue
            mid = mig_device_id(gid, int(gi), int(ci))
            uuid = _text(q("nvmlDeviceGetUUID", mh, device_id=gid))
            profile, fraction, profile_bytes = self._mig_profile(handle, mh, int(gi), gid)
            mem = self._memory_info(mh, gid)
            # What the MIG device reports is what a CUDA context there can use; the profile size is the fallback.
            total = int(mem.total) if mem is not NA else (profile_bytes or 0)
            self._handles[mid] = mh
            self._mig_by_instance[(gid, int(gi), int(ci))] = mid
            out.append(DeviceInfo(
                id=mid, kind="mig", index=index, name=gpu_name, uuid=uuid, pci_bus_id=pci_bus_id,
                memory_total_bytes=total, parent_id=gid, mig_profile=profile, gpu_instance_id=int(gi),
                compute_instance_id=int(ci), compute_fraction=fraction,
                labels={"gpu_model": gpu_name, "mig_profile": profile or "", "parent": gid},
            ))
        return out

    def _mig_profile(self, parent: Any, mig: Any, gi: int, gid: str) -> tuple[str | None, float, int | None]:
        """(profile name, compute fraction, profile memory bytes). First from the GPU instance's profile info
        (exact slice count and memorySizeMB), then from the MIG device's name ("... MIG 3g.40gb")."""
        q = self._session.query
        profile: str | None = None
        fraction: float | None = None
        memory_bytes: int | None = None
        gi_handle = q("nvmlDeviceGetGpuInstanceById", parent, gi, device_id=gid)
        gi_info = q("nvmlGpuInstanceGetInfo", gi_handle, device_id=gid) if gi_handle is not NA else NA
        if gi_info is not NA:
            pinfo = q("nvmlDeviceGetGpuInstanceProfileInfoById", parent, gi_info.profileId, device_id=gid)
            if pinfo is not NA:
                parsed = parse_mig_profile(_text(getattr(pinfo, "name", "")))
                profile = parsed[0] if parsed else None
                if getattr(pinfo, "sliceCount", 0):
                    fraction = int(pinfo.sliceCount) / MIG_COMPUTE_SLICES
                if getattr(pinfo, "memorySizeMB", 0):
                    memory_bytes = int(pinfo.memorySizeMB) * 2**20
        # The device name also tells a compute instance smaller than its GPU instance ("1c.3g.40gb").
        parsed = parse_mig_profile(_text(q("nvmlDeviceGetName", mig, device_id=gid)))
        if parsed is not None:
            profile = profile or parsed[0]
            if fraction is None or parsed[1] < fraction:
                fraction = parsed[1]
        return profile, fraction if fraction is not None else 0.0, memory_bytes

    # -- sampling ----------------------------------------------------------------------------------------------
    def _is_lost(self, info: DeviceInfo) -> bool:
        lost = self._session.lost_device_ids
        return info.id in lost or (info.parent_id is not None and info.parent_id in lost)

    def sample(self, device_id: str) -> DeviceReading:
        """One device's reading (what gpud core and inspect use). Reads the device's GPU's pending XID events
        first; skips the legacy PCIe counters (a 20 ms window each): `sample_all` reads those for a scrape."""
        self.devices()
        info = self._by_id[device_id]  # KeyError for an unknown id: a caller bug, not a device state
        with self._lock:
            if info.kind != "cpu":
                self._drain_xid(info.parent_id or info.id)
            return self._read(info, {})

    def sample_all(self) -> dict[str, DeviceReading]:
        """One sampling pass over every device (nvitop's oneshot): the collector calls it once per scrape.
        Legacy PCIe reads (GPUs without GPM) run concurrently while the rest is read, so a scrape waits one
        20 ms window, not two per GPU."""
        devices = self.devices()
        with self._lock:
            pcie = self._start_legacy_pcie(devices)
            for d in devices:
                if d.kind == "gpu":
                    self._drain_xid(d.id)
            return {d.id: self._read(d, pcie) for d in devices}

    def _read(self, info: DeviceInfo, pcie: dict[str, tuple[Future, Future]]) -> DeviceReading:
        reading = self._read_driver(info, pcie)
        if reading.healthy and self._usage.unhealthy_reason(info.id) is not None:  # gpud gave up on it (crash loop)
            reading = replace(reading, healthy=False)
        return reading

    def _read_driver(self, info: DeviceInfo, pcie: dict[str, tuple[Future, Future]]) -> DeviceReading:
        if info.kind == "cpu":
            return DeviceReading(
                utilization_ratio=self._usage.utilization_ratio(CPU_DEVICE_ID),
                memory_used_bytes=self._usage.memory_used_bytes(CPU_DEVICE_ID),
            )
        xids = dict(self._xid_counts.get(info.id, {}))  # counters survive a lost GPU: XID 79 is why it is lost
        if info.kind == "gpu" and self._event_sets.get(info.id, NA) is not NA:
            xids = {xid: 0 for xid in WATCHED_XIDS} | xids  # watched: the known codes read 0 until they happen
        if self._is_lost(info):
            return DeviceReading(healthy=False, xid_errors=xids)
        reading = self._read_mig(info) if info.kind == "mig" else self._read_gpu(info, pcie.get(info.id))
        if self._is_lost(info):
            return DeviceReading(healthy=False, xid_errors=xids)
        return replace(reading, xid_errors=xids)

    def _read_gpu(self, info: DeviceInfo, legacy_pcie: tuple[Future, Future] | None) -> DeviceReading:
        q = self._session.query
        gid = info.id
        h = self._handles[gid]
        mem = self._memory_info(h, gid)
        util = q("nvmlDeviceGetUtilizationRates", h, device_id=gid)  # NotSupported on MIG-on GPUs
        power_mw = q("nvmlDeviceGetPowerUsage", h, device_id=gid)  # milliwatts
        limit_mw = q("nvmlDeviceGetEnforcedPowerLimit", h, device_id=gid)  # milliwatts
        temp = q("nvmlDeviceGetTemperature", h, NVML_TEMPERATURE_GPU, device_id=gid)
        energy_mj = q("nvmlDeviceGetTotalEnergyConsumption", h, device_id=gid)  # millijoules, Volta+
        sm_mhz = q("nvmlDeviceGetClockInfo", h, NVML_CLOCK_SM, device_id=gid)
        mem_mhz = q("nvmlDeviceGetClockInfo", h, NVML_CLOCK_MEM, device_id=gid)
        reasons = q(self._reasons_fn("Current"), h, device_id=gid)
        if gid not in self._supported_reasons:
            self._supported_reasons[gid] = q(self._reasons_fn("Supported"), h, device_id=gid)
        supported = self._supported_reasons[gid]
        # Volatile ECC counts on a GPU (not on MIG handles); NotSupported with ECC off -> omitted.
        ecc = {}
        for key, error_type, counter_type in ECC_COUNTERS:
            n = q("nvmlDeviceGetTotalEccErrors", h, error_type, counter_type, device_id=gid)
            if n is not NA:
                ecc[key] = int(n)
        gpm = self._gpm_read(gid, lambda sample: q("nvmlGpmSampleGet", h, sample, device_id=gid)) \
            if self._gpm_support(gid) else {}
        tx = _mib_per_s(gpm.get(NVML_GPM_METRIC_PCIE_TX_PER_SEC))
        rx = _mib_per_s(gpm.get(NVML_GPM_METRIC_PCIE_RX_PER_SEC))
        if legacy_pcie is not None:
            tx, rx = (_kb_per_s(f.result()) for f in legacy_pcie)
        return DeviceReading(
            utilization_ratio=util.gpu / 100.0 if util is not NA else None,
            memory_used_bytes=int(mem.used) if mem is not NA else None,
            power_w=power_mw / 1000.0 if power_mw is not NA else None,
            power_limit_w=limit_mw / 1000.0 if limit_mw is not NA else None,
            temperature_c=float(temp) if temp is not NA else None,
            memory_utilization_ratio=util.memory / 100.0 if util is not NA else None,
            memory_free_bytes=int(mem.free) if mem is not NA else None,
            energy_joules=energy_mj / 1000.0 if energy_mj is not NA else None,
            sm_clock_hz=sm_mhz * 1e6 if sm_mhz is not NA else None,
            memory_clock_hz=mem_mhz * 1e6 if mem_mhz is not NA else None,
            clock_event_reasons=int(reasons) if reasons is not NA else None,
            clock_event_reasons_supported=int(supported) if supported is not NA else None,
            pcie_tx_bytes_per_second=tx,
            pcie_rx_bytes_per_second=rx,
            gr_engine_active_ratio=_percent(gpm.get(NVML_GPM_METRIC_GRAPHICS_UTIL)),
            sm_active_ratio=_percent(gpm.get(NVML_GPM_METRIC_SM_UTIL)),
            ecc_errors=ecc,
        )

    def _read_mig(self, info: DeviceInfo) -> DeviceReading:
        """A MIG device has memory of its own; power, temperature, clocks, ECC and PCIe belong to its GPU (read
        there, not repeated). Activity comes from GPM per GPU instance where the GPU has GPM (Hopper+); without
        it NVML has no per-instance utilization, and the series is omitted."""
        q = self._session.query
        gid = info.parent_id
        assert gid is not None
        mem = self._memory_info(self._handles[info.id], gid)
        gpm: dict[int, float] = {}
        if self._gpm_support(gid) and info.gpu_instance_id is not None:
            parent, gi = self._handles[gid], info.gpu_instance_id
            gpm = self._gpm_read(info.id, lambda sample: q("nvmlGpmMigSampleGet", parent, gi, sample, device_id=gid))
        active = _percent(gpm.get(NVML_GPM_METRIC_GRAPHICS_UTIL))
        return DeviceReading(
            # GPM graphics activity is the same quantity as nvmlDeviceGetUtilizationRates().gpu on a whole GPU
            # ("time any kernel ran"), so it stands in for the utilization NVML does not give MIG devices.
            utilization_ratio=active,
            memory_used_bytes=int(mem.used) if mem is not NA else None,
            memory_free_bytes=int(mem.free) if mem is not NA else None,
            gr_engine_active_ratio=active,
            sm_active_ratio=_percent(gpm.get(NVML_GPM_METRIC_SM_UTIL)),
        )

    def _memory_info(self, handle: Any, gid: str) -> Any:
        """Memory info as nvidia-smi reports it: the v2 struct, whose `used` leaves out what the driver reserves
        for itself (the v1 struct counts it as used: hundreds of MiB on an idle GPU). v1 where the driver or the
        bindings have no v2; that is remembered, so it is asked once."""
        q = self._session.query
        version = getattr(self._session.module, "nvmlMemory_v2", None)
        if version is not None and self._memory_v2 is not False:
            get = self._session.module.nvmlDeviceGetMemoryInfo

            def nvmlDeviceGetMemoryInfo_v2(h: Any) -> Any:  # named as NVML's function, for the choke point's logs
                return get(h, version)

            mem = q(nvmlDeviceGetMemoryInfo_v2, handle, device_id=gid)
            if mem is not NA:
                self._memory_v2 = True
                return mem
            if gid in self._session.lost_device_ids:
                return NA
            if self._memory_v2 is None:
                self._memory_v2 = False
                self._log.info("NVML: no nvmlDeviceGetMemoryInfo_v2; using nvmlDeviceGetMemoryInfo, whose memory "
                               "used includes the driver's reserved memory (nvidia-smi leaves it out)")
        return q("nvmlDeviceGetMemoryInfo", handle, device_id=gid)

    def _reasons_fn(self, which: str) -> str:
        # NVML 12.x renamed ...ClocksThrottleReasons to ...ClocksEventReasons; old bindings have only the former.
        new = f"nvmlDeviceGet{which}ClocksEventReasons"
        return new if hasattr(self._session.module, new) else f"nvmlDeviceGet{which}ClocksThrottleReasons"

    # -- XID events ----------------------------------------------------------------------------------------------
    def _drain_xid(self, gid: str) -> None:
        """Read what the GPU's event set holds without waiting (timeout 0) and count XIDs per device: a MIG
        instance when NVML attributes the event to one, else the GPU. XIDs before gpud started are not counted."""
        q = self._session.query
        if gid in self._session.lost_device_ids or gid not in self._handles:
            return
        event_set = self._event_sets.get(gid)
        if event_set is None:
            event_set = q("nvmlEventSetCreate", device_id=gid)
            if event_set is not NA and q("nvmlDeviceRegisterEvents", self._handles[gid],
                                         NVML_EVENT_TYPE_XID_CRITICAL_ERROR, event_set, device_id=gid) is NA:
                q("nvmlEventSetFree", event_set)
                event_set = NA  # e.g. NotSupported, or no permission: no XID series for this GPU
            self._event_sets[gid] = event_set
        if event_set is NA:
            return
        wait = "nvmlEventSetWait_v2" if hasattr(self._session.module, "nvmlEventSetWait_v2") else "nvmlEventSetWait"
        for _ in range(MAX_EVENTS_PER_DRAIN):
            data = q(wait, event_set, 0, device_id=gid)  # NA on Timeout: nothing (more) pending
            if data is NA:
                return
            if not int(data.eventType) & NVML_EVENT_TYPE_XID_CRITICAL_ERROR:
                continue
            gi, ci = int(getattr(data, "gpuInstanceId", -1)), int(getattr(data, "computeInstanceId", -1))
            target = self._mig_by_instance.get((gid, gi, ci)) or next(
                (mid for (g, i, _), mid in self._mig_by_instance.items() if g == gid and i == gi), gid)
            counts = self._xid_counts.setdefault(target, {})
            xid = int(data.eventData)
            counts[xid] = counts.get(xid, 0) + 1
            self._log.warning("%s: XID %d", target, xid)

    # -- GPM -------------------------------------------------------------------------------------------------------
    def _gpm_support(self, gid: str) -> bool:
        if gid not in self._gpm_supported:
            support = self._session.query("nvmlGpmQueryDeviceSupport", self._handles[gid], device_id=gid)
            self._gpm_supported[gid] = support is not NA and bool(getattr(support, "isSupportedDevice", 0))
        return self._gpm_supported[gid]

    def _gpm_read(self, key: str, take: Callable[[Any], Any]) -> dict[int, float]:
        """GPM metrics over the interval since this device's previous sample (the previous scrape); {} on the
        first call. `take(sample)` fills a sample buffer (whole GPU or one GPU instance)."""
        q = self._session.query
        tracker = self._gpm.setdefault(key, _GpmTracker())
        now = self._clock()
        if tracker.previous is not None and now - tracker.taken_at < GPM_MIN_INTERVAL_S:
            return tracker.values
        current = tracker.spare if tracker.spare is not None else q("nvmlGpmSampleAlloc")
        if current is NA:
            return {}
        if take(current) is NA:
            tracker.spare = current
            tracker.values = {}
            return {}
        values: dict[int, float] = {}
        if tracker.previous is not None:
            request = self._gpm_request(tracker.previous, current)
            if request is not None and q("nvmlGpmMetricsGet", request) is not NA:
                for i, metric_id in enumerate(GPM_METRICS):
                    m = request.metrics[i]
                    value = float(m.value)
                    if int(getattr(m, "nvmlReturn", NVML_SUCCESS)) == NVML_SUCCESS and math.isfinite(value):
                        values[metric_id] = value
        tracker.spare, tracker.previous, tracker.taken_at, tracker.values = tracker.previous, current, now, values
        return values

    def _gpm_request(self, sample1: Any, sample2: Any) -> Any:
        nvml = self._session.module
        struct = getattr(nvml, "c_nvmlGpmMetricsGet_t", None)
        if struct is None:
            return None  # bindings older than GPM
        request = struct()
        request.version = getattr(nvml, "NVML_GPM_METRICS_GET_VERSION", 1)
        request.numMetrics = len(GPM_METRICS)
        request.sample1 = sample1
        request.sample2 = sample2
        for i, metric_id in enumerate(GPM_METRICS):
            request.metrics[i].metricId = metric_id
        return request

    # -- legacy PCIe -------------------------------------------------------------------------------------------------
    def _start_legacy_pcie(self, devices: list[DeviceInfo]) -> dict[str, tuple[Future, Future]]:
        """Submit nvmlDeviceGetPcieThroughput (TX and RX) for GPUs without GPM; NVML is thread-safe."""
        if not self._pcie_legacy:
            return {}
        gpus = [d.id for d in devices if d.kind == "gpu" and d.id in self._handles
                and not self._is_lost(d) and not self._gpm_support(d.id)]
        if not gpus:
            return {}
        if self._pcie_pool is None:
            self._pcie_pool = ThreadPoolExecutor(max_workers=min(32, 2 * len(gpus)),
                                                 thread_name_prefix="gpud-nvml-pcie")
        q, pool = self._session.query, self._pcie_pool
        return {gid: (pool.submit(q, "nvmlDeviceGetPcieThroughput", self._handles[gid], NVML_PCIE_UTIL_TX_BYTES,
                                  device_id=gid),
                      pool.submit(q, "nvmlDeviceGetPcieThroughput", self._handles[gid], NVML_PCIE_UTIL_RX_BYTES,
                                  device_id=gid))
                for gid in gpus}

    def close(self) -> None:
        q = self._session.query
        with self._lock:
            if self._pcie_pool is not None:
                self._pcie_pool.shutdown(wait=True)
                self._pcie_pool = None
            for tracker in self._gpm.values():
                for sample in (tracker.previous, tracker.spare):
                    if sample is not None:
                        q("nvmlGpmSampleFree", sample)
            self._gpm.clear()
            for event_set in self._event_sets.values():
                if event_set is not NA:
                    q("nvmlEventSetFree", event_set)
            self._event_sets.clear()
            self._handles.clear()
        if self._session is not _default_session:
            self._session.shutdown()


@dataclass
class _GpmTracker:
    """The two GPM sample buffers of one device (whole GPU or GPU instance), reused scrape after scrape."""

    previous: Any = None  # sample taken at `taken_at`
    spare: Any = None  # buffer the next sample goes into
    taken_at: float = 0.0
    values: dict[int, float] = field(default_factory=dict)  # metric id -> value over the last interval


def _percent(value: float | None) -> float | None:
    return value / 100.0 if value is not None else None


def _mib_per_s(value: float | None) -> float | None:
    return value * 2**20 if value is not None else None


def _kb_per_s(value: Any) -> float | None:
    return float(value) * PCIE_KB_BYTES if value is not NA else None
