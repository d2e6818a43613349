"""Clients' shared-memory regions (Triton's shared-memory extension): what a client registered, where a request's
tensor lies in one, and moving the bytes in and out.

A region is a POSIX shared-memory object the client made (`shm_open(key)`: the file /dev/shm/<key>), or a part of
one (offset, byte_size). The choices, and why:

- **Only files directly in /dev/shm**, opened with O_NOFOLLOW, regular files only, never gpud's own segments
  (`gpud-*`): a key is a name the client chooses, and gpud reads model inputs from it and writes model outputs into
  it with its own privileges. `../../etc/passwd` or a symlink must not turn registration into a way to read or
  overwrite gpud's files, and another request's tensors in gpud's segments are not the client's to read.
- **gpud keeps the file open from register to unregister** (one descriptor per region, at most `max_regions`):
  a client that unlinks its key after registering still has a working region, as with Triton's mapping. A region
  costs gpud a descriptor, no memory.
- **Bytes move with pread/pwrite, never through a mapping.** A client may truncate its file while it is registered or
  while a request uses it; a mapped read past a file's end is a SIGBUS that kills the reading process, a pread just
  comes back short, which is a clear error for that request. The other processes of gpud (device workers, running as
  gpud's user) open the same file through `/proc/<gpud pid>/fd/<n>` (`RegionSlice.path`), which works after the
  client unlinked the key.
- **A region in use stays open**: unregistering removes its name at once (new requests cannot use it), and its
  descriptor closes when the last request using it finishes, so a descriptor number is never reused under a request.

A CUDA region is a client's device allocation, registered by its `cudaIpcMemHandle_t` (gpud.executor.cuda_ipc):
- **Opened at registration, in the daemon's own process**, on the client's `device_id`, as Triton does: a handle
  that does not open is refused then ("failed to open CUDA IPC handle: invalid argument"), not at the first request;
  and the region's size is checked against the allocation's, so no copy reaches past what the client shared.
- **The worker of that GPU moves the bytes** when it runs every instance of the request's model: it opens the region
  itself (gpud.executor.cuda_ipc.WorkerCudaRegions) and copies the inputs straight into the batch's input segment
  and the outputs straight into the region, so the core never touches them. Otherwise (a model on the CPU or on
  other GPUs, an ensemble, text tensors) the daemon's process copies them: inputs out of the device into host
  memory, outputs into the client's allocation. The daemon's process holds a CUDA context on each device that has
  a registered region.
- Unregistering closes the mapping once no request uses it, as for system regions: a client frees its memory only
  after unregistering it (CUDA leaves freeing mapped memory undefined).
"""
from __future__ import annotations

import errno
import logging
import math
import os
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from gpud.executor.bytes_tensor import decode_bytes_elements, encode_bytes_elements
from gpud.executor.cuda_ipc import HANDLE_BYTES, CudaIpc, is_region_path, region_path, worker_regions
from gpud.executor.datatypes import numpy_dtype, placeholder
from gpud.executor.shm import SHM_FULL_ADVICE
from gpud.executor.types import (ClientIO, ErrorKind, InferenceError, InferRequest, InferResponse, RegionSlice,
                                 ShmRef)

if TYPE_CHECKING:
    from gpud.executor.scheduler import Scheduler

log = logging.getLogger("gpud.shm")
SHM_DIR = "/dev/shm"
DEFAULT_MAX_REGIONS = 1024  # one open descriptor each
DISABLED_MESSAGE = "Client shared memory is disabled. Start the server with '--allow-client-shm=true' to enable."
CUDA_NEEDS_GPU = ("CUDA shared memory needs a GPU: this node has none (system shared memory, "
                  "/v2/systemsharedmemory, works without one)")


def _invalid(message: str) -> InferenceError:
    return InferenceError(ErrorKind.INVALID_ARGUMENT, message)


