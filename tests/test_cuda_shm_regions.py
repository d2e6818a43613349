"""CUDA shared-memory regions (gpud.executor.client_shm with gpud.executor.cuda_ipc's interface), on a fake CUDA IPC
whose "device memory" is host bytes: registration opens the handle and checks it and the size, a request's inputs
are copied out and its outputs copied in, the bounds are checked, names are one namespace with system regions, and a
region unregistered while a request uses it is closed only when that request finishes. The real CUDA path runs in
tests/test_cuda_shared_memory_gpu.py on a GPU."""
from __future__ import annotations

import numpy as np
import pytest

from gpud.executor.bytes_tensor import encode_bytes_elements
from types import SimpleNamespace

from gpud.executor import cuda_ipc
from gpud.executor.client_shm import ClientRegions, read_into, worker_gpu, write_blob
from gpud.executor.cuda_ipc import Opened, WorkerCudaRegions
from gpud.executor.device import WorkerDevice
from gpud.executor.types import (ErrorKind, InferenceError, InferRequest, InferResponse, InferTensor, RequestedOutput,
                                 ShmRef)

BASE = 1 << 40


class FakeCudaIpc:
    """Allocations by handle; each open maps one at its own address, as cudaIpcOpenMemHandle does."""

    def __init__(self, devices: int = 1):
        self.devices = devices
        self.memory: dict[bytes, bytearray] = {}
        self.mapped: dict[int, bytearray] = {}
        self.closed: list[int] = []
        self._next = BASE

    def allocate(self, nbytes: int) -> bytes:
        handle = bytes([len(self.memory) + 1]) * 64
        self.memory[handle] = bytearray(nbytes)
        return handle

    def device_count(self) -> int:
        return self.devices

    def device_uuid(self, device_id: int) -> str:
        return f"GPU-fake-{device_id}"

    def open(self, handle: bytes, device_id: int) -> Opened:
        if handle not in self.memory:
            raise InferenceError(ErrorKind.INVALID_ARGUMENT, "failed to open CUDA IPC handle: invalid argument")
        pointer, self._next = self._next, self._next + (1 << 32)
        self.mapped[pointer] = self.memory[handle]
        return Opened(pointer, len(self.memory[handle]))

    def close(self, device_id: int, pointer: int) -> None:
        del self.mapped[pointer]
        self.closed.append(pointer)

    def _at(self, pointer: int, nbytes: int) -> tuple[bytearray, int]:
        base = max(p for p in self.mapped if p <= pointer)
        mem, offset = self.mapped[base], pointer - base
        assert offset + nbytes <= len(mem), "a copy past the allocation"
        return mem, offset

    def read(self, device_id: int, pointer: int, dest: np.ndarray) -> None:
        mem, offset = self._at(pointer, dest.nbytes)
        dest.reshape(-1).view(np.uint8)[:] = np.frombuffer(mem, np.uint8, dest.nbytes, offset)

    def write(self, device_id: int, pointer: int, src: memoryview) -> None:
        mem, offset = self._at(pointer, len(src))
        mem[offset:offset + len(src)] = bytes(src)


@pytest.fixture
def ipc():
    return FakeCudaIpc()


@pytest.fixture
def regions(ipc):
    r = ClientRegions(allowed=True, has_gpu=True, cuda=ipc)
    yield r
    r.close()


def refused(call, *args) -> InferenceError:
    with pytest.raises(InferenceError) as info:
        call(*args)
    return info.value


def request(inputs, outputs=None) -> InferRequest:
    return InferRequest("m", inputs, outputs=outputs, uses_shm=True)


