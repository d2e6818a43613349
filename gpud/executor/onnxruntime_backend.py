"""The onnxruntime backend (gpud.executor.backend): picks execution providers for a device and runs one model instance.

Imported inside worker processes only (onnxruntime itself on first use). onnxruntime-gpu and cuda-python are
optional: without them (or on a simulated node) the CPU execution provider runs the model, which is real
computation, just not on a GPU.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from gpud.executor.backend import LoadOptions
from gpud.executor.device import WorkerDevice
from gpud.executor.model_config import ModelConfig
from gpud.executor.datatypes import numpy_dtype

log = logging.getLogger("gpud.worker")

CPU_EP = "CPUExecutionProvider"
CUDA_EP = "CUDAExecutionProvider"
TRT_EP = "TensorrtExecutionProvider"




def choose_providers(
    device: WorkerDevice,
    available: list[str],
    accelerators: tuple[str, ...],
    stream_handle: int | None,
    tf32: bool = False,
) -> list[tuple[str, dict[str, str]]]:
    """Execution providers in priority order for a model instance on `device` (pure).

    The worker process sees exactly one CUDA device (CUDA_VISIBLE_DEVICES names its GPU or MIG UUID), so the device
    id is always 0. Each instance gets its own CUDA stream so instances on one device overlap. The CUDA EP computes
    FP32 in FP32 unless `tf32`: onnxruntime's default (use_tf32=1) rounds FP32 MatMul and Conv inputs to TF32's 10-bit
    mantissa on Ampere and newer, so an FP32 model's outputs would differ from the CPU's by about 1e-3.
    """
    if not device.has_cuda or CUDA_EP not in available:
        return [(CPU_EP, {})]
    stream_opts: dict[str, str] = {"device_id": "0"}
    if stream_handle is not None:
        stream_opts |= {"has_user_compute_stream": "1", "user_compute_stream": str(stream_handle)}
    providers: list[tuple[str, dict[str, str]]] = []
    if "tensorrt" in accelerators and TRT_EP in available:
        providers.append((TRT_EP, dict(stream_opts)))
    providers.append((CUDA_EP, stream_opts | {"use_tf32": "1" if tf32 else "0"}))
    providers.append((CPU_EP, {}))
    return providers


_preloaded = False


def preload_cuda_libraries() -> None:
    """Load the CUDA and cuDNN libraries of the nvidia-* wheels (the gpu extra) before the first CUDA session:
    without a system CUDA install, onnxruntime-gpu's CUDA EP cannot find libcudart / libcudnn and onnxruntime then
    runs the model on the CPU instead. Once per process; a failure is logged, and the CUDA EP then finds the
    system's libraries or fails over to the CPU, which the load reports as its provider."""
    global _preloaded
    if _preloaded:
        return
    _preloaded = True
    import onnxruntime as ort

    preload = getattr(ort, "preload_dlls", None)  # onnxruntime-gpu >= 1.21
    if preload is None or CUDA_EP not in ort.get_available_providers():
        return
    try:
        preload(directory="")  # "": the nvidia site packages first, then the default search path
    except Exception as exc:  # noqa: BLE001 - the session that follows says what is missing
        log.warning("onnxruntime.preload_dlls failed (%s); the CUDA EP needs the CUDA and cuDNN libraries on "
                    "the library path", exc)


def _create_stream() -> int | None:
    """A non-blocking CUDA stream from cuda-python, or None when cuda-python is not installed."""
    try:
        from cuda.bindings import runtime as cudart  # cuda-python >= 12.6
    except ImportError:
        try:
            from cuda import cudart  # older cuda-python
        except ImportError:
            return None
    err, stream = cudart.cudaStreamCreateWithFlags(cudart.cudaStreamNonBlocking)
    if int(err) != 0:
        log.warning("cudaStreamCreateWithFlags failed (%s); using onnxruntime's default stream", err)
        return None
    return int(stream)


def as_text(arr: np.ndarray) -> np.ndarray:
    """A BYTES tensor as onnxruntime's string tensors take it: each element a str, decoded from UTF-8 exactly.
    onnxruntime turns a bytes element into its repr ("b'...'") and numpy's fixed-width strings would cut at a NUL or
    refuse non-ASCII; an object array of str carries every character. UnicodeDecodeError for bytes that are not
    UTF-8 (the daemon refuses those with the input named before they get here: gpud.executor.validation)."""
    out = np.empty(arr.shape, dtype=object)
    flat = out.reshape(-1)
    for i, item in enumerate(arr.reshape(-1)):
        flat[i] = bytes(item).decode("utf-8") if isinstance(item, (bytes, bytearray, memoryview)) else item
    return out


class OnnxRuntimeInstance:
    """One model instance: an onnxruntime InferenceSession bound to this worker's device."""

    def __init__(self, model_path: str, config: ModelConfig, device: WorkerDevice, *, intra_op_threads: int = 0):
        import onnxruntime as ort

        opts = ort.SessionOptions()
        # A server must not spin-wait: idle onnxruntime threads would burn a core each for nothing.
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        opts.add_session_config_entry("session.inter_op.allow_spinning", "0")
        threads = config.options.intra_op_threads
        threads = intra_op_threads if threads is None else threads
        if threads > 0:
            opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        if device.has_cuda:
            preload_cuda_libraries()
        self.stream_handle = _create_stream() if device.has_cuda else None
        providers = choose_providers(device, ort.get_available_providers(), config.gpu_execution_accelerators,
                                     self.stream_handle, tf32=config.options.cuda_tf32)
        self.session = ort.InferenceSession(model_path, sess_options=opts, providers=providers)
        self.provider = self.session.get_providers()[0]
        self.config = config
        self._input_types = {i.name: i.type for i in self.session.get_inputs()}

    def run(self, inputs: dict[str, np.ndarray], output_names: Sequence[str]) -> list[np.ndarray]:
        feed: dict[str, Any] = {}
        for name, arr in inputs.items():
            if arr.dtype == np.object_ and self._input_types.get(name) == "tensor(string)":
                arr = as_text(arr)
            feed[name] = arr
        return self.session.run(output_names, feed)

    def warmup_feed(self) -> dict[str, np.ndarray] | None:
        """Zeros of batch 1 for every input, or None when a non-batch dim is variable (shape unknown)."""
        feed = {}
        for spec in self.config.inputs:
            if any(d < 0 for d in spec.dims) or spec.datatype == "BYTES":
                return None
            shape = ((1,) if self.config.batches else ()) + tuple(spec.dims)
            feed[spec.name] = np.zeros(shape, dtype=numpy_dtype(spec.datatype))
        return feed

    def close(self) -> None:
        self.session = None


class OnnxRuntimeBackend:
    """gpud.executor.backend.Backend for onnxruntime."""

    def providers(self) -> list[str]:
        import onnxruntime as ort

        return ort.get_available_providers()

    def load(self, model_path: str, config: ModelConfig, device: WorkerDevice,
             options: LoadOptions) -> OnnxRuntimeInstance:
        return OnnxRuntimeInstance(model_path, config, device, intra_op_threads=options.intra_op_threads)


BACKEND = OnnxRuntimeBackend()