@dataclass(eq=False)
class CudaRegion:
    """One registered CUDA region: the client's allocation mapped into this process, and the requests using it."""

    name: str
    device_id: int
    byte_size: int
    pointer: int
    ipc: CudaIpc
    path: str  # how workers name it (cuda_ipc.region_path)
    device_uuid: str  # the GPU that holds it
    on_close: Callable[[str], None] | None = None  # its mapping closed here: the workers may close theirs
    users: int = 0
    registered: bool = True

    def close_if_unused(self) -> None:
        if not self.registered and self.users == 0 and self.pointer:
            pointer, self.pointer = self.pointer, 0
            self.ipc.close(self.device_id, pointer)
            if self.on_close is not None:
                self.on_close(self.path)

    def slice(self, offset: int, byte_size: int) -> RegionSlice:
        """Where a tensor lies, as the worker of its GPU reads or writes it."""
        return RegionSlice(self.name, self.path, offset, byte_size)


@dataclass(frozen=True, slots=True)
class CudaSlice:
    """Where a requested output goes in a CUDA region: `byte_size` bytes at `offset` of the client's allocation."""

    region: CudaRegion
    offset: int
    byte_size: int

    def read(self, name: str, datatype: str, shape: tuple[int, ...]) -> np.ndarray:
        """The input's bytes copied out of the device (one copy), as its tensor."""
        buf = np.empty(self.byte_size, dtype=np.uint8)
        self.region.ipc.read(self.region.device_id, self.region.pointer + self.offset, buf)
        return as_tensor(buf, name, datatype, shape)

    def write(self, name: str, datatype: str, data: np.ndarray) -> None:
        blob = output_bytes(datatype, data)
        if len(blob) > self.byte_size:
            raise _too_small(name, self.byte_size, len(blob))
        self.region.ipc.write(self.region.device_id, self.region.pointer + self.offset, blob)


@dataclass(frozen=True, slots=True)
class RegionStatus:
    name: str
    key: str
    offset: int
    byte_size: int


