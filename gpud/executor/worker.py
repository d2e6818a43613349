"""The device worker process: one per device (a GPU, a MIG instance or the CPU).

It loads model instances and runs batches that arrive as small control messages over a pipe (gpud.executor.protocol);
the tensors themselves live in shared memory that the front end owns. Each instance runs in its own thread (and, on a
GPU, its own CUDA stream) so instances on one device overlap. A model's backend (gpud.executor.backend) is imported here
only, never in the daemon: a crash in a CUDA context takes down this worker, never the daemon.
"""
from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence

import numpy as np

from gpud.executor.backend import Backends, LoadOptions, ModelInstance
from gpud.executor.client_shm import output_bytes, read_into, write_blob
from gpud.executor.cuda_ipc import forget_in_worker
from gpud.executor.device import WorkerDevice
from gpud.executor.protocol import (Done, Exit, Failed, ForgetSegments, Hello, Infer, Load, Loaded, LoadFailed,
                               FromWorker, SetLogging, Unload, Unloaded, dumps, loads, read_inputs, write_outputs)
from gpud.executor.reshape import with_reshape
from gpud.executor.shm import Segment, ShmFull
from gpud.executor.types import InferenceError
from gpud.executor.process_log import LogSettings, configure, follow

log = logging.getLogger("gpud.worker")


class SegmentCache:
    """Attached segments by name; a slot that got a new (bigger) segment drops its old mapping."""

    def __init__(self) -> None:
        self._by_name: dict[str, Segment] = {}
        self._lock = threading.Lock()

    def get(self, name: str) -> Segment:
        with self._lock:
            seg = self._by_name.get(name)
            if seg is None:
                seg = self._by_name[name] = Segment.attach(name)
            return seg

    def forget(self, names: Sequence[str]) -> None:
        with self._lock:
            for name in names:
                seg = self._by_name.pop(name, None)
                if seg is not None:
                    seg.close()


def _rss_bytes() -> int:
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except Exception:  # noqa: BLE001 - psutil missing or /proc unreadable: the caller falls back to the estimate
        return 0


def _device_memory_used_bytes() -> int | None:
    """Memory used on this worker's (only visible) CUDA device, or None without cuda-python."""
    try:
        try:
            from cuda.bindings import runtime as cudart
        except ImportError:
            from cuda import cudart
        err, free, total = cudart.cudaMemGetInfo()
        return int(total) - int(free) if int(err) == 0 else None
    except Exception:  # noqa: BLE001 - the model's own error, whatever its type, is the answer; the worker goes on
        return None


def load_instance(backends: Backends, device: WorkerDevice, load_lock: threading.Lock,
                  msg: Load) -> tuple[ModelInstance | None, Loaded | LoadFailed]:
    """Load one instance and run it once; the model (None when the load failed) and the reply that says so. Its
    footprint is what the device's memory (or, on the CPU, the process's RSS) grew by, one load at a time."""
    config = msg.config
    start_s = time.monotonic()
    model = None
    try:
        backend = backends.for_config(config)  # an unsupported one fails the load, saying why
        with load_lock:  # one load at a time, so memory deltas belong to this instance
            before_dev = _device_memory_used_bytes() if device.has_cuda else None
            before_rss = _rss_bytes()
            model = with_reshape(backend.load(msg.model_path, config, device,
                                              LoadOptions(intra_op_threads=msg.intra_op_threads)), config)
            feed = model.warmup_feed()
            if feed is not None:
                # One warm-up run: the first request should not pay for allocator growth, and the footprint we
                # measure should include the working memory of a real run.
                model.run(feed, [o.name for o in config.outputs])
            if before_dev is not None:
                after_dev = _device_memory_used_bytes()
                memory_bytes, measured_by = max(0, (after_dev or before_dev) - before_dev), "device_memory"
            else:
                memory_bytes, measured_by = max(0, _rss_bytes() - before_rss), "process_rss"
    except Exception as exc:  # noqa: BLE001 - a bad model must not take down the worker
        if model is not None:
            model.close()
        return None, LoadFailed(msg.key, f"{type(exc).__name__}: {exc}")
    return model, Loaded(msg.key, memory_bytes, measured_by, time.monotonic() - start_s, model.provider)


