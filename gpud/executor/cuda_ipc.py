"""Clients' CUDA shared-memory regions at the CUDA level: open a client's `cudaIpcMemHandle_t`, copy a tensor's bytes
out of it and an output's bytes into it, close it (cuda-python's runtime and driver bindings, `cuda.bindings`, from
the gpu extra; imported on first use so a CPU install never needs them).

`CudaIpc` is what `gpud.executor.client_shm` uses; `CudaRuntimeIpc` is the real one, and tests pass a fake. Every
failure is an `InferenceError` whose text carries CUDA's own error string, as Triton's does ("failed to open CUDA
IPC handle: invalid argument").

A device worker whose GPU holds a client's region moves that region's tensors itself (`WorkerCudaRegions`): it finds
the region by a path of its own kind (`region_path`: the handle, as the system regions' paths are their files), opens
it on first use and closes it when the daemon forgets it (protocol.ForgetSegments), so the core's loop never copies
those bytes.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from gpud.executor.types import ErrorKind, InferenceError

HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)
NO_BINDINGS = ("CUDA shared memory needs cuda-python's bindings (the gpu extra: pip install 'gpud[gpu]'), which this "
               "gpud's environment lacks")


@dataclass(frozen=True, slots=True)
class Opened:
    """A client's allocation mapped into this process: its device pointer, and the allocation's size (what a region
    may cover)."""

    pointer: int
    allocation_bytes: int


PATH_PREFIX = "cuda-ipc:"


def region_path(handle: bytes) -> str:
    """How gpud's processes name a CUDA region in a batch's reads and writes (its IPC handle, in hex)."""
    return PATH_PREFIX + handle.hex()


def is_region_path(path: str) -> bool:
    return path.startswith(PATH_PREFIX)


def uuid_text(raw: bytes) -> str:
    """A device's 16-byte UUID as NVML and nvidia-smi write it: GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx."""
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


class CudaIpc(Protocol):
    def device_count(self) -> int: ...

    def device_uuid(self, device_id: int) -> str:
        """CUDA device `device_id`'s UUID (uuid_text), to find which of gpud's workers runs on it."""
        ...

    def open(self, handle: bytes, device_id: int) -> Opened: ...

    def close(self, device_id: int, pointer: int) -> None: ...

    def read(self, device_id: int, pointer: int, dest: np.ndarray) -> None:
        """Copy `dest.nbytes` bytes from device address `pointer` into `dest` (contiguous host memory)."""
        ...

    def write(self, device_id: int, pointer: int, src: memoryview) -> None:
        """Copy `src` to device address `pointer`."""
        ...


