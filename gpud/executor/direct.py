"""A request run in its caller's thread: the in-process server's path for a call that finds its model idle.

The event loop owns the schedulers; a caller on another thread normally hands its request to the loop and sleeps
until the loop hands the answer back: two thread wake-ups, 20-45 µs each on a VM, which is most of a small model's
serving cost in-process (docs/benchmarks.md). gpud.Server with models in process runs its loop holding a lock that it
lets go only while it waits for events (gpud.inprocess.loop_lock), so a caller that takes that lock IS the loop for
that moment and may use the scheduler directly:

1. (lock held) `start_direct`: when the model's queue is empty and a free instance runs in this process, the request
   is queued and the batcher asked as the loop would ask it; if it dispatches this request alone at once (what it
   does with a lone request on an idle instance: gpud.executor.batcher rule 6), the instance is taken for it.
2. (lock released) `DirectRun.execute`: the caller's thread runs the model on the request's own arrays: no shared
   memory, no copy of a batch of one. The loop goes on meanwhile; requests that arrive queue for the instance.
3. (lock held) `DirectRun.finish`: the instance is freed, the statistics record the batch, the request is answered
   (its `done`, in this thread), and the loop is woken only if it has something to do (requests queued meanwhile, a
   shutdown waiting for idle).

Anything else (a request the batcher would hold for a batch, a busy model, a sequence or an ensemble, BYTES tensors,
an instance in a worker process) takes the loop's path; the answer is the same either way.
"""
from __future__ import annotations

import asyncio
import time

import numpy as np

from gpud.executor.datatypes import numpy_dtype
from gpud.executor.instance import InstanceHandle, LentInstance
from gpud.executor.model_config import TensorSpec
from gpud.executor.local_worker import wake
from gpud.executor.scheduler import DirectPath, Done, Pending, Scheduler
from gpud.executor.types import ErrorKind, InferenceError, InferRequest


def _dtype(spec: TensorSpec | None) -> np.dtype:
    assert spec is not None  # the request was checked against the config (validation), its outputs too
    return numpy_dtype(spec.datatype)


class DirectRun:
    """One request taken by its caller (phase 2 and 3 above)."""

    __slots__ = ("scheduler", "pending", "inst", "local", "loop", "outputs", "error", "input_ns", "infer_ns",
                 "output_ns")

    def __init__(self, scheduler: DirectPath, pending: Pending, inst: InstanceHandle, local: LentInstance,
                 loop: asyncio.AbstractEventLoop):
        self.scheduler = scheduler
        self.pending = pending
        self.inst = inst
        self.local = local
        self.loop = loop
        self.outputs: list[np.ndarray] = []
        self.error: InferenceError | None = None
        self.input_ns = self.infer_ns = self.output_ns = 0

    def execute(self) -> None:
        """Run the model in this thread (without the lock). `finish` must follow, whatever this raises."""
        config = self.scheduler.config
        prepared = self.pending.prepared
        try:
            t0 = time.perf_counter_ns()
            feed = {name: np.ascontiguousarray(arr, dtype=_dtype(config.input(name)))
                    for name, arr in prepared.inputs.items()}
            t1 = time.perf_counter_ns()
            results = self.local.run(feed, prepared.output_names)
            t2 = time.perf_counter_ns()
            self.outputs = [np.asarray(arr, dtype=_dtype(config.output(name)))
                            for name, arr in zip(prepared.output_names, results)]
            t3 = time.perf_counter_ns()
        except Exception as exc:  # noqa: BLE001 - the model's own error, whatever its type, is the request's answer
            kind = ErrorKind.INVALID_ARGUMENT if type(exc).__name__ in ("InvalidArgument", "Fail") else \
                ErrorKind.INTERNAL
            self.error = InferenceError(kind, f"model '{config.name}' failed: {type(exc).__name__}: {exc}")
            return
        except BaseException:  # the caller interrupted (KeyboardInterrupt): finish() still frees the instance
            self.error = InferenceError(ErrorKind.UNAVAILABLE, f"the call to model '{config.name}' was interrupted")
            raise
        self.input_ns, self.infer_ns, self.output_ns = t1 - t0, t2 - t1, t3 - t2

    def finish(self) -> None:
        """Free the instance, record and answer (with the lock held again)."""
        worker = self.inst.worker
        if worker is not None:
            worker.release_direct(self.local)
        if self.error is None:
            self.local.note_run((self.input_ns + self.infer_ns + self.output_ns) / 1e9,
                                self.pending.prepared.batch_rows)
        if self.scheduler.end_direct(self.inst, self.pending, self.outputs if self.error is None else self.error,
                                     self.input_ns, self.infer_ns, self.output_ns):
            wake(self.loop, self.scheduler.step)


def start_direct(scheduler: Scheduler, request: InferRequest, done: Done, loop: asyncio.AbstractEventLoop,
                 quick_only: bool = False) -> DirectRun | Pending | None:
    """Phase 1, with the loop's lock held. A DirectRun for the caller to execute; or the request's handle when it
    was queued the loop's way (the batcher holds it for a batch; `done` answers it, `scheduler.cancel(handle)`
    withdraws it); or None when it was not taken (nothing queued: the caller submits it the loop's way). Bad input
    raises as `submit` does. `quick_only`: only a run expected to be as short as one the loop runs itself (a caller
    on an event loop, which the run holds up)."""
    path = scheduler.direct_path()
    inst = path.idle_instance() if path is not None else None
    worker = inst.worker if inst is not None and inst.ready else None
    if path is None or inst is None or worker is None:
        return None
    rows = request.inputs[0].shape[0] if path.config.batches and request.inputs and request.inputs[0].shape else 1
    local = worker.claim_direct(inst.key, rows, quick_only)
    if local is None:
        return None
    try:
        pending, taken = path.begin_direct(request, done, inst)
    except BaseException:
        worker.release_direct(local)
        raise
    if not taken:
        worker.release_direct(local)
        wake(loop, path.step)  # the loop arms the batcher's timer
        return pending
    return DirectRun(path, pending, inst, local, loop)
