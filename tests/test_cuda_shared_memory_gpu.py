"""CUDA shared memory on a real GPU (marked `gpu`; skipped without an NVIDIA driver, a CUDA device and cuda-python):
a client's device allocations registered by their cudaIpcMemHandle_t over HTTP and gRPC, a model's inputs read out
of them and its outputs written into them, status, bad handles and sizes refused, unregistration. The client side
is this test process, with cuda-python, as tritonclient's CUDA shared-memory utilities do it.
docs/gpu-validation.md records the runs."""
from __future__ import annotations

import base64

import numpy as np
import pytest

from tests.daemon_harness import ADD_SUB_CONFIG, add_sub_model, save, start_daemon


def _cuda_or_reason():
    try:
        from cuda.bindings import runtime as rt
    except ImportError:
        return None, "cuda-python is not installed (the gpu extra)"
    err, count = rt.cudaGetDeviceCount()
    if err != rt.cudaError_t.cudaSuccess or count < 1:
        return None, f"no CUDA device ({err!r})"
    return rt, None


rt, _WHY_NOT = _cuda_or_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(_WHY_NOT is not None, reason=f"needs a GPU: {_WHY_NOT}")]

ROW_BYTES = 16 * 4


def ok(result):
    assert result[0] == rt.cudaError_t.cudaSuccess, result[0]
    return result[1] if len(result) == 2 else result[1:]