def run_batch(model: ModelInstance, segment: Callable[[str], Segment], msg: Infer, key: str = "") -> Done | Failed:
    """Run one batch whose inputs lie in shared memory (`segment(name)` maps a segment), its outputs written there;
    Done with where they lie and what each phase took, or Failed saying why. Inputs in clients' regions are read
    into the input segment first, and outputs bound for clients' regions written there (gpud.executor.client_shm)."""
    try:
        t0 = time.perf_counter_ns()
        in_seg = segment(msg.in_seg)
        read_errors = _read_client_inputs(msg, in_seg) if msg.reads else ()
        feed = read_inputs(in_seg, msg.inputs)
        t1 = time.perf_counter_ns()
        results = model.run(feed, msg.outputs)
        t2 = time.perf_counter_ns()
        skip: frozenset[int] = frozenset()
        write_errors: tuple[tuple[int, str, str], ...] = ()
        if msg.writes:
            write_errors, skip = _write_client_outputs(msg, results, frozenset(i for i, _, _ in read_errors))
        outputs, ovf_seg = write_outputs(segment(msg.out_seg), msg.outputs, msg.output_types, results, skip)
        t3 = time.perf_counter_ns()
    except Exception as exc:  # noqa: BLE001 - the model's own error, whatever its type, is the answer; the worker goes on
        if isinstance(exc, InferenceError):  # a client's region that no longer holds what it said
            return Failed(msg.seq, exc.kind.name, exc.message)
        if isinstance(exc, ShmFull):  # no room for outputs larger than its region: retry, or give gpud more
            return Failed(msg.seq, "UNAVAILABLE", f"could not write the batch's outputs: {exc}")
        kind = "INVALID_ARGUMENT" if type(exc).__name__ in ("InvalidArgument", "Fail") else "INTERNAL"
        log.debug("instance %s: batch %s failed:\n%s", key or msg.key, msg.seq, traceback.format_exc())
        return Failed(msg.seq, kind, f"{type(exc).__name__}: {exc}")
    return Done(msg.seq, outputs, ovf_seg, t1 - t0, t2 - t1, t3 - t2, write_errors, read_errors)


def _read_client_inputs(msg: Infer, in_seg: Segment) -> tuple[tuple[int, str, str], ...]:
    """The batch's inputs in clients' regions copied into its segment. A read that fails (a region truncated or
    unregistered since the request came, a CUDA handle that does not open here) fails its request alone: its rows
    are zeroed so the batch runs on defined data, and its other reads are skipped."""
    errors: list[tuple[int, str, str]] = []
    failed: set[int] = set()
    for offset, path, src_offset, nbytes, owner in msg.reads:
        dest = in_seg.buf[offset:offset + nbytes]
        if owner not in failed:
            try:
                read_into(path, src_offset, dest, "an input in shared memory")
                continue
            except InferenceError as exc:
                failed.add(owner)
                errors.append((owner, exc.kind.name, exc.message))
        np.frombuffer(dest, dtype=np.uint8).fill(0)
    return tuple(errors)


def _write_client_outputs(msg: Infer, results: Sequence[np.ndarray],
                          failed: frozenset[int] = frozenset()) -> tuple[tuple[tuple[int, str, str], ...],
                                                                         frozenset[int]]:
    """Each request's rows of its outputs bound for clients' regions, written there; the writes that failed (that
    request fails, the others of the batch are answered), and the outputs every row of which went to regions.
    Requests in `failed` (their inputs could not be read) have nothing written."""
    errors = []
    rows_written = [0] * len(results)
    for index, (output, start, stop, path, offset, byte_size, owner) in enumerate(msg.writes):
        if owner in failed:
            continue
        arr = np.asarray(results[output])
        part = arr if stop < 0 else arr[start:stop]
        try:
            write_blob(path, offset, byte_size, output_bytes(msg.output_types[output], part), msg.outputs[output])
        except InferenceError as exc:
            errors.append((index, exc.kind.name, exc.message))
        rows_written[output] += arr.shape[0] if stop < 0 or arr.ndim == 0 else stop - start
    covered = frozenset(i for i, n in enumerate(rows_written)
                        if n and (np.ndim(results[i]) == 0 or n >= np.shape(results[i])[0]))
    return tuple(errors), covered


# A batch that ran faster than this runs its instance's next one on the reader's thread, with other instances on the
# device too: the reader then holds their next batches no longer than that.
INLINE_MAX_S = 0.002


def _rows(msg: Infer) -> int:
    """A batch's rows (its first input's first dimension; 1 for a model that does not batch or has no inputs)."""
    shape = msg.inputs[0].shape if msg.inputs else ()
    return max(1, shape[0]) if shape else 1


