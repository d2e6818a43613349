"""A device whose model instances run in the daemon's own process: what the in-process server (gpud.Server with
`models_in_process=True`) uses for the CPU instead of a worker process.

It answers the schedulers as a WorkerSupervisor does (`load`, `submit(batch, callback)`, `unload`, `stop`, the busy
time and the instances the pool reads) and runs the worker's own code for a load and a batch (gpud.executor.worker's
`load_instance`, `run_batch`), with the batch in the instance's shared-memory segments as always; what it leaves out
is the process: no messages, no pipe, no wake-up of another process per batch. That round trip is most of a small
model's serving cost (docs/benchmarks.md, the in-process rows).

Where a batch runs. One expected to be short (the instance's last batch took at most `inline_max_s`, scaled by rows)
runs at once on the event loop's thread: handing it to another thread and back would cost two thread wake-ups
(20-45 µs on a VM), and the loop is held no longer than that bound. A longer one runs on the instance's own thread
and its answer comes back to the loop. Either way the callback is called from the loop, never inside `submit`.

What the process boundary gave and this does not: a crash in a model's runtime takes the application down, and a
hung batch cannot be killed (there is no hang watch; an instance thread's batch runs to its end). Loads run on a
thread, one at a time, and measure the footprint as the process's RSS growth (other threads allocating at that
moment count too).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Callable
from collections.abc import Sequence
from functools import partial
from typing import cast

import numpy as np

from gpud.executor.backend import Backends, ModelInstance
from gpud.executor.busy import BusyTracker
from gpud.executor.channel import Reply
from gpud.executor.device import WorkerDevice
from gpud.executor.instance import InstanceHandle, LentInstance
from gpud.executor.protocol import Done, Failed, Infer, Load, Loaded
from gpud.executor.model_config import execution_config
from gpud.executor.shm import Segment
from gpud.executor.types import ErrorKind, InferenceError
from gpud.executor.worker import load_instance, run_batch

log = logging.getLogger("gpud.executor")

DEFAULT_INLINE_MAX_S = 0.001


def runs_inline(last_run_s: float, last_rows: int, rows: int, inline_max_s: float) -> bool:
    """Whether a batch of `rows` should run on the loop's thread: its time, estimated as the last batch's scaled by
    rows (an over-estimate: batching makes rows cheaper), is within `inline_max_s`."""
    return last_run_s * max(1.0, rows / max(1, last_rows)) <= inline_max_s


def wake(loop: asyncio.AbstractEventLoop | None, callback: Callable[[], object]) -> None:
    """`callback` to run on the loop, from a caller's thread; nothing once the loop is closed (the server stopped,
    and nothing waits any more)."""
    if loop is None:
        return
    try:
        loop.call_soon_threadsafe(callback)
    except RuntimeError:
        pass


class LocalInstance:
    """One loaded instance: its model, its thread (made for its first batch too long to run inline), its last run.
    A LentInstance while a caller's thread runs it."""

    __slots__ = ("inst", "model", "thread", "last_run_s", "last_rows", "direct_runs", "direct_over")

    def __init__(self, inst: InstanceHandle, model: ModelInstance, warmup_s: float):
        self.inst = inst
        self.model = model
        self.thread: concurrent.futures.ThreadPoolExecutor | None = None
        self.last_run_s = warmup_s
        self.last_rows = 1
        self.direct_runs = 0  # callers running it in their threads now (gpud.executor.direct)
        self.direct_over: asyncio.Future | None = None  # an unload waiting for them

    def run(self, inputs: dict[str, np.ndarray], output_names: Sequence[str]) -> list[np.ndarray]:
        return list(self.model.run(inputs, output_names))

    def note_run(self, seconds: float, rows: int) -> None:
        """A batch of `rows` took `seconds`: the next one's estimate starts from it."""
        self.last_run_s = seconds
        self.last_rows = rows

    def segment(self, name: str) -> Segment:
        """The instance's input or output segment by name (a batch is staged just before it is submitted)."""
        inst = self.inst
        for seg in (inst.in_seg, inst.out_seg):
            if seg is not None and seg.name == name:
                return seg
        raise LookupError(f"segment {name} is not one of instance {inst.key}'s")


