"""The in-process server: gpud inside an application, with no network and no serialization on the call path.

    import gpud

    with gpud.Server(model_repository="/models") as server:
        outputs = server.infer("mlp", {"input": x})          # {"output": np.ndarray}

The components are the daemon's, built by the same code (gpud.wiring): the core, each model's dynamic batcher, the
placement engine, the device worker processes, the controller, the hints and the metrics, configured by the same
settings (any `gpud.settings.Settings` field as a keyword, or a `config=` YAML file as the daemon's `--config`).
What the daemon adds (network front ends, signals, reload, systemd) is not started.

Threads. The components live in one asyncio event loop on a thread of the server's own ("gpud-server"), as they do
in the daemon. `infer` may be called from any number of threads at once; `infer_async` from any asyncio loop. A call
builds the request in the caller's thread (the caller's numpy arrays are referenced, not copied), hands it to the
core's `submit` with one `call_soon_threadsafe`, and waits for the callback. Models run in the worker processes as
they do under the daemon: the batch is copied once into shared memory (and the outputs once out of it). With
`models_in_process=True` the CPU's and a simulated node's instances run in this process (gpud.executor.local_worker),
and a call that finds its model idle runs it in the caller's thread (gpud.executor.direct, with the loop's lock:
gpud.inprocess.loop_lock; from `infer_async` only a run under 1 ms, which holds up the caller's loop).

Errors are `gpud.executor.types.InferenceError` (also `gpud.InferenceError`), with the kind the front ends map to their
status codes (`.kind`: INVALID_ARGUMENT for a wrong shape or datatype, NOT_FOUND for an unknown model, ...) and the
same message. A call that gives up after `timeout` raises `InferenceTimeout` (an InferenceError and a TimeoutError).
"""
from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import copy
import dataclasses
import json
import logging
import os
import threading
from collections.abc import Callable, Coroutine, Iterable, Mapping
from typing import Any, TypeVar

import numpy as np

from gpud import wiring
from gpud.repository.overrides import LoadOverride
from gpud.settings import check_settings, prepare_settings
from gpud.executor.direct import DirectRun
from gpud.executor.types import ErrorKind, InferenceError, InferRequest
from gpud.core_api import ModelMetadata, ModelStatistics, RepositoryModel, ServedModelConfig
from gpud.inprocess.calls import AsyncWaiter, InferenceTimeout, Waiter, make_request, outputs_of
from gpud.inprocess.loop_lock import new_locked_loop
from gpud.settings import Settings, coerce_settings, load_settings_file

log = logging.getLogger("gpud")
T = TypeVar("T")

# Settings only the daemon's faces read: its network front ends, the admin socket and token, the ready file and the
# logging set-up (an application configures logging itself: gpud logs to the "gpud" logger).
DAEMON_ONLY_SETTINGS = frozenset({
    "http_address", "http_port", "grpc_address", "grpc_port", "metrics_address", "metrics_port",
    "allow_http", "allow_grpc", "allow_metrics", "admin_token_file", "admin_socket", "admin_open",
    "http_request_timeout_seconds", "http_max_connections", "max_request_bytes", "max_header_bytes",
    "max_tensor_elements", "json_processes", "json_offload_bytes", "log_level",
    "log_info", "log_warning", "log_error", "log_format", "ready_file",
    "allow_client_shm", "http_processes", "grpc_processes",
    "trace_file", "trace_level", "trace_rate", "trace_count", "trace_log_frequency",
})


