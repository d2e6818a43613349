"""Executor pieces that need no worker: provider choice, worker environment, shared-memory segments."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from gpud.executor.model_config import ModelConfig, TensorSpec
from gpud.executor.device import WorkerDevice
from gpud.executor.onnxruntime_backend import CPU_EP, CUDA_EP, TRT_EP, choose_providers
from gpud.executor.supervisor import WorkerSupervisor
from gpud.executor.protocol import tensor_region_bytes
from gpud.executor.bytes_tensor import decode_bytes_elements, encode_bytes_elements
from gpud.executor.shm import Segment, new_segment_name
from gpud.executor.types import ErrorKind, InferenceError

GPU = WorkerDevice("gpu0", "gpu", "GPU-1234")
MIG = WorkerDevice("gpu1/mig1.0", "mig", "MIG-abcd")
SIM = WorkerDevice("gpu0", "gpu", "GPU-sim", simulated=True)
CPU = WorkerDevice("cpu", "cpu")
ALL_EPS = [TRT_EP, CUDA_EP, CPU_EP]


@pytest.mark.parametrize("device, available, accel, want", [
    (GPU, ALL_EPS, (), [CUDA_EP, CPU_EP]),
    (GPU, ALL_EPS, ("tensorrt",), [TRT_EP, CUDA_EP, CPU_EP]),
    (GPU, [CUDA_EP, CPU_EP], ("tensorrt",), [CUDA_EP, CPU_EP]),  # TensorRT asked for but not installed
    (GPU, [CPU_EP], (), [CPU_EP]),                               # CPU-only onnxruntime on a GPU node
    (MIG, ALL_EPS, (), [CUDA_EP, CPU_EP]),
    (SIM, ALL_EPS, ("tensorrt",), [CPU_EP]),                     # a simulated GPU computes on the CPU
    (CPU, ALL_EPS, (), [CPU_EP]),
])
def test_choose_providers(device, available, accel, want):
    assert [name for name, _ in choose_providers(device, available, accel, stream_handle=None)] == want


def test_each_instance_gets_its_own_stream_on_device_0():
    providers = dict(choose_providers(MIG, ALL_EPS, (), stream_handle=1234))
    # The worker sees exactly one device (CUDA_VISIBLE_DEVICES), so it is always device 0.
    assert providers[CUDA_EP] == {"device_id": "0", "has_user_compute_stream": "1", "user_compute_stream": "1234",
                                  "use_tf32": "0"}


@pytest.mark.parametrize("tf32", [False, True])
def test_fp32_stays_fp32_on_the_cuda_ep_unless_the_model_allows_tf32(tf32):
    # onnxruntime's CUDA EP defaults to use_tf32=1: FP32 MatMul in TF32, ~1e-3 off the CPU's result. The option is
    # gpud_cuda_tf32 (tests/test_model_options.py reads it).
    providers = dict(choose_providers(GPU, ALL_EPS, ("tensorrt",), stream_handle=None, tf32=tf32))
    assert providers[CUDA_EP]["use_tf32"] == ("1" if tf32 else "0")
    assert "use_tf32" not in providers[TRT_EP]  # not a TensorRT EP option


@pytest.mark.parametrize("device, want", [(MIG, "MIG-abcd"), (GPU, "GPU-1234"), (CPU, "")])
def test_worker_environment_pins_one_cuda_device(device, want):
    env = WorkerSupervisor(device)._env()
    assert env["CUDA_VISIBLE_DEVICES"] == want


def test_simulated_gpu_worker_leaves_cuda_alone(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert "CUDA_VISIBLE_DEVICES" not in WorkerSupervisor(SIM)._env()


def test_segment_views_are_shared_between_mappings():
    seg = Segment.create(new_segment_name("test"), 1000)
    try:
        other = Segment.attach(seg.name)
        seg.ndarray(64, (4,), np.float32)[...] = [1, 2, 3, 4]
        np.testing.assert_array_equal(other.ndarray(64, (4,), np.float32), [1, 2, 3, 4])
        other.close()
    finally:
        seg.close()
    with pytest.raises(FileNotFoundError):
        Segment.attach(seg.name)  # the owner removed it


def test_bytes_tensors_round_trip():
    arr = np.array([b"a", b"", b"hello"], dtype=np.object_)
    blob = encode_bytes_elements(arr)
    assert blob == b"\x01\0\0\0a" + b"\0\0\0\0" + b"\x05\0\0\0hello"
    assert list(decode_bytes_elements(blob, 3)) == [b"a", b"", b"hello"]
    with pytest.raises(ValueError):
        decode_bytes_elements(blob[:-1], 3)


def test_region_size_is_one_full_batch():
    cfg = ModelConfig("m", max_batch_size=8, inputs=(TensorSpec("a", "FP32", (256,)), TensorSpec("b", "INT64", (3,))))
    # a: 8 * 256 * 4 = 8192 bytes; b: 8 * 3 * 8 = 192 (a multiple of the 64-byte alignment); total 8384
    assert tensor_region_bytes(cfg, cfg.inputs) == 8384
    var = ModelConfig("v", max_batch_size=8, inputs=(TensorSpec("a", "FP32", (-1,)),))
    assert tensor_region_bytes(var, var.inputs) == 1 << 20  # variable dims: a default that grows on demand


class _GoneWorker:
    """A worker whose process is gone before a load can be sent (or whose load is cancelled)."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc
        self.instances: dict = {}

    async def load(self, inst) -> None:
        raise self.exc


@pytest.mark.parametrize("exc", [InferenceError(ErrorKind.UNAVAILABLE, "the worker for device cpu is not running"),
                                 OSError(24, "Too many open files"), asyncio.CancelledError()])
def test_an_instance_that_does_not_load_keeps_no_shared_memory(exc):
    import os

    from gpud.executor.instance import InstanceHandle
    from gpud.executor.pool import ExecutorPool

    pool = ExecutorPool()
    worker = _GoneWorker(exc)

    async def started(device):
        return worker

    pool._worker = started  # type: ignore[method-assign]
    config = ModelConfig(name="m", max_batch_size=4, inputs=(TensorSpec("x", "FP32", (4,)),),
                         outputs=(TensorSpec("y", "FP32", (4,)),))
    inst = InstanceHandle(key="m:1:0", model="m", version="1", index=0, device_id="cpu", model_path="",
                          config=config, estimate_bytes=0)
    segments: list[str] = []
    real_open = inst.open_segments

    def opened() -> None:
        real_open()
        segments.extend(s.name for s in (inst.in_seg, inst.out_seg))
    inst.open_segments = opened  # type: ignore[method-assign]
    if isinstance(exc, asyncio.CancelledError):
        with pytest.raises(asyncio.CancelledError):
            asyncio.run(pool.load_instance(inst, CPU))
    else:
        asyncio.run(pool.load_instance(inst, CPU))
        assert not inst.ready and inst.error
    assert len(segments) == 2 and not any(os.path.exists(os.path.join("/dev/shm", n)) for n in segments)
    assert inst.in_seg is None and worker.instances == {}