def test_an_input_is_read_out_of_the_clients_allocation_and_an_output_written_into_it(ipc, regions):
    handle = ipc.allocate(128)
    ipc.memory[handle][:64] = np.arange(16, dtype="<f4").tobytes()
    regions.cuda_register("r", handle, 0, 128)
    assert regions.cuda_status() == [{"name": "r", "device_id": 0, "byte_size": 128}]
    req = request([InferTensor("x", "FP32", (1, 16), np.empty(0), ShmRef("r", 0, 64))],
                  [RequestedOutput("y", shm=ShmRef("r", 64, 64))])
    staged = regions.stage(req, in_worker=True)  # CUDA tensors are moved here even when the worker could move others
    assert req.client_io is not None and not req.client_io.inputs and not req.client_io.outputs
    np.testing.assert_array_equal(req.inputs[0].data, np.arange(16, dtype=np.float32).reshape(1, 16))
    answered = []
    staged.answering(answered.append)(InferResponse("m", "1", [InferTensor("y", "FP32", (1, 16),
                                                                           np.full((1, 16), 2.5, np.float32))]))
    (response,) = answered
    assert response.outputs[0].shm == ShmRef("r", 64, 64) and response.outputs[0].data.size == 0
    assert np.frombuffer(ipc.memory[handle], "<f4", 16, 64).tolist() == [2.5] * 16


def test_text_tensors_round_trip_byte_exact(ipc, regions):
    values = np.array([b"", b"he\x00llo", "h\u00e9llo".encode()], dtype=object).reshape(1, 3)
    blob = encode_bytes_elements(values)
    handle = ipc.allocate(256)
    ipc.memory[handle][:len(blob)] = blob
    regions.cuda_register("t", handle, 0, 256)
    req = request([InferTensor("s", "BYTES", (1, 3), np.empty(0), ShmRef("t", 0, len(blob)))],
                  [RequestedOutput("o", shm=ShmRef("t", 128, 128))])
    staged = regions.stage(req)
    assert req.inputs[0].data.tolist() == values.tolist()
    staged.deliver(InferResponse("m", "1", [InferTensor("o", "BYTES", (1, 3), values)]))
    staged.release()
    assert bytes(ipc.memory[handle][128:128 + len(blob)]) == blob


def test_registration_opens_the_handle_and_checks_what_it_is_given(ipc, regions):
    handle = ipc.allocate(64)
    err = refused(regions.cuda_register, "", b"", 0, 0)  # Triton's own test: the handle first
    assert err.kind is ErrorKind.INVALID_ARGUMENT
    assert err.message.startswith("failed to register CUDA shared memory region '': failed to open CUDA IPC handle: "
                                  "invalid argument")
    assert "is 0 bytes" in err.message
    err = refused(regions.cuda_register, "bad", b"\x7f" * 64, 0, 16)
    assert err.message == ("failed to register CUDA shared memory region 'bad': failed to open CUDA IPC handle: "
                           "invalid argument")
    assert "device_id 1 is not one of this node's CUDA devices (0 to 0)" in refused(
        regions.cuda_register, "dev", handle, 1, 16).message
    assert "device_id -1" in refused(regions.cuda_register, "dev", handle, -1, 16).message
    err = refused(regions.cuda_register, "big", handle, 0, 65)
    assert "byte_size 65 is past the end of the CUDA allocation the handle shares (64 bytes)" in err.message
    assert ipc.mapped == {}, "a refused registration keeps nothing open"
    assert regions.cuda_status() == []


def test_one_namespace_with_system_regions_and_a_shared_limit(ipc, tmp_path):
    (tmp_path / "key").write_bytes(bytes(64))
    regions = ClientRegions(allowed=True, has_gpu=True, cuda=ipc, shm_dir=str(tmp_path), max_regions=2)
    regions.register("sys", "/key", 0, 64)
    err = refused(regions.cuda_register, "sys", ipc.allocate(64), 0, 64)
    assert err.kind is ErrorKind.ALREADY_EXISTS
    regions.cuda_register("gpu", ipc.allocate(64), 0, 64)
    assert refused(regions.register, "gpu", "/key", 0, 64).kind is ErrorKind.ALREADY_EXISTS
    assert refused(regions.cuda_register, "third", ipc.allocate(64), 0, 64).kind is ErrorKind.UNAVAILABLE
    assert "registered as system shared memory" in refused(regions.cuda_status, "sys").message
    assert refused(regions.status, "gpu").kind is ErrorKind.NOT_FOUND
    assert "Unable to find cuda shared memory region: 'nope'" in refused(regions.cuda_status, "nope").message
    regions.unregister()  # system regions only
    assert [r["name"] for r in regions.cuda_status()] == ["gpu"]
    regions.close()
    assert ipc.mapped == {}


