"""A small in-process InferenceCore for front-end (HTTP/gRPC adapter) unit tests ONLY.

It computes with numpy, so adapter tests check the wire format without the batcher, the worker pool or onnxruntime.
It validates like the real core (unknown model -> NOT_FOUND, wrong dtype/shape/input names -> INVALID_ARGUMENT,
not ready -> UNAVAILABLE) and records the last InferRequest it got, so tests can assert how the adapter parsed it.
Shared by the HTTP and gRPC adapter tests: extend it, keep `FakeCore()` constructible without arguments.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpud.executor.model_config import DynamicBatching, InstanceGroup, ModelConfig, TensorSpec
from gpud.executor.datatypes import numpy_dtype
from gpud.executor.stats import Duration, ModelStats
from gpud.executor.client_shm import ClientRegions
from gpud.executor.types import ErrorKind, InferenceError, InferRequest, InferResponse, InferTensor
from gpud.core_api import (ModelMetadata, ModelStatistics, RepositoryModel, ServedModelConfig,
                           ServerMetadata)
from gpud.executor.process_log import LogSettings
from gpud.log_settings import LogControl
from gpud.tracing.settings import TraceSettings
from gpud.tracing.tracer import Tracer
from gpud.telemetry.serving import ModelState

Spec = tuple[str, str, tuple[int, ...]]  # (name, KServe datatype, dims without the batch dimension; -1 = any)


@dataclass
class FakeModel:
    name: str
    inputs: list[Spec]
    outputs: list[Spec]
    compute: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]
    max_batch_size: int = 8  # > 0: shapes carry a leading batch dimension (-1 in metadata)
    ready: bool = True
    version: str = "1"
    inference_count: int = 0
    failure_count: int = 0

    @property
    def config(self) -> ModelConfig:
        return ModelConfig(name=self.name, max_batch_size=self.max_batch_size,
                           inputs=tuple(TensorSpec(n, d, s) for n, d, s in self.inputs),
                           outputs=tuple(TensorSpec(n, d, s) for n, d, s in self.outputs),
                           instance_groups=(InstanceGroup(1, "KIND_CPU", (), f"{self.name}_0"),),
                           dynamic_batching=DynamicBatching(max_queue_delay_us=100))


def _add_sub(x: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {"OUTPUT0": x["INPUT0"] + x["INPUT1"], "OUTPUT1": x["INPUT0"] - x["INPUT1"]}


def _identity(x: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {"OUTPUT0": x["INPUT0"]}


def _explode(x: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    raise RuntimeError("backend exploded (a bug, not a client error)")


def default_models() -> list[FakeModel]:
    return [
        FakeModel("add_sub", [("INPUT0", "FP32", (4,)), ("INPUT1", "FP32", (4,))],
                  [("OUTPUT0", "FP32", (4,)), ("OUTPUT1", "FP32", (4,))], _add_sub),
        FakeModel("identity_int64", [("INPUT0", "INT64", (-1,))], [("OUTPUT0", "INT64", (-1,))], _identity),
        FakeModel("identity_bytes", [("INPUT0", "BYTES", (-1,))], [("OUTPUT0", "BYTES", (-1,))], _identity),
        FakeModel("identity_fp16", [("INPUT0", "FP16", (-1,))], [("OUTPUT0", "FP16", (-1,))], _identity,
                  max_batch_size=0),
        FakeModel("not_ready", [("INPUT0", "FP32", (4,))], [("OUTPUT0", "FP32", (4,))], _identity, ready=False),
        FakeModel("explode", [("INPUT0", "FP32", (4,))], [("OUTPUT0", "FP32", (4,))], _explode),
    ]


@dataclass
class FakeCore:
    models: dict[str, FakeModel] = field(default_factory=lambda: {m.name: m for m in default_models()})
    live: bool = True
    ready: bool = True
    last_request: InferRequest | None = None
    unloads: list[tuple[str, bool]] = field(default_factory=list)  # (model, unload_dependents), in order
    client_shm: ClientRegions = field(default_factory=ClientRegions)  # none registered; registering refused
    # the logging extension's settings, applied to no process's logging (tests read `log_control.settings`)
    log_control: LogControl = field(default_factory=lambda: LogControl(LogSettings(), apply_here=lambda s: None))
    # the trace extension's settings (with no file: tracing can be switched on only by a test that gives one)
    tracer: Tracer = field(default_factory=lambda: Tracer(TraceSettings()))

    @classmethod
    def with_models(cls, models: Iterable[FakeModel]) -> FakeCore:
        return cls(models={m.name: m for m in models})

    # --- health and metadata -------------------------------------------------------------------------------------
    def server_live(self) -> bool:
        return self.live

    def server_ready(self) -> bool:
        return self.ready

    def server_metadata(self) -> ServerMetadata:
        return ServerMetadata("gpud", "0.1.0-fake",
                              ("binary_tensor_data", "statistics", "model_repository", "model_configuration"))

    def _model(self, name: str, version: str = "") -> FakeModel:
        model = self.models.get(name)
        if model is None:
            raise InferenceError(ErrorKind.NOT_FOUND, f"unknown model '{name}'")
        if version not in ("", model.version):
            raise InferenceError(ErrorKind.NOT_FOUND, f"unknown version '{version}' of model '{name}'")
        return model

    def model_ready(self, name: str, version: str = "") -> bool:
        return self._model(name, version).ready

    def _shape(self, model: FakeModel, dims: tuple[int, ...]) -> list[int]:
        return ([-1] if model.max_batch_size > 0 else []) + list(dims)

    def model_metadata(self, name: str, version: str = "") -> ModelMetadata:
        m = self._model(name, version)
        return ModelMetadata.of(m.config, [m.version])

    def model_config(self, name: str, version: str = "") -> ServedModelConfig:
        return ServedModelConfig(self._model(name, version).config)

    def model_statistics(self, name: str = "", version: str = "") -> list[ModelStatistics]:
        models = [self._model(name, version)] if name else list(self.models.values())
        return [ModelStatistics(m.name, m.version,
                                ModelStats(success=Duration(m.inference_count), fail=Duration(m.failure_count),
                                           inference_count=m.inference_count, execution_count=m.inference_count))
                for m in models]

    def repository_index(self, ready_only: bool = False) -> list[RepositoryModel]:
        return [RepositoryModel(m.name, m.version, ModelState.READY if m.ready else ModelState.UNAVAILABLE,
                                "" if m.ready else "unloaded")
                for m in self.models.values() if m.ready or not ready_only]

    def inspect(self) -> dict[str, Any]:
        return {"devices": [{"name": "cpu", "kind": "CPU"}],
                "models": [{"name": m.name, "ready": m.ready} for m in self.models.values()]}

    def log_settings(self) -> LogSettings:
        return self.log_control.settings

    def update_log_settings(self, changes) -> LogSettings:
        return self.log_control.update(changes)

    def trace_settings(self, model_name: str = "") -> TraceSettings:
        if model_name:
            self._model(model_name)
        return self.tracer.settings(model_name)

    def update_trace_settings(self, model_name: str, changes) -> TraceSettings:
        if model_name:
            self._model(model_name)
        return self.tracer.update(model_name, changes)

    async def load_model(self, name: str, override=None) -> None:
        self.last_override = override
        self._model(name).ready = True

    async def unload_model(self, name: str, *, unload_dependents: bool = False) -> None:
        self.unloads.append((name, unload_dependents))
        self._model(name).ready = False

    # --- inference -----------------------------------------------------------------------------------------------
    def _check_input(self, model: FakeModel, tensor: InferTensor, spec: Spec) -> None:
        name, datatype, dims = spec
        if tensor.datatype != datatype:
            raise InferenceError(ErrorKind.INVALID_ARGUMENT,
                                 f"input '{name}' of model '{model.name}' has datatype {tensor.datatype}, "
                                 f"expected {datatype}")
        expected = self._shape(model, dims)
        shape = list(tensor.shape)
        if len(shape) != len(expected) or any(e != -1 and e != s for e, s in zip(expected, shape)):
            raise InferenceError(ErrorKind.INVALID_ARGUMENT,
                                 f"input '{name}' of model '{model.name}' has shape {shape}, expected {expected}")
        if model.max_batch_size > 0 and shape[0] > model.max_batch_size:
            raise InferenceError(ErrorKind.INVALID_ARGUMENT,
                                 f"batch size {shape[0]} exceeds max_batch_size {model.max_batch_size}")
        if tensor.data.shape != tuple(shape) or (datatype != "BYTES" and tensor.data.dtype != numpy_dtype(datatype)):
            raise InferenceError(ErrorKind.INTERNAL, f"adapter built a bad array for input '{name}'")

    def submit(self, request: InferRequest, done) -> None:
        """InferenceCore.submit over `infer`: one task per request (the real core needs none)."""
        task = asyncio.ensure_future(self.infer(request))

        def finished(t: asyncio.Task) -> None:
            if t.cancelled():
                done(InferenceError(ErrorKind.UNAVAILABLE, "the request was cancelled"))
            else:
                done(t.exception() or t.result())

        task.add_done_callback(finished)

    async def infer(self, request: InferRequest) -> InferResponse:
        self.last_request = request
        model = self._model(request.model_name, request.model_version)
        if not model.ready:
            raise InferenceError(ErrorKind.UNAVAILABLE, f"model '{model.name}' is not ready")
        specs = {spec[0]: spec for spec in model.inputs}
        given = {t.name: t for t in request.inputs}
        if set(given) != set(specs):
            model.failure_count += 1
            raise InferenceError(ErrorKind.INVALID_ARGUMENT,
                                 f"model '{model.name}' expects inputs {sorted(specs)}, got {sorted(given)}")
        for name, tensor in given.items():
            self._check_input(model, tensor, specs[name])
        out_specs = {spec[0]: spec for spec in model.outputs}
        wanted = [o.name for o in request.outputs] if request.outputs is not None else list(out_specs)
        for name in wanted:
            if name not in out_specs:
                raise InferenceError(ErrorKind.INVALID_ARGUMENT, f"unknown output '{name}' of model '{model.name}'")
        results = model.compute({name: t.data for name, t in given.items()})
        model.inference_count += 1
        outputs = [InferTensor(name, out_specs[name][1], tuple(results[name].shape), results[name]) for name in wanted]
        return InferResponse(model.name, model.version, outputs, id=request.id)

