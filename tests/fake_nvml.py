"""A behavioural fake of the pynvml module, built from the data tables of real GPU models (telemetry.gpu_models).

Same function names, argument orders, return shapes and error classes as pynvml (NVMLError with `.value`,
NVMLError_NotSupported, NVMLError_GpuIsLost, ...), so `NvmlBackend(nvml=FakeNvml(...))` runs the real code path.
Behaviour modelled on real drivers: a MIG-on GPU and its MIG devices answer NotSupported for utilization, MIG
devices also for power and temperature; empty MIG slots answer NotFound; power is in milliwatts.

Fault injection: `lose_gpu(index)`, `not_supported(fn, index=None)`, `remove_function(fn)`,
`FakeNvml(driver="missing" | "not_loaded")`.
"""
from __future__ import annotations

import uuid as uuidlib
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from telemetry.gpu_models import A100_SXM4_40GB, A100_SXM4_80GB, H100_SXM5_80GB, GpuModelSpec, place_mig_layout

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_DEVICE_MIG_DISABLE = 0
NVML_DEVICE_MIG_ENABLE = 1
NVML_TEMPERATURE_GPU = 0


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


@dataclass
class FakeMig:
    profile: str
    gpu_instance_id: int
    compute_instance_id: int = 0
    memory_used_bytes: int = 0


@dataclass
class FakeGpu:
    model: GpuModelSpec
    mig: list[FakeMig] | None = None  # None = MIG mode off
    memory_used_bytes: int = 0
    utilization_percent: int = 0
    power_mw: int = 0
    temperature_c: int = 30
    lost: bool = False
    uuid: str = ""
    pci_bus_id: str = ""


@dataclass(frozen=True)
class _Handle:
    gpu: int
    mig: int | None = None  # index into the GPU's MIG slot table


@dataclass(frozen=True)
class _GpuInstanceHandle:
    gpu: int
    gpu_instance_id: int