@pytest.mark.parametrize("offset,size,why", [(64, 16, "Invalid offset"), (48, 32, "Invalid offset + byte size"),
                                             (0, 32, "needs 64")])
def test_offsets_and_sizes_past_the_region_are_refused_and_hold_nothing(ipc, regions, offset, size, why):
    regions.cuda_register("r", ipc.allocate(64), 0, 64)
    req = request([InferTensor("x", "FP32", (1, 16), np.empty(0), ShmRef("r", offset, size))])
    err = refused(regions.stage, req)
    assert err.kind is ErrorKind.INVALID_ARGUMENT and why in err.message
    regions.cuda_unregister("r")
    assert len(ipc.closed) == 1, "nothing held it: closed at once"


def test_an_output_larger_than_its_space_fails_that_request(ipc, regions):
    regions.cuda_register("r", ipc.allocate(64), 0, 64)
    req = request([InferTensor("x", "FP32", (1, 1), np.zeros((1, 1), np.float32))],
                  [RequestedOutput("y", shm=ShmRef("r", 0, 32))])
    answered = []
    regions.stage(req).answering(answered.append)(
        InferResponse("m", "1", [InferTensor("y", "FP32", (1, 16), np.zeros((1, 16), np.float32))]))
    assert isinstance(answered[0], InferenceError)
    assert "(32 bytes) should be at least 64 bytes" in answered[0].message


def test_unregistered_while_in_use_it_closes_when_the_request_finishes(ipc, regions):
    handle = ipc.allocate(128)
    regions.cuda_register("r", handle, 0, 128)
    req = request([InferTensor("x", "FP32", (1, 16), np.empty(0), ShmRef("r", 0, 64))],
                  [RequestedOutput("y", shm=ShmRef("r", 64, 64))])
    answer = regions.stage(req).answering(lambda result: None)
    regions.cuda_unregister()
    assert regions.cuda_status() == [] and ipc.closed == []
    assert refused(regions.stage, request([InferTensor("x", "FP32", (1, 16), np.empty(0),
                                                       ShmRef("r", 0, 64))])).kind is ErrorKind.NOT_FOUND
    answer(InferResponse("m", "1", [InferTensor("y", "FP32", (1, 16), np.ones((1, 16), np.float32))]))
    assert np.frombuffer(ipc.memory[handle], "<f4", 16, 64).tolist() == [1.0] * 16, "its output still delivered"
    assert len(ipc.closed) == 1 and ipc.mapped == {}
    regions.cuda_unregister("r")  # an unknown name is no error, as in Triton


def test_without_a_gpu_or_unless_allowed_it_says_so(ipc):
    no_gpu = ClientRegions(allowed=True, has_gpu=False, cuda=ipc)
    assert "CUDA shared memory needs a GPU" in refused(no_gpu.cuda_register, "r", ipc.allocate(8), 0, 8).message
    off = ClientRegions(allowed=False, has_gpu=True, cuda=ipc)
    assert refused(off.cuda_register, "r", ipc.allocate(8), 0, 8).kind is ErrorKind.UNSUPPORTED
    assert ipc.mapped == {}