class DeviceBuffer:
    """A client's device allocation and its IPC handle."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.pointer = ok(rt.cudaMalloc(nbytes))
        self.handle = bytes(ok(rt.cudaIpcGetMemHandle(self.pointer)).reserved)

    def put(self, array: np.ndarray, offset: int = 0) -> None:
        host = np.ascontiguousarray(array)
        ok(rt.cudaMemcpy(int(self.pointer) + offset, host.ctypes.data, host.nbytes,
                         rt.cudaMemcpyKind.cudaMemcpyHostToDevice))

    def get(self, offset: int, count: int) -> np.ndarray:
        host = np.empty(count, np.float32)
        ok(rt.cudaMemcpy(host.ctypes.data, int(self.pointer) + offset, host.nbytes,
                         rt.cudaMemcpyKind.cudaMemcpyDeviceToHost))
        return host

    def free(self) -> None:
        ok(rt.cudaFree(self.pointer))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    save(add_sub_model(), repo, "add_sub", ADD_SUB_CONFIG)  # placed on the GPU: its worker moves the region's bytes
    save(add_sub_model(), repo, "add_sub_cpu",  # on the CPU: the daemon moves them
         ADD_SUB_CONFIG + 'instance_group [ { kind: KIND_CPU } ]\n')
    d = start_daemon(repo, tmp_path_factory.mktemp("run"), "--allow-client-shm", "true", node=None)
    yield d
    assert d.stop() == 0, d.log()


@pytest.fixture
def buffers():
    made: list[DeviceBuffer] = []
    yield lambda n: made.append(DeviceBuffer(n)) or made[-1]
    for b in made:
        b.free()


def register(daemon, name: str, buf: DeviceBuffer, byte_size: int | None = None, handle: bytes | None = None,
             line_length: int = 0):
    """`line_length`: break the base64 into lines, as Triton's C++ clients' libb64 does (72)."""
    b64 = base64.b64encode(buf.handle if handle is None else handle).decode()
    if line_length:
        b64 = "\n".join(b64[i:i + line_length] for i in range(0, len(b64), line_length)) + "\n"
    doc = {"raw_handle": {"b64": b64},
           "device_id": 0, "byte_size": buf.nbytes if byte_size is None else byte_size}
    return daemon.post_json(f"/v2/cudasharedmemory/region/{name}/register", doc)


def shm(region: str, offset: int, size: int = ROW_BYTES) -> dict:
    return {"shared_memory_region": region, "shared_memory_offset": offset, "shared_memory_byte_size": size}


MODELS = pytest.mark.parametrize("model", ["add_sub", "add_sub_cpu"])


def test_one_model_on_the_gpu_and_one_on_the_cpu(daemon):
    devices = {m["name"]: [i["device"] for i in m["instances"]] for m in daemon.inspect()["models"]}
    assert devices["add_sub_cpu"] == ["cpu"], devices
    assert all(d != "cpu" for d in devices["add_sub"]), devices


@MODELS
def test_http_inputs_and_outputs_in_cuda_shared_memory(daemon, buffers, model):
    a, b = np.arange(16, dtype=np.float32), np.full(16, 3.0, np.float32)
    inputs, outputs = buffers(2 * ROW_BYTES), buffers(2 * ROW_BYTES)
    inputs.put(np.concatenate([a, b]))
    assert register(daemon, "in", inputs, line_length=72) == (200, {})
    assert register(daemon, "out", outputs) == (200, {})
    status = daemon.get_json("/v2/cudasharedmemory/status")
    assert sorted(status, key=lambda r: r["name"]) == [{"name": "in", "device_id": 0, "byte_size": 128},
                                                       {"name": "out", "device_id": 0, "byte_size": 128}]
    body = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "parameters": shm("in", 0)},
                       {"name": "INPUT1", "shape": [1, 16], "datatype": "FP32", "parameters": shm("in", ROW_BYTES)}],
            "outputs": [{"name": "OUTPUT0", "parameters": shm("out", 0)},
                        {"name": "OUTPUT1", "parameters": shm("out", ROW_BYTES)}]}
    code, doc = daemon.post_json(f"/v2/models/{model}/infer", body)
    assert code == 200, doc
    assert all("data" not in o for o in doc["outputs"])
    np.testing.assert_array_equal(outputs.get(0, 16), a + b)
    np.testing.assert_array_equal(outputs.get(ROW_BYTES, 16), a - b)
    assert daemon.post_json("/v2/cudasharedmemory/unregister") == (200, {})
    assert daemon.get_json("/v2/cudasharedmemory/status") == []


def test_grpc_inputs_and_outputs_in_cuda_shared_memory(daemon, buffers):
    import grpc

    from gpud.proto import grpc_service_pb2 as pb
    from gpud.proto import grpc_service_pb2_grpc as pb_grpc

    a, b = np.linspace(-1, 1, 16, dtype=np.float32), np.full(16, 0.5, np.float32)
    region = buffers(4 * ROW_BYTES)
    region.put(np.concatenate([a, b]))
    with grpc.insecure_channel(daemon.grpc_url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        stub.CudaSharedMemoryRegister(pb.CudaSharedMemoryRegisterRequest(
            name="g", raw_handle=region.handle, device_id=0, byte_size=region.nbytes), timeout=60)
        status = stub.CudaSharedMemoryStatus(pb.CudaSharedMemoryStatusRequest(name="g"), timeout=60)
        assert (status.regions["g"].device_id, status.regions["g"].byte_size) == (0, 4 * ROW_BYTES)

        def params(offset):
            return {"shared_memory_region": pb.InferParameter(string_param="g"),
                    "shared_memory_offset": pb.InferParameter(int64_param=offset),
                    "shared_memory_byte_size": pb.InferParameter(int64_param=ROW_BYTES)}

        request = pb.ModelInferRequest(model_name="add_sub", inputs=[
            pb.ModelInferRequest.InferInputTensor(name="INPUT0", datatype="FP32", shape=[1, 16], parameters=params(0)),
            pb.ModelInferRequest.InferInputTensor(name="INPUT1", datatype="FP32", shape=[1, 16],
                                                  parameters=params(ROW_BYTES))],
            outputs=[pb.ModelInferRequest.InferRequestedOutputTensor(name="OUTPUT0", parameters=params(2 * ROW_BYTES)),
                     pb.ModelInferRequest.InferRequestedOutputTensor(name="OUTPUT1", parameters=params(3 * ROW_BYTES))])
        response = stub.ModelInfer(request, timeout=60)
        assert [len(raw) for raw in response.raw_output_contents] == [0, 0]  # in the region, not in the answer
        np.testing.assert_array_equal(region.get(2 * ROW_BYTES, 16), a + b)
        np.testing.assert_array_equal(region.get(3 * ROW_BYTES, 16), a - b)
        with pytest.raises(grpc.RpcError) as info:
            stub.CudaSharedMemoryRegister(pb.CudaSharedMemoryRegisterRequest(
                name="g", raw_handle=region.handle, device_id=0, byte_size=16), timeout=60)
        assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
        stub.CudaSharedMemoryUnregister(pb.CudaSharedMemoryUnregisterRequest(name="g"), timeout=60)
        assert not stub.CudaSharedMemoryStatus(pb.CudaSharedMemoryStatusRequest(), timeout=60).regions


def test_bad_handles_and_sizes_are_refused_and_the_daemon_serves_on(daemon, buffers):
    buf = buffers(256)
    code, doc = register(daemon, "junk", buf, handle=bytes(range(64)))
    assert code == 400 and "failed to open CUDA IPC handle" in doc["error"], doc
    code, doc = register(daemon, "short", buf, handle=b"\1" * 8)
    assert code == 400 and "a cudaIpcMemHandle_t is 64" in doc["error"], doc
    code, doc = register(daemon, "big", buf, byte_size=1 << 30)
    assert code == 400 and "past the end of the CUDA allocation" in doc["error"], doc
    assert register(daemon, "fine", buf, byte_size=128) == (200, {})
    body = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "parameters": shm("fine", 96)},
                       {"name": "INPUT1", "shape": [1, 16], "datatype": "FP32", "parameters": shm("fine", 0)}]}
    code, doc = daemon.post_json("/v2/models/add_sub/infer", body)
    assert code == 400 and "Invalid offset + byte size" in doc["error"], doc
    assert daemon.post_json("/v2/cudasharedmemory/region/fine/unregister") == (200, {})
    body = {"inputs": [{"name": n, "shape": [1, 16], "datatype": "FP32", "data": [1.0] * 16}
                       for n in ("INPUT0", "INPUT1")]}
    code, doc = daemon.post_json("/v2/models/add_sub/infer", body)
    assert code == 200 and doc["outputs"][0]["data"] == [2.0] * 16, doc


@MODELS
def test_many_requests_in_cuda_shared_memory_batch_and_each_gets_its_rows(daemon, buffers, model):
    from concurrent.futures import ThreadPoolExecutor

    count = 32
    region = buffers(count * 4 * ROW_BYTES)
    rows = np.random.default_rng(0).standard_normal((count, 2, 16)).astype(np.float32)
    for i in range(count):
        region.put(rows[i].reshape(-1), i * 4 * ROW_BYTES)
    assert register(daemon, "many", region) == (200, {})

    def one(i: int):
        base = i * 4 * ROW_BYTES
        body = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "parameters": shm("many", base)},
                           {"name": "INPUT1", "shape": [1, 16], "datatype": "FP32",
                            "parameters": shm("many", base + ROW_BYTES)}],
                "outputs": [{"name": "OUTPUT0", "parameters": shm("many", base + 2 * ROW_BYTES)},
                            {"name": "OUTPUT1", "parameters": shm("many", base + 3 * ROW_BYTES)}]}
        return daemon.post_json(f"/v2/models/{model}/infer", body)[0]

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(one, range(count))) == [200] * count
    for i in range(count):
        base = i * 4 * ROW_BYTES
        np.testing.assert_allclose(region.get(base + 2 * ROW_BYTES, 16), rows[i, 0] + rows[i, 1], rtol=1e-6)
        np.testing.assert_allclose(region.get(base + 3 * ROW_BYTES, 16), rows[i, 0] - rows[i, 1], rtol=1e-6)
    assert daemon.post_json("/v2/cudasharedmemory/unregister") == (200, {})