def mig_layout(model: GpuModelSpec, profiles: list[str]) -> list[FakeMig]:
    """MIG devices for a layout, GPU instance ids 1.. in order (validated against the model's placements)."""
    specs = [model.mig_profile(p) for p in profiles]
    if any(s is None for s in specs) or place_mig_layout(model, specs) is None:  # type: ignore[arg-type]
        raise ValueError(f"layout {profiles} is not valid on {model.name}")
    return [FakeMig(p, gi) for gi, p in enumerate(profiles, start=1)]


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

    # MIG slots per GPU (nvmlDeviceGetMaxMigDeviceCount on A100/H100 is 7)
    MAX_MIG_DEVICES = 7

    def __init__(self, gpus: list[FakeGpu] | None = None, driver: str = "ok"):
        self.gpus = gpus or []
        self.driver = driver  # "ok" | "missing" (no libnvidia-ml.so.1) | "not_loaded" (no kernel module)
        self.initialized = 0  # nvmlInit minus nvmlShutdown calls
        self.init_calls = 0
        self.calls: list[str] = []
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

    def remove_function(self, fn: str) -> None:
        """The driver library lacks `fn`: it answers FunctionNotFound (an older driver than the bindings)."""
        self._removed.add(fn)

    # -- plumbing ----------------------------------------------------------------------------------------------
    def __getattribute__(self, name: str) -> Any:
        attr = object.__getattribute__(self, name)
        if name.startswith("nvml") and callable(attr):
            removed = object.__getattribute__(self, "_removed")
            calls = object.__getattribute__(self, "calls")

            def call(*args: Any) -> Any:
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
            return f"{gpu.model.name} MIG {prefix}{m.profile}"
        return gpu.model.name

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
        gpu = self._check("nvmlDeviceGetMemoryInfo", handle)
        assert gpu is not None
        if handle.mig is not None:
            m = self._mig(handle)
            total = gpu.model.mig_profile(m.profile).memory_bytes  # type: ignore[union-attr]
            used = m.memory_used_bytes
        else:
            total = gpu.model.memory_total_bytes
            used = gpu.memory_used_bytes if gpu.mig is None else sum(m.memory_used_bytes for m in gpu.mig)
        return SimpleNamespace(total=total, used=used, free=total - used)

    def nvmlDeviceGetUtilizationRates(self, handle: _Handle) -> SimpleNamespace:
        gpu = self._check("nvmlDeviceGetUtilizationRates", handle)
        assert gpu is not None
        if gpu.mig is not None:  # nvidia-smi shows GPU-Util N/A with MIG on; MIG devices have none either
            raise NVMLError_NotSupported()
        return SimpleNamespace(gpu=gpu.utilization_percent, memory=0)

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
        return int(gpu.model.power_limit_w * 1000)

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
        if not gpu.model.mig_profiles:
            raise NVMLError_NotSupported()
        mode = NVML_DEVICE_MIG_ENABLE if gpu.mig is not None else NVML_DEVICE_MIG_DISABLE
        return [mode, mode]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: _Handle) -> int:
        gpu = self._check("nvmlDeviceGetMaxMigDeviceCount", handle)
        assert gpu is not None
        return self.MAX_MIG_DEVICES if gpu.model.mig_profiles else 0

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
        spec = gpu.model.mig_profile(m.profile)
        assert spec is not None
        return SimpleNamespace(device=_Handle(gi.gpu), id=gi.gpu_instance_id, profileId=spec.profile_id,
                               placement=SimpleNamespace(start=0, size=spec.memory_slices))

    def _profile_info(self, gpu: FakeGpu, spec: Any) -> SimpleNamespace:
        return SimpleNamespace(id=spec.profile_id, isP2pSupported=0, sliceCount=spec.compute_slices,
                               instanceCount=7 // spec.compute_slices, memorySizeMB=spec.memory_bytes // 2**20,
                               name=f"MIG {spec.name}")

    def nvmlDeviceGetGpuInstanceProfileInfo(self, handle: _Handle, profile: int, version: int = 2) -> SimpleNamespace:
        gpu = self._check("nvmlDeviceGetGpuInstanceProfileInfo", handle)
        assert gpu is not None
        for spec in gpu.model.mig_profiles:
            if spec.profile_index == profile:
                return self._profile_info(gpu, spec)
        raise NVMLError_NotSupported()

    def nvmlDeviceGetGpuInstanceProfileInfoById(self, handle: _Handle, profile_id: int) -> SimpleNamespace:
        gpu = self._check("nvmlDeviceGetGpuInstanceProfileInfoById", handle)
        assert gpu is not None
        for spec in gpu.model.mig_profiles:
            if spec.profile_id == profile_id:
                return self._profile_info(gpu, spec)
        raise NVMLError_NotSupported()


# -- ready-made machines ----------------------------------------------------------------------------------------
def dgx_a100_2gpu_mig(**kw: Any) -> FakeNvml:
    """2x A100-SXM4-80GB; gpu1 in MIG mode: 3g.40gb + 2g.20gb + 2x 1g.10gb (same as the default node file)."""
    return FakeNvml([
        FakeGpu(A100_SXM4_80GB, memory_used_bytes=1 << 30, utilization_percent=37, power_mw=123_456,
                temperature_c=41),
        FakeGpu(A100_SXM4_80GB, mig=mig_layout(A100_SXM4_80GB, ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"]),
                power_mw=88_000, temperature_c=35),
    ], **kw)


def a100_40gb_and_h100(**kw: Any) -> FakeNvml:
    """A100-SXM4-40GB (MIG 4g.20gb + 2g.10gb + 1g.5gb) and an H100 80GB HBM3 with MIG off."""
    return FakeNvml([
        FakeGpu(A100_SXM4_40GB, mig=mig_layout(A100_SXM4_40GB, ["4g.20gb", "2g.10gb", "1g.5gb"])),
        FakeGpu(H100_SXM5_80GB, utilization_percent=100, power_mw=699_000, temperature_c=70),
    ], **kw)