class LocalWorker:
    """The instances of one device, run in this process (see the module's docstring): a DeviceWorker."""

    in_process = True

    def __init__(self, device: WorkerDevice, *, clock: Callable[[], float] = time.monotonic,
                 backends: Backends | None = None, inline_max_s: float = DEFAULT_INLINE_MAX_S):
        if device.has_cuda:
            # A CUDA process sees the MIG instance it was started for; the daemon's process is started for none.
            raise ValueError(f"device {device.id}: only the CPU and simulated devices run in-process")
        self.device = device
        self.clock = clock
        self.backends = backends if backends is not None else Backends()
        self.inline_max_s = inline_max_s
        self.pid = os.getpid()  # where its instances run: this process
        self.alive = False
        self.restarts = 0
        self.failures = {"died": 0, "hung": 0}
        self.unhealthy_reason: str | None = None
        self.providers: tuple[str, ...] = ()
        self.instances: dict[str, InstanceHandle] = {}
        self.busy = BusyTracker(clock)
        self._load_lock = threading.Lock()
        self._local: dict[str, LocalInstance] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        loop = self._loop
        if loop is None:
            raise InferenceError(ErrorKind.UNAVAILABLE, f"device {self.device.id}: in-process runner not started")
        return loop

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.providers = tuple(self.backends.providers())
        self.alive = True
        log.info("device %s: instances run in this process (pid %d; execution providers: %s)", self.device.id,
                 self.pid, ", ".join(self.providers) or "none")

    async def load(self, inst: InstanceHandle) -> None:
        """Load `inst` (one of self.instances) on a thread; it is ready after, or `inst.error` says why not."""
        msg = Load(inst.key, inst.model_path, execution_config(inst.config))
        model, reply = await asyncio.to_thread(load_instance, self.backends, self.device, self._load_lock, msg)
        if model is not None:
            assert isinstance(reply, Loaded)  # a model comes with its Loaded
            if inst.key in self.instances:
                # The warm-up's share of the load time is unknown; the load time bounds it, so a model that loads
                # slowly starts on its thread and moves inline once a batch shows it is quick.
                self._local[inst.key] = LocalInstance(inst, model, reply.load_seconds)
            else:  # unloaded while it loaded
                model.close()
        inst.apply_load_reply(reply)

    def submit(self, msg: Infer, callback: Callable[[Reply], None]) -> None:
        """Run a batch; `callback` gets Done or Failed, from the event loop, after this returns."""
        local = self._local.get(msg.key)
        if local is None or not self.alive:
            raise InferenceError(ErrorKind.UNAVAILABLE,
                                 f"instance {msg.key} is not loaded on device {self.device.id}")
        # Rows as the batcher counts them (a model that does not batch runs one request: one row), as a caller's own
        # run notes them too: the estimate compares like with like.
        rows = msg.inputs[0].shape[0] if local.inst.config.batches and msg.inputs and msg.inputs[0].shape else 1
        self.busy.begin()
        if runs_inline(local.last_run_s, local.last_rows, rows, self.inline_max_s):
            reply = self._run(local, msg, rows)
            self._running_loop().call_soon(self._finish, callback, reply)
            return
        if local.thread is None:
            local.thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"instance-{msg.key}")
        loop = self._running_loop()

        def run() -> None:
            reply = self._run(local, msg, rows)
            loop.call_soon_threadsafe(self._finish, callback, reply)

        local.thread.submit(run)

    def _run(self, local: LocalInstance, msg: Infer, rows: int) -> Done | Failed:
        reply = run_batch(local.model, local.segment, msg)
        if isinstance(reply, Done):
            local.note_run((reply.input_ns + reply.infer_ns + reply.output_ns) / 1e9, rows)
        return reply

    # --- runs in a caller's thread (gpud.executor.direct), with the loop's lock held ----------------------------------
    def claim_direct(self, key: str, rows: int = 1, quick_only: bool = False) -> LocalInstance | None:
        """Instance `key`'s model for a caller to run a request of `rows` in its own thread, or None when it is
        not loaded here (or, `quick_only`, when the run is expected to take longer than a batch the loop runs
        itself). Counted busy until release_direct; an unload waits for it."""
        local = self._local.get(key)
        if local is None or not self.alive:
            return None
        if quick_only and not runs_inline(local.last_run_s, local.last_rows, rows, self.inline_max_s):
            return None
        local.direct_runs += 1
        self.busy.begin()
        return local

    def release_direct(self, lent: LentInstance) -> None:
        local = cast(LocalInstance, lent)  # claim_direct's
        local.direct_runs -= 1
        self.busy.end()
        over = local.direct_over
        if local.direct_runs == 0 and over is not None:
            local.direct_over = None
            wake(self._loop, partial(_resolve, over))

    def _finish(self, callback: Callable[[Reply], None], reply: Done | Failed) -> None:
        self.busy.end()
        callback(reply)

    def poll(self) -> None:
        """Nothing to read: answers come back through the loop (WorkerSupervisor.poll's counterpart)."""

    def forget_segments(self, names: list[str]) -> None:
        """Nothing to forget: a batch reads its instance's current segments (WorkerSupervisor's counterpart)."""

    async def unload(self, key: str) -> None:
        """Drop instance `key` once its running batch (if any) has ended."""
        local = self._local.pop(key, None)
        if local is None:
            return
        await self._close(local)

    async def _close(self, local: LocalInstance) -> None:
        if local.direct_runs:
            local.direct_over = self._running_loop().create_future()
            await local.direct_over
        if local.thread is not None:
            await asyncio.to_thread(local.thread.shutdown, wait=True)
        local.model.close()

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Close every instance (their batches end first: a thread cannot be killed)."""
        self.alive = False
        locals_, self._local = list(self._local.values()), {}
        try:
            await asyncio.wait_for(asyncio.gather(*(self._close(local) for local in locals_)), timeout_s)
        except TimeoutError:
            log.warning("device %s: in-process instances still running a batch after %.0f s; left to finish",
                        self.device.id, timeout_s)


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