class CudaRuntimeIpc:
    """CUDA IPC through cuda.bindings in this process. The process's CUDA context on a device is made by the first
    region registered there, as in Triton (which opens clients' handles in its own process). Calls come from the
    core's event loop, and from the thread of the in-process API: one lock keeps each device switch with its copy."""

    def __init__(self) -> None:
        self._rt: Any = None
        self._driver: Any = None
        self._lock = threading.Lock()

    def _runtime(self) -> Any:
        if self._rt is None:
            try:
                from cuda.bindings import driver, runtime
            except ImportError:
                raise InferenceError(ErrorKind.UNSUPPORTED, NO_BINDINGS) from None
            self._rt, self._driver = runtime, driver
        return self._rt

    def _check(self, result: tuple, what: str, kind: ErrorKind = ErrorKind.INTERNAL) -> Any:
        rt = self._rt
        err = result[0]
        if err != rt.cudaError_t.cudaSuccess:
            rt.cudaGetLastError()  # a failed call leaves its error as the thread's last; the next must not see it
            raise InferenceError(kind, f"{what}: {self.error_string(err)}")
        return result[1] if len(result) == 2 else result[1:]

    def error_string(self, err: Any) -> str:
        text = self._rt.cudaGetErrorString(err)
        text = text[1] if isinstance(text, tuple) else text
        return text.decode() if isinstance(text, bytes) else str(text)

    def device_count(self) -> int:
        rt = self._runtime()
        with self._lock:
            result = rt.cudaGetDeviceCount()
            if result[0] != rt.cudaError_t.cudaSuccess:
                rt.cudaGetLastError()
                return 0
            return int(result[1])

    def device_uuid(self, device_id: int) -> str:
        rt = self._runtime()
        with self._lock:
            prop = self._check(rt.cudaGetDeviceProperties(device_id), f"failed to read CUDA device {device_id}")
            raw = prop.uuid.bytes
            return uuid_text(raw if isinstance(raw, bytes) else bytes(b & 0xFF for b in raw))

    def open(self, handle: bytes, device_id: int) -> Opened:
        rt = self._runtime()
        with self._lock:
            self._check(rt.cudaSetDevice(device_id), f"failed to use CUDA device {device_id}",
                        ErrorKind.INVALID_ARGUMENT)
            ipc = rt.cudaIpcMemHandle_t()
            ipc.reserved = handle
            pointer = int(self._check(rt.cudaIpcOpenMemHandle(ipc, rt.cudaIpcMemLazyEnablePeerAccess),
                                      "failed to open CUDA IPC handle", ErrorKind.INVALID_ARGUMENT))
            # The allocation's extent, from the driver: a region may not reach past it (a copy past an allocation
            # reads or overwrites whatever is mapped beyond it, or faults the context).
            result = self._driver.cuMemGetAddressRange(pointer)
            if result[0] != self._driver.CUresult.CUDA_SUCCESS:
                rt.cudaIpcCloseMemHandle(pointer)
                rt.cudaGetLastError()
                raise InferenceError(ErrorKind.INTERNAL, f"the size of the CUDA allocation could not be read "
                                                         f"({result[0]!r})")
            base, size = int(result[1]), int(result[2])
            return Opened(pointer, size - (pointer - base))

    def close(self, device_id: int, pointer: int) -> None:
        rt = self._runtime()
        with self._lock:
            rt.cudaSetDevice(device_id)
            rt.cudaIpcCloseMemHandle(pointer)
            rt.cudaGetLastError()

    def read(self, device_id: int, pointer: int, dest: np.ndarray) -> None:
        rt = self._runtime()
        with self._lock:
            self._check(rt.cudaSetDevice(device_id), f"failed to use CUDA device {device_id}")
            self._check(rt.cudaMemcpy(dest.ctypes.data, pointer, dest.nbytes,
                                      rt.cudaMemcpyKind.cudaMemcpyDeviceToHost),
                        "failed to read a tensor out of CUDA shared memory")

    def write(self, device_id: int, pointer: int, src: memoryview) -> None:
        rt = self._runtime()
        host = np.frombuffer(src, dtype=np.uint8)  # held until the copy returns: its address is only an int
        with self._lock:
            self._check(rt.cudaSetDevice(device_id), f"failed to use CUDA device {device_id}")
            self._check(rt.cudaMemcpy(pointer, host.ctypes.data, host.nbytes,
                                      rt.cudaMemcpyKind.cudaMemcpyHostToDevice),
                        "failed to write an output into CUDA shared memory")
            # A copy from pageable memory may return before it reaches the device: the client reads the output
            # once answered, so it must be there by then.
            self._check(rt.cudaDeviceSynchronize(), "failed to write an output into CUDA shared memory")


class WorkerCudaRegions:
    """A device worker's clients' CUDA regions: opened on first use on its one visible device (0) and kept open for
    the next batch, until the daemon forgets them (the region was unregistered and no request uses it)."""

    def __init__(self, ipc: CudaIpc | None = None):
        self._ipc: CudaIpc = ipc if ipc is not None else CudaRuntimeIpc()
        self._open: dict[str, int] = {}
        self._lock = threading.Lock()  # a worker's instances run batches on threads of their own

    def _pointer(self, path: str) -> int:
        with self._lock:
            pointer = self._open.get(path)
            if pointer is None:
                handle = bytes.fromhex(path[len(PATH_PREFIX):])
                try:
                    pointer = self._open[path] = self._ipc.open(handle, 0).pointer
                except InferenceError as exc:
                    # The core checked the handle at registration and chose this worker because its GPU holds the
                    # region: a failure here means the model moved to another device since (a re-placement), or
                    # the client freed its memory. Retrying is the client's answer to both.
                    raise InferenceError(ErrorKind.UNAVAILABLE, "the worker that ran the batch could not open the "
                                         f"CUDA region ({exc.message}): its model may have moved to another device "
                                         "meanwhile; retry") from None
            return pointer

    def read(self, path: str, offset: int, dest: memoryview) -> None:
        self._ipc.read(0, self._pointer(path) + offset, np.frombuffer(dest, dtype=np.uint8))

    def write(self, path: str, offset: int, blob: memoryview) -> None:
        self._ipc.write(0, self._pointer(path) + offset, blob)

    def forget(self, names: list[str] | tuple[str, ...]) -> None:
        with self._lock:
            pointers = [self._open.pop(n) for n in names if n in self._open]
        for pointer in pointers:
            self._ipc.close(0, pointer)


_worker_regions: WorkerCudaRegions | None = None
_worker_regions_lock = threading.Lock()


def worker_regions() -> WorkerCudaRegions:
    """This worker's CUDA regions (made on the first batch that reads or writes one; instances' threads may ask at
    once, and one table must hold every mapping so that a forget finds it)."""
    global _worker_regions
    if _worker_regions is None:
        with _worker_regions_lock:
            if _worker_regions is None:
                _worker_regions = WorkerCudaRegions()
    return _worker_regions


def forget_in_worker(names: tuple[str, ...]) -> None:
    """Close the regions among `names` this worker opened (none opened: nothing to do, and cuda-python untouched)."""
    if _worker_regions is not None and any(is_region_path(n) for n in names):
        _worker_regions.forget(names)
