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
import re
import threading
from collections.abc import Callable
from typing import Any

from telemetry.devices import (
    CPU_DEVICE_ID,
    MIG_COMPUTE_SLICES,
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
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18

NVML_DEVICE_MIG_ENABLE = 1
NVML_TEMPERATURE_GPU = 0

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
                self._init_error = _NO_DRIVER_REASONS.get(code) or f"nvmlInit failed: {exc!r}"
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
            if code in (NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_NOT_FOUND):
                return default  # expected: MIG devices lack most sensors, empty MIG slots are NotFound
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
                 session: NvmlSession | None = None):
        self._log = logger or log
        self._session = session or (NvmlSession(nvml, self._log) if nvml is not None else _default_session)
        self._usage = usage or NoUsage()
        self._devices: list[DeviceInfo] | None = None
        self._handles: dict[str, Any] = {}
        self._by_id: dict[str, DeviceInfo] = {}

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
            mem = q("nvmlDeviceGetMemoryInfo", handle, device_id=gid)
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
            mem = q("nvmlDeviceGetMemoryInfo", mh, device_id=gid)
            # What the MIG device reports is what a CUDA context there can use; the profile size is the fallback.
            total = int(mem.total) if mem is not NA else (profile_bytes or 0)
            self._handles[mid] = mh
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
        self.devices()
        info = self._by_id[device_id]  # KeyError for an unknown id: a caller bug, not a device state
        if info.kind == "cpu":
            return DeviceReading(
                utilization_ratio=self._usage.utilization_ratio(CPU_DEVICE_ID),
                memory_used_bytes=self._usage.memory_used_bytes(CPU_DEVICE_ID),
            )
        if self._is_lost(info):
            return DeviceReading(healthy=False)
        q = self._session.query
        gid = info.parent_id or info.id  # a lost MIG call means the physical GPU is lost
        handle = self._handles[device_id]
        mem = q("nvmlDeviceGetMemoryInfo", handle, device_id=gid)
        util = q("nvmlDeviceGetUtilizationRates", handle, device_id=gid)  # NotSupported on MIG (and MIG-on GPUs)
        power_mw = q("nvmlDeviceGetPowerUsage", handle, device_id=gid)  # milliwatts
        limit_mw = q("nvmlDeviceGetEnforcedPowerLimit", handle, device_id=gid)  # milliwatts
        temp = q("nvmlDeviceGetTemperature", handle, NVML_TEMPERATURE_GPU, device_id=gid)
        if self._is_lost(info):
            return DeviceReading(healthy=False)
        return DeviceReading(
            utilization_ratio=util.gpu / 100.0 if util is not NA else None,
            memory_used_bytes=int(mem.used) if mem is not NA else None,
            power_w=power_mw / 1000.0 if power_mw is not NA else None,
            power_limit_w=limit_mw / 1000.0 if limit_mw is not NA else None,
            temperature_c=float(temp) if temp is not NA else None,
        )

    def close(self) -> None:
        self._handles.clear()
        if self._session is not _default_session:
            self._session.shutdown()
