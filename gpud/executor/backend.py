"""Execution backends: what a worker needs from one, and which one runs a given model.

A backend loads model instances on the worker's device; an instance runs batches of numpy arrays. The worker picks a
model's backend from its configuration (Triton's `backend`, or else its `platform`) in BACKENDS; a model no entry
serves fails its load with an error that names what this build supports. Backends are imported in the worker
process only, on first use: the engines (onnxruntime, TensorRT, CUDA) never load into the daemon.

A second backend is a module with a `BACKEND` object satisfying `Backend`, plus one line in BACKENDS.
"""
from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from gpud.executor.device import WorkerDevice
from gpud.executor.model_config import ModelConfig

log = logging.getLogger("gpud.worker")


@dataclass(frozen=True)
class LoadOptions:
    """How the daemon asks an instance to be loaded, beyond its model configuration."""

    intra_op_threads: int = 0  # 0: the backend's default (the config's intra_op_thread_count parameter wins)


class ModelInstance(Protocol):
    """One loaded model instance. `run` and `close` are called from the instance's own thread, one call at a time."""

    provider: str  # what executes it, e.g. "CUDAExecutionProvider"

    def run(self, inputs: dict[str, np.ndarray], output_names: Sequence[str]) -> Sequence[np.ndarray]:
        """The named outputs, in `output_names` order, of one batch. Exceptions named InvalidArgument or Fail count
        as the client's error (the request's inputs), any other as the server's."""

    def warmup_feed(self) -> dict[str, np.ndarray] | None:
        """Inputs for one warm-up run at load (its memory counts in the footprint), or None when the shapes are
        not known."""

    def close(self) -> None:
        """Release the instance's memory."""


class Backend(Protocol):
    def providers(self) -> list[str]:
        """The execution providers this backend can use in this process (raises when the backend cannot run)."""

    def load(self, model_path: str, config: ModelConfig, device: WorkerDevice,
             options: LoadOptions) -> ModelInstance:
        """Load one instance on `device`, the only device this process sees."""


@dataclass(frozen=True)
class BackendEntry:
    name: str  # Triton's backend name (config.pbtxt `backend`)
    platforms: tuple[str, ...]  # Triton's platform names that mean this backend (config.pbtxt `platform`)
    load: Callable[[], Backend]  # imports it: called once, in the worker

    def describe(self) -> str:
        return f"{self.name} (platform {', '.join(self.platforms)})" if self.platforms else self.name


def _module(name: str) -> Callable[[], Backend]:
    return lambda: importlib.import_module(name).BACKEND


BACKENDS: tuple[BackendEntry, ...] = (
    BackendEntry("onnxruntime", ("onnxruntime_onnx",), _module("gpud.executor.onnxruntime_backend")),
)


class UnsupportedBackend(ValueError):
    """No backend serves the model's configuration."""


class Backends:
    """The backends a worker can use, imported on first use."""

    def __init__(self, entries: Iterable[BackendEntry] = BACKENDS):
        self.entries = tuple(entries)
        self._loaded: dict[str, Backend] = {}

    def entry_for(self, config: ModelConfig) -> BackendEntry:
        """The entry for a model: by its backend name when it has one, else by its platform."""
        for entry in self.entries:
            if (entry.name == config.backend) if config.backend else (config.platform in entry.platforms):
                return entry
        asked = f"backend '{config.backend}'" if config.backend else f"platform '{config.platform}'"
        supported = ", ".join(e.describe() for e in self.entries) or "none"
        raise UnsupportedBackend(f"model '{config.name}': {asked} is not supported; supported: {supported}")

    def for_config(self, config: ModelConfig) -> Backend:
        return self._backend(self.entry_for(config))

    def providers(self) -> tuple[str, ...]:
        """Every usable backend's execution providers, for the worker's hello; a backend that cannot be imported
        or used is logged and contributes none."""
        found: list[str] = []
        for entry in self.entries:
            try:
                found += [p for p in self._backend(entry).providers() if p not in found]
            except Exception as exc:  # noqa: BLE001 - one broken backend must not hide the others
                log.error("backend %s is not usable: %s", entry.name, exc)
        return tuple(found)

    def _backend(self, entry: BackendEntry) -> Backend:
        backend = self._loaded.get(entry.name)
        if backend is None:
            backend = self._loaded[entry.name] = entry.load()
        return backend