def _new_loop() -> asyncio.AbstractEventLoop:
    """uvloop when installed (as the daemon), else asyncio's own."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class Server:
    """gpud in the application's process. Start it with `start()` (or `with`, or `async with`), stop it with
    `stop()`; a server is started once. See the module's docstring for threads, copies and errors.

    model_repository: a Triton-layout repository, as the daemon's --model-repository.
    metrics_port: serve Prometheus metrics on this port (0: any free port; `metrics_port` says which); None (the
      default): no endpoint (`metrics_text()` still gives the exposition).
    metrics_address: the metrics endpoint's address (default loopback).
    models_in_process: run the instances of devices without CUDA (the CPU, a simulated node's devices) in this
      process instead of worker processes (gpud.executor.local_worker): a batch-1 call then costs tens of microseconds
      less (no process round trip), but a crash in a model's runtime takes the application down and a hung batch
      cannot be killed. Instances on GPUs keep their worker processes either way.
    config: a YAML settings file as the daemon's --config; the settings that only the daemon's faces read (ports,
      front-end limits, logging) are ignored there and refused as keywords.
    **settings: any other field of gpud.settings.Settings (node, placement_control, model_control_mode,
      load_model, default_max_queue_size, exit_timeout_seconds, ...), over the file's.
    """

    def __init__(self, model_repository: str | os.PathLike, *, metrics_port: int | None = None,
                 metrics_address: str = "127.0.0.1", config: str | os.PathLike | None = None,
                 models_in_process: bool = False, **settings: Any):
        refused = sorted(k for k in settings if k.replace("-", "_") in DAEMON_ONLY_SETTINGS)
        if refused:
            raise ValueError(f"gpud.Server: {', '.join(refused)}: not a setting of the in-process server (it has no "
                             "network front end; the metrics endpoint is metrics_port=, logging is the "
                             "application's)")
        values = load_settings_file(os.fspath(config)) if config is not None else {}
        ignored = sorted(k for k in values if k in DAEMON_ONLY_SETTINGS)
        if ignored:
            log.info("gpud.Server: settings of the daemon's front ends in %s are not used in-process: %s", config,
                     ", ".join(ignored))
        values = {k: v for k, v in values.items() if k not in DAEMON_ONLY_SETTINGS}
        values |= coerce_settings(settings, "gpud.Server")
        values |= {"model_repository": os.fspath(model_repository), "allow_http": False, "allow_grpc": False,
                   "allow_metrics": metrics_port is not None, "metrics_address": metrics_address,
                   "metrics_port": metrics_port if metrics_port is not None else 0}
        if metrics_port is not None and not 0 <= metrics_port <= 65535:
            raise ValueError(f"gpud.Server: metrics_port must be 0..65535 or None, got {metrics_port}")
        self.settings = Settings(**values)
        self.models_in_process = bool(models_in_process)
        # With models in process, calls that find their model idle run in the caller's thread (gpud.executor.direct):
        # the loop runs holding this lock but while it waits for events (gpud.inprocess.loop_lock).
        self._loop_lock: threading.Lock | None = threading.Lock() if self.models_in_process else None
        check_settings(self.settings)
        self._prepared = prepare_settings(self.settings)  # ValueError now, not in the server's thread
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None
        self._parts: wiring.Components | None = None  # once started
        self._state = "new"  # new -> running -> stopped; changed under _lock
        self._lock = threading.Lock()
        self.metrics_port: int | None = None  # the bound metrics port, once started with metrics_port=
        self._drain_timeout_s: float | None = None  # stop()'s, else the exit_timeout_seconds setting
        self._waiting: set[Waiter | AsyncWaiter] = set()  # accepted, unanswered (read and changed in the loop only)

    # --- start and stop ---------------------------------------------------------------------------------------
    def start(self) -> Server:
        """Start the components and load the repository; returns once every model that can load is ready (the
        others are reported by `repository_index()` with the reason, as in the daemon). Raises what stops it from
        starting (a repository that is not a directory, a bad node description, a port in use)."""
        with self._lock:
            if self._state != "new":
                raise RuntimeError(f"gpud.Server is {self._state}: a server is started once")
            self._state = "starting"
        started: concurrent.futures.Future[None] = concurrent.futures.Future()
        # A daemon thread, so an application that never calls stop() can still exit: atexit stops the server
        # first (workers ended, shared memory removed).
        self._thread = threading.Thread(target=self._run, args=(started,), name="gpud-server", daemon=True)
        self._thread.start()
        try:
            started.result()
        except BaseException:
            self._thread.join()
            with self._lock:
                self._state = "stopped"
            raise
        atexit.register(self.stop)
        return self

    def stop(self, drain_timeout_s: float | None = None) -> None:
        """Refuse new requests, finish the accepted ones (up to `drain_timeout_s`, default the exit_timeout_seconds
        setting, 30 s), stop the worker processes and remove their shared memory. Returns once that is done, also
        to a second caller while the first stops it; a stopped server's stop() does nothing."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("gpud.Server.stop() called from the server's own thread (a callback): it would "
                               "wait for itself")
        with self._lock:
            if self._state not in ("running", "stopping"):
                return
            first = self._state == "running"
            if first:
                self._state = "stopping"
                self._drain_timeout_s = drain_timeout_s
        loop, stop_event, thread = self._loop, self._stop_event, self._thread
        assert loop is not None and stop_event is not None and thread is not None  # it ran
        if first:
            loop.call_soon_threadsafe(stop_event.set)
            atexit.unregister(self.stop)
        thread.join()  # a second caller waits for the first's stop too

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def __aenter__(self) -> Server:
        await asyncio.to_thread(self.start)  # loading models takes seconds: not on the application's loop
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.stop)

    @property
    def running(self) -> bool:
        return self._state == "running"

    def _run(self, started: concurrent.futures.Future) -> None:
        lock = self._loop_lock
        if lock is not None:
            lock.acquire()
        loop = _new_loop() if lock is None else new_locked_loop(lock)
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._serve(started))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            loop.close()
            if lock is not None:
                lock.release()
            if not started.done():
                started.set_exception(RuntimeError("the gpud server thread ended before it started"))

    async def _serve(self, started: concurrent.futures.Future) -> None:

        self._loop = asyncio.get_running_loop()
        self._stop_event = asyncio.Event()
        try:
            parts = wiring.build(self._prepared, models_in_process=self.models_in_process)
        except BaseException as exc:  # noqa: BLE001 - the caller's thread gets whatever was raised
            started.set_exception(exc)
            return
        metrics_runner = None
        try:
            await parts.start()
            if self.settings.allow_metrics:
                metrics_runner, self.metrics_port = await wiring.start_metrics(
                    parts, self.settings.metrics_address, self.settings.metrics_port)
                log.info("gpud.Server: metrics on http://%s:%d/metrics", self.settings.metrics_address,
                         self.metrics_port)
        except BaseException as exc:  # noqa: BLE001 - the caller's thread gets whatever was raised
            await parts.shutdown(0)
            started.set_exception(exc)
            return
        self._parts = parts
        parts.serving()
        with self._lock:
            self._state = "running"
        started.set_result(None)
        log.info("gpud.Server ready: %d model version(s) serving in-process",
                 sum(1 for v in parts.registry.versions() if v.ready))
        await self._stop_event.wait()
        drain_s = self._drain_timeout_s if self._drain_timeout_s is not None else self.settings.exit_timeout_seconds
        await parts.shutdown(drain_s)
        if metrics_runner is not None:
            await metrics_runner.cleanup()
        # Shutdown answers every accepted request (drained, or failed once the drain time is up); should one still
        # be unanswered, its caller must not wait forever.
        for waiter in list(self._waiting):
            waiter.done(InferenceError(ErrorKind.UNAVAILABLE, "the in-process gpud server stopped before this "
                                                              "request was answered"))
        with self._lock:
            # From here on a call is refused in the caller's thread; a call queued on the loop before this still
            # runs (the loop runs its ready callbacks before it ends) and is refused by the core, which is stopping.
            self._state = "stopped"
        log.info("gpud.Server stopped")

    # --- inference --------------------------------------------------------------------------------------------
    def infer(self, model: str, inputs: Mapping[str, Any], version: str | int = "",
              outputs: Iterable[str] | None = None, timeout: float | None = None,
              priority: int = 0, parameters: Mapping[str, Any] | None = None) -> dict[str, np.ndarray]:
        """Run `inputs` (input name -> numpy array, batch dimension first where the model batches) through
        `model` and return every output (or those named in `outputs`) by name. Blocks the calling thread; safe
        from many threads at once (their requests batch together). `version` "": the version policy's choice.
        `timeout` seconds (None: no limit) raises InferenceTimeout. `priority`: the model's priority level (0:
        its default). `parameters`: as a front end's request parameters, e.g. a sequence model's
        {"sequence_id": 7, "sequence_start": True}. Raises InferenceError as the front ends answer it."""
        request = make_request(model, inputs, version, outputs, priority, parameters)
        waiter = Waiter(self._waiting)
        if timeout is not None or not self._submit_here(request, waiter):
            self._send(self._submit, request, waiter)
        if not waiter.lock.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            self._withdraw(waiter)
            raise InferenceTimeout(f"no answer from model '{model}' within {timeout:g} s")
        result = waiter.result
        if isinstance(result, InferenceError):
            raise result
        assert result is not None  # the lock is released once it is answered
        return outputs_of(result)

    async def infer_async(self, model: str, inputs: Mapping[str, Any], version: str | int = "",
                          outputs: Iterable[str] | None = None, timeout: float | None = None,
                          priority: int = 0, parameters: Mapping[str, Any] | None = None) -> dict[str, np.ndarray]:
        """`infer` for asyncio code: awaits the answer without blocking the caller's loop. Cancelling the awaiting
        task withdraws a request that is still queued."""
        request = make_request(model, inputs, version, outputs, priority, parameters)
        waiter = AsyncWaiter(asyncio.get_running_loop(), self._waiting)
        # A caller's own run holds up this loop: only one as short as the server's loop runs itself.
        if timeout is not None or not self._submit_here(request, waiter, quick_only=True):
            self._send(self._submit, request, waiter)
        try:
            if timeout is None:
                result = await waiter.future
            else:
                result = await asyncio.wait_for(waiter.future, max(0.0, timeout))
        except TimeoutError:
            self._withdraw(waiter)
            raise InferenceTimeout(f"no answer from model '{model}' within {timeout:g} s") from None
        except asyncio.CancelledError:
            self._withdraw(waiter)
            raise
        return outputs_of(result)

    def _submit(self, request: InferRequest, waiter: Waiter | AsyncWaiter) -> None:
        """In the server's loop: the request to the core; a refusal (unknown model, bad input, full queue) answers
        the caller at once."""
        try:
            waiter.cancel = self._components.core.submit(request, waiter.done)
            self._waiting.add(waiter)
        except InferenceError as exc:
            waiter.done(exc)
        except Exception as exc:  # a bug must not leave the caller waiting forever
            log.exception("gpud.Server: submitting a request to model %s failed", request.model_name)
            waiter.done(InferenceError(ErrorKind.INTERNAL, f"submitting the request failed: {exc!r}"))

    def _submit_here(self, request: InferRequest, waiter: Waiter | AsyncWaiter, quick_only: bool = False) -> bool:
        """With models in process, when the loop waits for events: act for it from this thread (gpud.executor.direct),
        running the model here if the request is taken. True when the request was handled here (answered or
        queued); False when it must go the loop's way (no models in process, or the loop is at work)."""
        lock = self._loop_lock
        if lock is None or not lock.acquire(blocking=False):
            return False
        try:
            run = self._submit_direct(request, waiter, quick_only)
        finally:
            lock.release()
        if run is not None:
            try:
                run.execute()  # the model runs here, without the lock
            finally:
                with lock:
                    run.finish()  # answers the waiter, frees the instance (also when interrupted)
        return True

    def _submit_direct(self, request: InferRequest, waiter: Waiter | AsyncWaiter,
                       quick_only: bool = False) -> DirectRun | None:
        """With the loop's lock held, in the caller's thread: the request to the core's direct path; a DirectRun
        for the caller to execute, or None when the request was answered, queued, or sent the loop's way."""
        if self._state != "running":
            raise InferenceError(ErrorKind.UNAVAILABLE, self._not_running())
        try:
            started = self._components.core.submit_direct(request, waiter.done, self._event_loop(), quick_only)
        except InferenceError as exc:
            waiter.done(exc)
            return None
        except Exception as exc:  # a bug must not leave the caller waiting forever
            log.exception("gpud.Server: submitting a request to model %s failed", request.model_name)
            waiter.done(InferenceError(ErrorKind.INTERNAL, f"submitting the request failed: {exc!r}"))
            return None
        if started is None:
            self._event_loop().call_soon_threadsafe(self._submit, request, waiter)
            return None
        self._waiting.add(waiter)
        if isinstance(started, DirectRun):
            return started
        waiter.cancel = started
        return None

    def _withdraw(self, waiter: Waiter | AsyncWaiter) -> None:
        def withdraw() -> None:
            if waiter.cancel is not None and waiter in self._waiting:
                self._waiting.discard(waiter)
                waiter.cancel()
        try:
            self._event_loop().call_soon_threadsafe(withdraw)
        except RuntimeError:  # the loop has ended: nothing is queued any more
            pass

    def _send(self, fn: Callable[..., None], *args: Any) -> None:
        """Run `fn(*args)` in the server's loop (FIFO with every other call); refused unless the server runs."""
        if self._state != "running":
            raise InferenceError(ErrorKind.UNAVAILABLE, self._not_running())
        if threading.current_thread() is self._thread:
            raise RuntimeError("gpud.Server called from the server's own thread (a callback): it would wait for "
                               "itself")
        try:
            self._event_loop().call_soon_threadsafe(fn, *args)
        except RuntimeError:  # closed between the check and the call
            raise InferenceError(ErrorKind.UNAVAILABLE, self._not_running()) from None

    @property
    def _components(self) -> wiring.Components:
        """What runs (read in the server's loop, where it exists once started)."""
        parts = self._parts
        if parts is None:
            raise InferenceError(ErrorKind.UNAVAILABLE, self._not_running())
        return parts

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        loop = self._loop
        if loop is None:
            raise InferenceError(ErrorKind.UNAVAILABLE, self._not_running())
        return loop

    def _not_running(self) -> str:
        if self._state in ("new", "starting"):
            return "the in-process gpud server is not started (call start(), or use it in a with block)"
        return "the in-process gpud server is stopped"

    # --- everything else, run in the server's loop -----------------------------------------------------------
    def _call(self, fn: Callable[[], T]) -> T:
        result: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            try:
                result.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - the caller's thread gets whatever was raised
                result.set_exception(exc)
        self._send(run)
        return result.result()

    def _coroutine(self, fn: Callable[[], Coroutine[Any, Any, T]]) -> concurrent.futures.Future[T]:
        if self._state != "running":
            raise InferenceError(ErrorKind.UNAVAILABLE, self._not_running())
        if threading.current_thread() is self._thread:
            raise RuntimeError("gpud.Server called from the server's own thread (a callback): it would wait for "
                               "itself")
        coroutine = fn()
        try:
            return asyncio.run_coroutine_threadsafe(coroutine, self._event_loop())
        except RuntimeError:  # the loop ended between the check and the call
            coroutine.close()
            raise InferenceError(ErrorKind.UNAVAILABLE, self._not_running()) from None

    def ready(self) -> bool:
        """Whether the server serves (started, not stopping)."""
        try:
            return self._call(lambda: self._components.core.server_ready())
        except InferenceError:  # not running
            return False

    def model_ready(self, name: str, version: str | int = "") -> bool:
        return self._call(lambda: self._components.core.model_ready(name, str(version)))

    def model_metadata(self, name: str, version: str | int = "") -> ModelMetadata:
        return self._call(lambda: self._components.core.model_metadata(name, str(version)))

    def model_config(self, name: str, version: str | int = "") -> ServedModelConfig:
        return self._call(lambda: self._components.core.model_config(name, str(version)))

    def model_statistics(self, name: str = "", version: str | int = "") -> list[ModelStatistics]:
        """Triton's statistics of the model's versions (every model's with name ""): copies taken in the loop, so
        they do not change under the caller."""
        return self._call(lambda: [dataclasses.replace(s, stats=copy.deepcopy(s.stats))
                                   for s in self._components.core.model_statistics(name, str(version))])

    def repository_index(self, ready_only: bool = False) -> list[RepositoryModel]:
        """Every model in the repository with its state, and why it is not ready."""
        return self._call(lambda: self._components.core.repository_index(ready_only))

    def inspect(self) -> dict[str, Any]:
        """What `gpudctl inspect` shows: devices, placements, instances, queues, hints, the controller."""
        return self._call(lambda: self._components.core.inspect())

    def metrics_text(self) -> str:
        """The Prometheus exposition, as the metrics endpoint answers it (read in the server's loop)."""
        from gpud.api.metrics_server import exposition

        return self._call(lambda: exposition(self._components.metrics_registry,
                                             self._components.text_sources()).decode("utf-8"))

    def load_model(self, name: str, config: str | Mapping[str, Any] | None = None,
                   files: Mapping[str, bytes] | None = None) -> None:
        """Load (or reload) a model from the repository, as POST /v2/repository/models/NAME/load: the model
        control mode must be explicit or poll (UNAVAILABLE otherwise). `config` (model_config.proto's ModelConfig as
        JSON text or a mapping) replaces config.pbtxt for this load, and `files` ({"1/model.onnx": bytes, ...}) the
        model directory, as Triton's load parameters (explicit mode)."""
        override = _override(config, files)
        self._coroutine(lambda: self._components.core.load_model(name, override)).result()

    def unload_model(self, name: str) -> None:
        """Unload a model: its accepted requests finish first."""
        self._coroutine(lambda: self._components.core.unload_model(name)).result()

    async def load_model_async(self, name: str, config: str | Mapping[str, Any] | None = None,
                               files: Mapping[str, bytes] | None = None) -> None:
        override = _override(config, files)
        await asyncio.wrap_future(self._coroutine(lambda: self._components.core.load_model(name, override)))

    async def unload_model_async(self, name: str) -> None:
        await asyncio.wrap_future(self._coroutine(lambda: self._components.core.unload_model(name)))


def _override(config: str | Mapping[str, Any] | None, files: Mapping[str, bytes] | None) -> LoadOverride | None:
    """A load's override from the in-process API's arguments; ValueError for a bad one."""
    if config is None and not files:
        return None
    text = config if isinstance(config, str) or config is None else json.dumps(dict(config))
    return LoadOverride(text, dict(files or {}))