@dataclass(eq=False)
class Region:
    """One registered region: its open file, and the requests using it."""

    name: str
    key: str
    offset: int
    byte_size: int
    fd: int
    users: int = 0
    registered: bool = True

    @property
    def path(self) -> str:
        """How another process of gpud's user opens this region's file, also once the client unlinked its key."""
        return f"/proc/{os.getpid()}/fd/{self.fd}"

    def close_if_unused(self) -> None:
        if not self.registered and self.users == 0 and self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class ClientRegions:
    """The registered system shared-memory regions of a server. `allowed`: --allow-client-shm."""

    def __init__(self, *, allowed: bool = False, max_regions: int = DEFAULT_MAX_REGIONS, shm_dir: str = SHM_DIR,
                 has_gpu: bool = False, max_request_bytes: int = 64 * 2**20, cuda: CudaIpc | None = None,
                 forget: Callable[[list[str]], None] | None = None):
        self.allowed = allowed
        self.max_regions = max_regions
        # A request's inputs in regions are staged in gpud's memory as a body's would be: the same bound.
        self.max_request_bytes = max_request_bytes
        self.shm_dir = shm_dir
        self.has_gpu = has_gpu
        self._regions: dict[str, Region] = {}
        self._cuda_ipc = cuda  # made on the first CUDA registration when not given (cuda-python, the gpu extra)
        self._cuda_regions: dict[str, CudaRegion] = {}
        self._forget = forget  # sends a closed CUDA region's path to every device worker (protocol.ForgetSegments)
        # CUDA regions open here by path: one handle may be registered under several names, and the workers map it
        # once for all of them (cuda_ipc.WorkerCudaRegions), so they close it only when the last of them closes
        self._open_paths: dict[str, int] = {}

    # --- the extension's calls -----------------------------------------------------------------------------------
    def _check_allowed(self) -> None:
        if not self.allowed:
            raise InferenceError(ErrorKind.UNSUPPORTED, DISABLED_MESSAGE)

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        self._check_allowed()
        if not name:
            raise _invalid("'region name' is necessary to register system shared memory region")
        self._check_room(name)
        if offset < 0 or byte_size < 0:
            raise _invalid(f"failed to register shared memory region '{name}': invalid args")
        fd = self._open(name, key)
        try:
            size = os.fstat(fd).st_size
            if offset + byte_size > size:
                raise _invalid(f"failed to register shared memory region '{name}': offset {offset} + byte_size "
                               f"{byte_size} is past the end of '{key}' ({size} bytes)")
        except BaseException:
            os.close(fd)
            raise
        self._regions[name] = Region(name, key, offset, byte_size, fd)

    def _check_room(self, name: str) -> None:
        """A new region's name is free (one namespace for system and CUDA regions, as Triton's), and there is room."""
        if name in self._regions or name in self._cuda_regions:
            raise InferenceError(ErrorKind.ALREADY_EXISTS, f"shared memory region '{name}' already in manager")
        if len(self._regions) + len(self._cuda_regions) >= self.max_regions:
            raise InferenceError(ErrorKind.UNAVAILABLE,
                                 f"failed to register shared memory region '{name}': {self.max_regions} regions are "
                                 "registered, the most gpud keeps; unregister some first")

    def _open(self, name: str, key: str) -> int:
        base = key[1:] if key.startswith("/") else key
        if not base or "/" in base or base in (".", "..") or "\0" in base:
            raise _invalid(f"failed to register shared memory region '{name}': key '{key}' is not a shared-memory "
                           "object's name (one name, as shm_open takes it: '/name')")
        if base.startswith("gpud-"):
            raise _invalid(f"failed to register shared memory region '{name}': key '{key}' names one of gpud's own "
                           "segments, which clients cannot register")
        try:
            fd = os.open(os.path.join(self.shm_dir, base), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as exc:
            raise _invalid(f"Unable to open shared memory region: '{key}' ({exc.strerror})") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise _invalid(f"Invalid shared memory region: '{key}' (not a shared-memory object)")
        return fd

    def unregister(self, name: str = "") -> None:
        """One region, or every region when `name` is empty; an unknown name is no error (as Triton)."""
        self._check_allowed()
        names = [name] if name else list(self._regions)
        for n in names:
            region = self._regions.pop(n, None)
            if region is not None:
                region.registered = False
                region.close_if_unused()

    def status(self, name: str = "") -> list[RegionStatus]:
        if name:
            region = self._regions.get(name)
            if region is None:
                raise InferenceError(ErrorKind.NOT_FOUND,
                                     f"Unable to find system shared memory region: '{name}'")
            regions = [region]
        else:
            regions = list(self._regions.values())
        return [RegionStatus(r.name, r.key, r.offset, r.byte_size) for r in regions]

    def check_cuda(self) -> None:
        """CUDA regions can be registered here: allowed, and the node has a GPU (not a simulated one)."""
        self._check_allowed()
        if not self.has_gpu:
            raise InferenceError(ErrorKind.UNSUPPORTED, CUDA_NEEDS_GPU)

    def _ipc(self) -> CudaIpc:
        if self._cuda_ipc is None:
            from gpud.executor.cuda_ipc import CudaRuntimeIpc

            self._cuda_ipc = CudaRuntimeIpc()
        return self._cuda_ipc

    def cuda_register(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        """Open the client's allocation (`raw_handle`: its cudaIpcMemHandle_t's 64 bytes) on CUDA device
        `device_id`, `byte_size` bytes of it from its start being the region."""
        self.check_cuda()
        failed = f"failed to register CUDA shared memory region '{name}'"
        if len(raw_handle) != HANDLE_BYTES:
            raise _invalid(f"{failed}: failed to open CUDA IPC handle: invalid argument (raw_handle is "
                           f"{len(raw_handle)} bytes; a cudaIpcMemHandle_t is {HANDLE_BYTES})")
        if not name:
            raise _invalid("'region name' is necessary to register cuda shared memory region")
        self._check_room(name)
        if byte_size < 0:
            raise _invalid(f"{failed}: invalid args")
        ipc = self._ipc()
        count = ipc.device_count()
        if isinstance(device_id, bool) or not 0 <= device_id < count:
            raise _invalid(f"{failed}: device_id {device_id} is not one of this node's CUDA devices (0 to "
                           f"{count - 1})" if count else f"{failed}: this process sees no CUDA device")
        try:
            device_uuid = ipc.device_uuid(device_id)
            opened = ipc.open(bytes(raw_handle), device_id)
        except InferenceError as exc:
            raise InferenceError(exc.kind, f"{failed}: {exc.message}") from None
        if byte_size > opened.allocation_bytes:
            ipc.close(device_id, opened.pointer)
            raise _invalid(f"{failed}: byte_size {byte_size} is past the end of the CUDA allocation the handle "
                           f"shares ({opened.allocation_bytes} bytes)")
        path = region_path(bytes(raw_handle))
        self._open_paths[path] = self._open_paths.get(path, 0) + 1
        self._cuda_regions[name] = CudaRegion(name, device_id, byte_size, opened.pointer, ipc, path, device_uuid,
                                              self._cuda_closed)

    def _cuda_closed(self, path: str) -> None:
        """A CUDA region's mapping here closed: when no other region has its handle, the workers close theirs. A
        worker that cannot be told (gone, restarting) has nothing mapped any more: never an error for the request
        whose release closed it."""
        left = self._open_paths.get(path, 1) - 1
        if left > 0:
            self._open_paths[path] = left
            return
        self._open_paths.pop(path, None)
        if self._forget is not None:
            try:
                self._forget([path])
            except Exception:  # noqa: BLE001 - see above; logged, the answer and the other regions go on
                log.warning("could not tell every device worker to close a CUDA region", exc_info=True)

    def cuda_unregister(self, name: str = "") -> None:
        """One CUDA region, or every one when `name` is empty; an unknown name is no error (as Triton). A region in
        use is closed when its last request finishes."""
        self._check_allowed()
        for n in [name] if name else list(self._cuda_regions):
            region = self._cuda_regions.pop(n, None)
            if region is not None:
                region.registered = False
                region.close_if_unused()

    def cuda_status(self, name: str = "") -> list[dict[str, Any]]:
        """Triton's status of CUDA regions: name, device_id and byte_size of each (or of the one named)."""
        if name:
            region = self._cuda_regions.get(name)
            if region is None:
                if name in self._regions:
                    raise InferenceError(ErrorKind.NOT_FOUND, f"The region named '{name}' is registered as system "
                                                              "shared memory, not CUDA shared memory")
                raise InferenceError(ErrorKind.NOT_FOUND, f"Unable to find cuda shared memory region: '{name}'")
            regions = [region]
        else:
            regions = list(self._cuda_regions.values())
        return [{"name": r.name, "device_id": r.device_id, "byte_size": r.byte_size} for r in regions]

    def close(self) -> None:
        regions: list[Region | CudaRegion] = [*self._regions.values(), *self._cuda_regions.values()]
        for region in regions:
            region.registered = False
            region.users = 0
            region.close_if_unused()
        self._regions.clear()
        self._cuda_regions.clear()

    # --- a request's use -----------------------------------------------------------------------------------------
    def _take(self, ref: ShmRef, what: str) -> tuple[Region, RegionSlice] | tuple[CudaRegion, CudaSlice]:
        """The region `ref` names, system or CUDA, and where in it the tensor lies (bounds checked)."""
        self._check_allowed()
        region = self._regions.get(ref.region)
        if region is not None:
            _check_bounds(ref, region.byte_size, what)
            return region, RegionSlice(region.name, region.path, region.offset + ref.offset, ref.byte_size)
        cuda = self._cuda_regions.get(ref.region)
        if cuda is None:
            raise InferenceError(ErrorKind.NOT_FOUND, f"Unable to find shared memory region: '{ref.region}'")
        _check_bounds(ref, cuda.byte_size, what)
        return cuda, CudaSlice(cuda, ref.offset, ref.byte_size)

    def stage(self, request: InferRequest, in_worker: bool = False, worker_gpu: str = "") -> Staged:
        """Resolve the request's shared-memory inputs and outputs and hold their regions until `Staged.release`.
        `in_worker`: the version's device worker reads the inputs and writes the outputs itself (the request's
        `client_io`; the daemon never touches those bytes); else the inputs are read here, into arrays, and
        `Staged.deliver` writes the outputs. Tensors in CUDA regions are moved by the worker only when
        `worker_gpu`, the UUID of the one GPU whose worker runs the version's every instance, holds their region;
        else here. Raises a client error (and holds nothing) when a region, an offset or
        a size is wrong, or a region's file is shorter than the request needs (its client truncated it)."""
        total = sum(t.shm.byte_size for t in request.inputs if t.shm is not None)
        if total > self.max_request_bytes:
            raise _invalid(f"the request's inputs in shared memory add up to {total} bytes, more than the limit of "
                           f"{self.max_request_bytes} (--max-request-bytes)")
        staged = Staged()
        io = ClientIO() if in_worker else None
        try:
            for tensor in request.inputs:
                ref = tensor.shm
                if ref is None:
                    continue
                what = f"input '{tensor.name}'"
                region, where = self._take(ref, what)
                staged.hold(region)
                expected_bytes(tensor.name, tensor.datatype, tensor.shape, ref.byte_size)
                if isinstance(where, CudaSlice):
                    if io is not None and where.region.device_uuid == worker_gpu and tensor.datatype != "BYTES":
                        io.inputs[tensor.name] = where.region.slice(where.offset, where.byte_size)
                        tensor.data = placeholder(tensor.datatype, tensor.shape)
                    else:
                        tensor.data = where.read(tensor.name, tensor.datatype, tensor.shape)
                elif io is not None and tensor.datatype != "BYTES":  # text is checked element by element: read here
                    assert isinstance(region, Region)
                    _check_file(region, where, what)
                    io.inputs[tensor.name] = where
                    tensor.data = placeholder(tensor.datatype, tensor.shape)
                else:
                    tensor.data = read_tensor(where, tensor.name, tensor.datatype, tensor.shape)
                tensor.shm = None
            for output in request.outputs or ():
                ref = output.shm
                if ref is not None:
                    what = f"output '{output.name}'"
                    region, where = self._take(ref, what)
                    staged.hold(region)
                    if isinstance(where, CudaSlice):
                        if io is not None and where.region.device_uuid == worker_gpu:
                            io.outputs[output.name] = (ref, where.region.slice(where.offset, where.byte_size))
                        else:  # written here, in `deliver`
                            staged.outputs[output.name] = (ref, where)
                        continue
                    assert isinstance(region, Region)
                    _check_file(region, where, what)
                    if io is not None:
                        io.outputs[output.name] = (ref, where)
                    else:
                        staged.outputs[output.name] = (ref, where)
        except BaseException:
            staged.release()
            raise
        request.client_io = io
        return staged


def worker_gpu(scheduler: Scheduler) -> str:
    """The UUID of the one physical GPU whose worker process runs every instance of a version (`scheduler`'s), when
    its workers move clients' tensors; "" otherwise (the CPU, a simulated or MIG device, several GPUs, an ensemble).
    A CUDA region on that GPU is then read and written by that worker (ClientRegions.stage)."""
    if not scheduler.moves_client_tensors:
        return ""
    uuids = set()
    for inst in scheduler.instances:
        worker = inst.worker
        if worker is None or worker.in_process or worker.device.kind != "gpu" or worker.device.simulated \
                or not worker.device.uuid:
            return ""
        uuids.add(worker.device.uuid)
    return uuids.pop() if len(uuids) == 1 else ""


def place_inputs(request: InferRequest, placed: Mapping[str, RegionSlice], in_worker: bool) -> None:
    """Inputs another process of gpud put in shared memory (a front-end process's arena), by name: left for the
    version's worker to read (`client_io`), or read now."""
    io = ClientIO(inputs=dict(placed)) if in_worker else None
    for tensor in request.inputs:
        where = placed.get(tensor.name)
        if where is None:
            continue
        if io is not None:
            tensor.data = placeholder(tensor.datatype, tensor.shape)
        else:
            tensor.data = read_tensor(where, tensor.name, tensor.datatype, tensor.shape)
    if io is not None:
        request.client_io = io


def _check_bounds(ref: ShmRef, region_bytes: int, what: str) -> None:
    if ref.offset < 0 or ref.byte_size < 0 or (region_bytes and ref.offset >= region_bytes):
        raise _invalid(f"Invalid offset for shared memory region: '{ref.region}' ({what})")
    if ref.offset + ref.byte_size > region_bytes:
        raise _invalid(f"Invalid offset + byte size for shared memory region: '{ref.region}' ({what}: "
                       f"{ref.offset} + {ref.byte_size} > {region_bytes})")


def _check_file(region: Region, where: RegionSlice, what: str) -> None:
    size = os.fstat(region.fd).st_size
    if where.offset + where.byte_size > size:
        raise _invalid(f"{what}: shared memory region '{region.name}' is {size} bytes now, too short for "
                       f"{where.byte_size} bytes at offset {where.offset}: the client truncated it")


@dataclass(eq=False)
class Staged:
    """The regions a request uses (held open until `release`) and where its shared-memory outputs go."""

    regions: list[Region | CudaRegion] = field(default_factory=list)
    outputs: dict[str, tuple[ShmRef, RegionSlice | CudaSlice]] = field(default_factory=dict)

    def hold(self, region: Region | CudaRegion) -> None:
        region.users += 1
        self.regions.append(region)

    def release(self) -> None:
        regions, self.regions = self.regions, []
        for region in regions:
            region.users -= 1
            region.close_if_unused()

    def deliver(self, response: InferResponse) -> None:
        """Write the response's shared-memory outputs into their regions; the response then carries only their
        shapes. Raises a client error when an output is larger than the space its request gave it."""
        for tensor in response.outputs:
            target = self.outputs.get(tensor.name)
            if target is None or tensor.shm is not None:  # not in shared memory, or its worker wrote it already
                continue
            ref, where = target
            if isinstance(where, CudaSlice):
                where.write(tensor.name, tensor.datatype, tensor.data)
            else:
                write_tensor(where, tensor.name, tensor.datatype, tensor.data)
            tensor.shm = ref
            tensor.data = NO_DATA

    def answering(self, done: Callable[[Any], None]) -> Callable[[Any], None]:
        """`done`, given the response with its shared-memory outputs delivered; the regions released either way."""

        def answer(result: Any) -> None:
            try:
                if isinstance(result, InferResponse):
                    try:
                        self.deliver(result)
                    except InferenceError as exc:
                        result = exc
            finally:
                self.release()
            done(result)
        return answer


NO_DATA = np.empty(0, dtype=np.uint8)  # the data of a tensor in shared memory, which nobody reads


def shm_ref_of(params: dict[str, Any], what: str) -> ShmRef:
    """The shared-memory extension's parameters of an input or requested output (offset optional, default 0), as
    either front end decodes them."""
    region = params.get("shared_memory_region")
    if not isinstance(region, str) or not region:
        raise _invalid(f"{what}: Unable to parse 'shared_memory_region': expected a region's name")
    if "shared_memory_byte_size" not in params:
        raise _invalid(f"{what}: 'shared_memory_region' needs a 'shared_memory_byte_size' parameter")
    return ShmRef(region, _non_negative(params.get("shared_memory_offset", 0), what, "shared_memory_offset"),
                  _non_negative(params["shared_memory_byte_size"], what, "shared_memory_byte_size"))


def _non_negative(value: Any, what: str, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _invalid(f"{what}: parameter '{key}' must be a non-negative integer, got {value!r}")
    return value


# --- the bytes ---------------------------------------------------------------------------------------------------
def expected_bytes(name: str, datatype: str, shape: tuple[int, ...], byte_size: int) -> None:
    """A fixed-size input's shared-memory size must be exactly what its shape takes."""
    if datatype == "BYTES":
        return
    need = math.prod(shape) * numpy_dtype(datatype).itemsize
    if byte_size != need:
        raise _invalid(f"input '{name}': shared_memory_byte_size is {byte_size} bytes but shape {list(shape)} of "
                       f"{datatype} needs {need}")


def _pread_exact(fd: int, buf: memoryview, offset: int, what: str) -> None:
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n <= 0:
            raise _invalid(f"{what}: the shared-memory region ends {done} bytes into the tensor's "
                           f"{len(buf)}: the client truncated it")
        done += n


def read_into(path: str, offset: int, dest: memoryview, what: str) -> None:
    """Fill `dest` with the bytes at `offset` of a region's file, or of a CUDA region (a device worker's read of a
    batch's input)."""
    if is_region_path(path):
        worker_regions().read(path, offset, dest)
        return
    with open_region(path) as fd:
        _pread_exact(fd, dest, offset, what)


def read_tensor(where: RegionSlice, name: str, datatype: str, shape: tuple[int, ...]) -> np.ndarray:
    """The tensor's bytes read out of its region (one copy), as an array of `shape`."""
    expected_bytes(name, datatype, shape, where.byte_size)
    buf = np.empty(where.byte_size, dtype=np.uint8)
    read_into(where.path, where.offset, buf.data, f"input '{name}'")
    return as_tensor(buf, name, datatype, shape)


def as_tensor(buf: np.ndarray, name: str, datatype: str, shape: tuple[int, ...]) -> np.ndarray:
    """An input's bytes (a uint8 array read out of a region) as its tensor: elements of `datatype` in `shape`, or
    serialized BYTES elements decoded (a client error when they do not parse)."""
    if datatype == "BYTES":
        try:
            return decode_bytes_elements(buf.data, math.prod(shape)).reshape(shape)
        except ValueError as exc:
            raise _invalid(f"input '{name}': {exc}") from None
    return buf.view(numpy_dtype(datatype).newbyteorder("<")).reshape(shape)


def output_bytes(datatype: str, data: np.ndarray) -> memoryview:
    """An output as it goes into shared memory: little-endian elements, or serialized BYTES elements."""
    if datatype == "BYTES":
        return memoryview(encode_bytes_elements(data))
    return np.ascontiguousarray(data, dtype=numpy_dtype(datatype).newbyteorder("<")).data.cast("B")


def write_tensor(where: RegionSlice, name: str, datatype: str, data: np.ndarray) -> None:
    """Write an output into its region (the daemon's or a device worker's write); a client error when it is larger
    than the space the request gave it, or the region's file is now shorter."""
    write_blob(where.path, where.offset, where.byte_size, output_bytes(datatype, data), name)


def write_blob(path: str, offset: int, byte_size: int, blob: memoryview, name: str) -> None:
    if len(blob) > byte_size:
        raise _too_small(name, byte_size, len(blob))
    if is_region_path(path):
        worker_regions().write(path, offset, blob)
        return
    with open_region(path) as fd:
        size = os.fstat(fd).st_size
        if offset + len(blob) > size:  # a pwrite past the end would grow the client's file: refuse instead
            raise _invalid(f"output '{name}': the shared-memory region is {size} bytes, too short for the output "
                           f"at offset {offset}: the client truncated it")
        done = 0
        try:
            while done < len(blob):
                done += os.pwritev(fd, [blob[done:]], offset + done)
        except OSError as exc:  # a client's region is a sparse file: its pages are taken as they are written
            if exc.errno not in (errno.ENOSPC, errno.ENOMEM):
                raise
            raise InferenceError(ErrorKind.UNAVAILABLE, f"output '{name}': no room in shared memory to write it into "
                                                        f"the client's region ({exc.strerror}); retry, or "
                                                        f"{SHM_FULL_ADVICE}") from None


def _too_small(name: str, byte_size: int, need: int) -> InferenceError:
    return _invalid(f"shared memory size specified with the request for output '{name}' ({byte_size} bytes) should "
                    f"be at least {need} bytes to hold the results")


class open_region:
    """A region's file, opened for one read or write (a context manager giving the descriptor)."""

    def __init__(self, path: str):
        self.path = path
        self.fd = -1

    def __enter__(self) -> int:
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise InferenceError(ErrorKind.UNAVAILABLE,
                                 f"the shared-memory region was unregistered while in use ({exc.strerror})") from None
        return self.fd

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)