def test_without_cuda_python_registration_names_the_missing_extra(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_cuda(name, *args, **kwargs):
        if name.startswith("cuda"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_cuda)
    regions = ClientRegions(allowed=True, has_gpu=True)
    err = refused(regions.cuda_register, "r", bytes(64), 0, 8)
    assert err.kind is ErrorKind.UNSUPPORTED and "gpud[gpu]" in err.message


def test_the_worker_of_the_regions_gpu_moves_its_tensors_itself(ipc, monkeypatch):
    forgotten = []
    regions = ClientRegions(allowed=True, has_gpu=True, cuda=ipc, forget=forgotten.extend)
    handle = ipc.allocate(128)
    ipc.memory[handle][:64] = np.arange(16, dtype="<f4").tobytes()
    regions.cuda_register("r", handle, 0, 128)
    req = request([InferTensor("x", "FP32", (1, 16), np.empty(0), ShmRef("r", 0, 64)),
                   InferTensor("s", "BYTES", (1, 1), np.empty(0), None)],
                  [RequestedOutput("y", shm=ShmRef("r", 64, 64))])
    staged = regions.stage(req, in_worker=True, worker_gpu="GPU-fake-0")
    where = req.client_io.inputs["x"]
    assert where.path == cuda_ipc.region_path(handle) and (where.offset, where.byte_size) == (0, 64)
    assert req.inputs[0].data.shape == (1, 16), "a placeholder: the worker fills the batch"
    assert req.client_io.outputs["y"][1].offset == 64 and not staged.outputs

    # the worker's side (another process in gpud; its regions opened on its one device, 0)
    worker_ipc = FakeCudaIpc()
    worker_ipc.memory = ipc.memory
    monkeypatch.setattr(cuda_ipc, "_worker_regions", WorkerCudaRegions(worker_ipc))
    dest = np.zeros(16, np.float32)
    read_into(where.path, where.offset, dest.data.cast("B"), "input 'x'")
    assert dest.tolist() == list(range(16))
    out_where = req.client_io.outputs["y"][1]
    write_blob(out_where.path, out_where.offset, out_where.byte_size,
               memoryview(np.full(16, 7.0, "<f4").tobytes()), "y")
    assert np.frombuffer(ipc.memory[handle], "<f4", 16, 64).tolist() == [7.0] * 16
    assert len(worker_ipc.mapped) == 1, "opened once, kept for the next batch"
    read_into(where.path, where.offset, dest.data.cast("B"), "input 'x'")
    assert len(worker_ipc.mapped) == 1

    staged.release()
    regions.cuda_unregister("r")
    assert forgotten == [where.path], "the workers are told to close it"
    cuda_ipc.forget_in_worker(tuple(forgotten))
    assert worker_ipc.mapped == {} and ipc.mapped == {}


@pytest.mark.parametrize("worker_gpu_uuid,datatype", [("GPU-other", "FP32"), ("", "FP32"), ("GPU-fake-0", "BYTES")])
def test_elsewhere_or_text_the_daemon_moves_them(ipc, regions, worker_gpu_uuid, datatype):
    handle = ipc.allocate(128)
    data = (encode_bytes_elements(np.array([b"x" * 60], dtype=object)) if datatype == "BYTES"
            else np.ones(16, "<f4").tobytes())
    ipc.memory[handle][:64] = data
    regions.cuda_register("r", handle, 0, 128)
    req = request([InferTensor("x", datatype, (1, 1) if datatype == "BYTES" else (1, 16), np.empty(0),
                               ShmRef("r", 0, 64))], [RequestedOutput("y", shm=ShmRef("r", 64, 64))])
    staged = regions.stage(req, in_worker=True, worker_gpu=worker_gpu_uuid)
    assert not req.client_io.inputs
    assert req.inputs[0].data.reshape(-1)[0] in (1.0, b"x" * 60)
    if worker_gpu_uuid == "GPU-fake-0":  # only the text input is read here; the worker writes the output
        assert "y" in req.client_io.outputs and not staged.outputs
    else:
        assert "y" in staged.outputs and not req.client_io.outputs
    staged.release()


def _scheduler(*devices, moves=True, in_process=False):
    return SimpleNamespace(moves_client_tensors=moves, instances=[
        SimpleNamespace(worker=SimpleNamespace(device=d, in_process=in_process)) for d in devices])


def test_worker_gpu_is_the_one_real_gpu_of_every_instance():
    gpu = WorkerDevice("gpu0", "gpu", "GPU-a")
    assert worker_gpu(_scheduler(gpu, gpu)) == "GPU-a"
    assert worker_gpu(_scheduler(gpu, WorkerDevice("gpu1", "gpu", "GPU-b"))) == ""
    assert worker_gpu(_scheduler(gpu, moves=False)) == ""
    assert worker_gpu(_scheduler(gpu, in_process=True)) == ""
    assert worker_gpu(_scheduler(WorkerDevice("gpu0", "gpu", "GPU-a", simulated=True))) == ""
    assert worker_gpu(_scheduler(WorkerDevice("mig0", "mig", "MIG-a"))) == ""
    assert worker_gpu(_scheduler(WorkerDevice("cpu", "cpu"))) == ""
    assert worker_gpu(_scheduler()) == ""


def test_one_handle_under_two_names_stays_open_in_the_workers_until_both_are_gone(ipc):
    forgotten = []
    regions = ClientRegions(allowed=True, has_gpu=True, cuda=ipc, forget=forgotten.extend)
    handle = ipc.allocate(128)
    regions.cuda_register("a", handle, 0, 128)
    regions.cuda_register("b", handle, 0, 128)
    staged = regions.stage(request([InferTensor("x", "FP32", (1, 16), np.empty(0), ShmRef("b", 0, 64))]),
                           in_worker=True, worker_gpu="GPU-fake-0")
    regions.cuda_unregister("a")
    assert forgotten == [], "'b' uses the workers' mapping of the same handle"
    regions.cuda_unregister("b")
    assert forgotten == []
    staged.release()
    assert forgotten == [cuda_ipc.region_path(handle)] and ipc.mapped == {}


def test_a_worker_that_cannot_be_told_to_close_a_region_costs_no_answer_and_no_other_region(ipc):
    def gone(names):
        raise BrokenPipeError(32, "Broken pipe")
    regions = ClientRegions(allowed=True, has_gpu=True, cuda=ipc, forget=gone)
    for name in ("a", "b"):
        regions.cuda_register(name, ipc.allocate(128), 0, 128)
    req = request([InferTensor("x", "FP32", (1, 16), np.empty(0), ShmRef("a", 0, 64)),
                   InferTensor("z", "FP32", (1, 16), np.empty(0), ShmRef("b", 0, 64))])
    answered = []
    answer = regions.stage(req).answering(answered.append)
    regions.cuda_unregister()
    answer(InferResponse("m", "1", []))
    assert len(answered) == 1 and isinstance(answered[0], InferResponse)
    assert ipc.mapped == {}, "both closed here"


def test_a_worker_that_cannot_open_a_region_says_retry(monkeypatch):
    """The core chose the worker because its GPU held the region; if the model moved meanwhile, the worker cannot
    open it: UNAVAILABLE saying so (retrying stages it again where it now runs), not a 400 about device 0."""
    class NoDevice(FakeCudaIpc):
        def open(self, handle, device_id):
            raise InferenceError(ErrorKind.INVALID_ARGUMENT, "failed to use CUDA device 0: invalid device ordinal")

    monkeypatch.setattr(cuda_ipc, "_worker_regions", WorkerCudaRegions(NoDevice()))
    with pytest.raises(InferenceError) as info:
        read_into(cuda_ipc.region_path(bytes(64)), 0, memoryview(bytearray(8)), "input 'x'")
    assert info.value.kind is ErrorKind.UNAVAILABLE
    assert "invalid device ordinal" in info.value.message and "retry" in info.value.message


def test_the_pool_tells_every_worker_to_forget_a_region_even_when_one_cannot_hear():
    from gpud.executor.pool import ExecutorPool

    told = []

    class Gone:
        def forget_segments(self, names):
            raise BrokenPipeError(32, "Broken pipe")

    class Alive:
        def forget_segments(self, names):
            told.append(names)

    pool = ExecutorPool()
    pool.workers.update({"gpu0": Gone(), "gpu1": Alive()})
    pool.forget_everywhere(["cuda-ipc:00"])
    assert told == [["cuda-ipc:00"]]