class _Instance:
    def __init__(self, key: str, worker: Worker):
        self.key = key
        self.worker = worker
        self.inbox: queue.SimpleQueue[Load | Infer | None] = queue.SimpleQueue()
        self.model: ModelInstance | None = None
        # Infer messages in the inbox or running on the instance thread. Unlocked: the daemon never sends an
        # instance a batch before the previous one is answered, so this thread and the reader never overlap on it.
        self.queued = 0
        # its last batch's wall time and rows: whether the next may run on the reader's thread (quick_for)
        self.last_run_s = float("inf")
        self.last_rows = 1
        self.thread = threading.Thread(target=self._loop, name=f"instance-{key}", daemon=True)

    def _loop(self) -> None:
        while True:
            msg = self.inbox.get()
            if msg is None:
                if self.model is not None:
                    self.model.close()
                self.model = None
                self.worker.send(Unloaded(self.key))
                return
            if isinstance(msg, Load):
                self._load(msg)
            else:
                self._infer(msg)
                self.queued -= 1

    def _load(self, msg: Load) -> None:
        self.model, reply = load_instance(self.worker.backends, self.worker.device, self.worker.load_lock, msg)
        self.worker.send(reply)

    def _infer(self, msg: Infer) -> None:
        model = self.model
        if model is None:  # its load failed: the daemon does not send it batches
            self.worker.send(Failed(msg.seq, "UNAVAILABLE", f"instance {self.key} is not loaded"))
            return
        t0 = time.perf_counter()
        reply = run_batch(model, self.worker.segments.get, msg, self.key)
        self.last_run_s, self.last_rows = time.perf_counter() - t0, _rows(msg)
        self.worker.send(reply)

    def quick_for(self, msg: Infer) -> bool:
        """Whether `msg` is expected to run in under INLINE_MAX_S: the last batch's time, scaled up by rows (a
        batch's time grows less than its rows, so this errs long)."""
        return self.last_run_s * max(1.0, _rows(msg) / self.last_rows) < INLINE_MAX_S


class Worker:
    def __init__(self, conn, device: WorkerDevice, backends: Backends | None = None) -> None:
        self.conn = conn
        self.device = device
        self.backends = backends if backends is not None else Backends()
        self.segments = SegmentCache()
        self.load_lock = threading.Lock()
        self._send_lock = threading.Lock()
        self.instances: dict[str, _Instance] = {}

    def send(self, msg: FromWorker) -> None:
        data = dumps(msg)
        with self._send_lock:
            self.conn.send_bytes(data)

    def serve(self) -> None:
        self.send(Hello(os.getpid(), self.backends.providers()))
        while True:
            try:
                msg = loads(self.conn.recv_bytes())
            except (EOFError, OSError):
                return  # the daemon is gone: nothing left to serve
            match msg:
                case Infer(key=key):
                    inst = self.instances.get(key)
                    if inst is None:
                        self.send(Failed(msg.seq, "UNAVAILABLE",
                                         f"instance {key} is not loaded on device {self.device.id}"))
                    elif inst.model is not None and inst.queued == 0 and \
                            (len(self.instances) == 1 or inst.quick_for(msg)):
                        # Idle, and the only instance here or a quick one: run it on this thread. A hand-off to the
                        # instance's thread costs a wake-up per batch, which is most of the overhead for small
                        # models; another instance's next batch waits at most a quick batch's time meanwhile.
                        inst._infer(msg)
                    else:
                        inst.queued += 1
                        inst.inbox.put(msg)
                case Load(key=key):
                    inst = self.instances.get(key)
                    if inst is None:
                        inst = self.instances[key] = _Instance(key, self)
                        inst.thread.start()
                    inst.inbox.put(msg)
                case Unload(key=key):
                    inst = self.instances.pop(key, None)
                    if inst is None:
                        self.send(Unloaded(key))
                    else:
                        inst.inbox.put(None)
                case ForgetSegments(names=names):
                    self.segments.forget(names)
                    forget_in_worker(names)
                case SetLogging():
                    follow(LogSettings(*msg), log)
                case Exit():
                    for inst in self.instances.values():
                        inst.inbox.put(None)
                    for inst in self.instances.values():
                        inst.thread.join(timeout=10)
                    return


def worker_main(conn, device, log_settings: LogSettings = LogSettings()) -> None:
    """Process entry point (multiprocessing spawn target)."""
    configure(log_settings, f"%(asctime)s %(levelname)s gpud.worker[{device.id} pid {os.getpid()}] %(message)s")
    try:
        Worker(conn, device).serve()
    except KeyboardInterrupt:
        pass


def _main(argv: list[str] | None = None) -> int:
    """`python -m gpud.executor.worker --fd N --device JSON`: how a supervisor starts a worker
    (gpud.executor.supervisor)."""
    import argparse
    import json
    from multiprocessing.connection import Connection

    parser = argparse.ArgumentParser(prog="gpud-worker", description="gpud device worker (started by gpud)")
    parser.add_argument("--fd", type=int, required=True, help="socket to the daemon")
    parser.add_argument("--device", required=True, help="device description (JSON)")
    parser.add_argument("--log-settings", default="{}", help="the daemon's log settings (JSON)")
    args = parser.parse_args(argv)
    worker_main(Connection(args.fd), WorkerDevice(**json.loads(args.device)),
                LogSettings(**json.loads(args.log_settings)))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
