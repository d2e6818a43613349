"""The serving path on each leaf device, through gpud's own executor pool: the check model loads, computes what
onnxruntime on the CPU computes, takes the memory gpud says it takes, serves about as fast as raw onnxruntime on the
same device, overlaps with a second instance, and runs on the execution provider the device calls for.

Everything here is the daemon's code (gpud.executor.pool, gpud.executor.scheduler, the worker); only the HTTP front end
is left out, so what is measured is the pool and the batcher, not a client.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from gpud.executor.device import WorkerDevice
from gpud.executor.instance import InstanceHandle
from gpud.executor.model_config import ModelConfig
from gpud.executor.datatypes import numpy_dtype
from gpud.executor.onnxruntime_backend import CPU_EP, CUDA_EP, TRT_EP
from gpud.executor.pool import ExecutorPool
from gpud.executor.dynamic_scheduler import DynamicScheduler
from gpud.executor.supervisor import worker_env
from gpud.executor.types import InferenceError, InferRequest, InferTensor
from gpud.cli.check.progress import QUIET, Progress
from gpud.cli.check.report import Row, Status
from gpud.examples import write_example_repository
from gpud.repository.footprint import estimate_footprint_bytes
from gpud.repository.layout import ModelEntry, load_model
from gpud.telemetry.devices import DeviceInfo

log = logging.getLogger("gpud.check")

CHECK_MODEL = "mlp"  # gpud.examples: FP32 256 -> 1024 -> 1024 -> 16, max_batch_size 64
MIB = 2**20
GPU_PROVIDERS = (CUDA_EP, TRT_EP)


@dataclass(frozen=True)
class ServingOptions:
    batch_sizes: tuple[int, ...] = (1, 2, 8, 32, 64)
    seconds: float = 1.0  # per throughput point
    concurrency: int = 2  # requests in flight per instance: one runs while the next waits
    min_served_ratio: float = 0.9  # served rows/s at the best batch size over raw onnxruntime's
    min_overlap_gain: float = 1.05  # two instances on one GPU over one, at batch 1
    atol: float = 1e-4  # outputs against onnxruntime on the CPU (FP32), relative to the output's magnitude
    footprint_tolerance_bytes: int = 16 * MIB  # gpud's measured footprint against NVML's delta: the larger of
    footprint_tolerance_ratio: float = 0.10  # these two


RawRunner = Callable[[WorkerDevice, str, Sequence[int], float], dict]
"""(device, model directory, batch sizes, seconds) -> {"provider": ..., "rows_per_s": {"<batch>": rows/s}}."""


def subprocess_raw(device: WorkerDevice, model_dir: str, batch_sizes: Sequence[int], seconds: float) -> dict:
    """Raw onnxruntime in its own process with the device's worker environment (one CUDA device visible)."""
    cmd = [sys.executable, "-m", "gpud.cli.check.raw", "--device", json.dumps(dataclasses.asdict(device)),
           "--model-dir", model_dir, "--batch-sizes", ",".join(map(str, batch_sizes)), "--seconds", str(seconds)]
    timeout_s = 120 + 4 * seconds * len(batch_sizes)
    proc = subprocess.run(cmd, env=worker_env(device), capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        said = proc.stderr.strip().splitlines()
        raise RuntimeError(f"raw onnxruntime failed (exit {proc.returncode}): {said[-1] if said else 'no message'}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _mib(n: float | None) -> str:
    return "N/A" if n is None else f"{n / MIB:.1f} MiB"


def _feed(config: ModelConfig, rows: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {s.name: rng.standard_normal((rows, *s.dims)).astype(numpy_dtype(s.datatype)) for s in config.inputs}


def _request(config: ModelConfig, feed: dict[str, np.ndarray]) -> InferRequest:
    specs = {s.name: s for s in config.inputs}
    return InferRequest(config.name, [InferTensor(n, specs[n].datatype, a.shape, a) for n, a in feed.items()])


def limit_batch(config: ModelConfig, batch: int) -> ModelConfig:
    """The config with `batch` as its batch limit (preferred sizes above it dropped)."""
    db = config.dynamic_batching
    if db is not None:
        db = dataclasses.replace(db, preferred_batch_sizes=tuple(p for p in db.preferred_batch_sizes if p <= batch))
    return dataclasses.replace(config, max_batch_size=batch, dynamic_batching=db)


async def served_rows_per_s(config: ModelConfig, instances: list[InstanceHandle], batch: int, seconds: float,
                            concurrency: int, rng: np.random.Generator) -> float:
    """Rows/s through gpud's batcher and pool: requests of `batch` rows (the batch limit, so one request is one
    batch), `concurrency` in flight per instance, for `seconds` after a warm-up of a fifth of that (at least 0.2 s,
    as raw onnxruntime's)."""
    scheduler = DynamicScheduler(limit_batch(config, batch), "1")
    for inst in instances:
        scheduler.add_instance(inst)
    try:
        feed = _feed(config, batch, rng)
        rows = 0

        async def client(until_s: float) -> None:
            nonlocal rows
            while time.perf_counter() < until_s:
                await scheduler.infer(_request(config, feed))
                rows += batch

        clients = concurrency * len(instances)
        await asyncio.gather(*(client(time.perf_counter() + max(0.2, seconds / 5)) for _ in range(clients)))
        rows = 0
        t0 = time.perf_counter()
        await asyncio.gather(*(client(t0 + seconds) for _ in range(clients)))
        return rows / (time.perf_counter() - t0)
    finally:
        for inst in instances:
            scheduler.remove_instance(inst)


class ServingCheck:
    """The serving checks of one run: the check model written once, then device after device."""

    def __init__(self, backend, pool: ExecutorPool, workdir: str, options: ServingOptions = ServingOptions(),
                 raw: RawRunner = subprocess_raw):
        self.backend = backend
        self.pool = pool
        self.options = options
        self.raw = raw
        write_example_repository(workdir, [CHECK_MODEL])
        self.model_dir = os.path.join(workdir, CHECK_MODEL)
        self.entry: ModelEntry = load_model(self.model_dir)
        self.config = self.entry.config
        self.model_path = self.entry.model_path()
        self.estimate_bytes = estimate_footprint_bytes(self.model_path, self.config)
        self.batch_sizes = tuple(b for b in options.batch_sizes if 1 <= b <= self.config.max_batch_size)
        import onnxruntime as ort

        self.cpu_reference = ort.InferenceSession(self.model_path, providers=[CPU_EP])

    def _instance(self, device: DeviceInfo, index: int) -> InstanceHandle:
        return InstanceHandle(key=f"check/{device.id}/{index}", model=CHECK_MODEL, version="1", index=index,
                              device_id=device.id, model_path=self.model_path, config=self.config,
                              estimate_bytes=self.estimate_bytes)

    def _nvml_used(self, device: DeviceInfo) -> int | None:
        if device.simulated or device.kind not in ("gpu", "mig"):
            return None
        return self.backend.sample(device.id).memory_used_bytes

    async def check_device(self, device: DeviceInfo, progress: Progress = QUIET) -> list[Row]:
        """The serving rows of `device`; `progress` hears each part as it begins."""
        wdev = WorkerDevice(device.id, device.kind, device.uuid, device.simulated)
        dev = device.id
        progress.part("worker")
        try:
            worker = await self.pool.start_worker(wdev)
        except InferenceError as exc:
            return [Row("serving", dev, "worker", Status.FAIL, reason=exc.message)]
        loaded: list[InstanceHandle] = []
        try:
            return await self._check(device, wdev, worker.providers, loaded, progress)
        finally:
            for inst in loaded:
                await self.pool.unload_instance(inst)

    async def _load(self, device: DeviceInfo, wdev: WorkerDevice, index: int,
                    loaded: list[InstanceHandle]) -> tuple[InstanceHandle, int | None]:
        """Load instance `index`; (instance, NVML memory delta over its load or None where there is no NVML)."""
        before = self._nvml_used(device)
        inst = await self.pool.load_instance(self._instance(device, index), wdev)
        if inst.ready:
            loaded.append(inst)
        after = self._nvml_used(device)
        return inst, (after - before) if before is not None and after is not None else None

    async def _check(self, device: DeviceInfo, wdev: WorkerDevice, offered: tuple[str, ...],
                     loaded: list[InstanceHandle], progress: Progress) -> list[Row]:
        opts, dev = self.options, device.id
        rows: list[Row] = []
        progress.part("load")
        first, first_delta = await self._load(device, wdev, 0, loaded)
        if not first.ready:
            return [Row("serving", dev, "load", Status.FAIL, reason=first.error or "not ready after its load")]
        rows.append(Row("serving", dev, "load", Status.PASS, f"{first.load_seconds:.2f} s",
                        reason=f"{CHECK_MODEL} on {first.provider}"))
        rows.append(provider_row(dev, wdev.has_cuda, first.provider, offered))
        rows.append(estimate_row(dev, first.footprint_bytes, first.measured_by, self.estimate_bytes, first_delta))
        rng = np.random.default_rng(17)
        progress.part("outputs")
        rows += await self._outputs(dev, first, rng)
        progress.part("throughput")
        rows.append(await self._throughput(device, wdev, first, rng))
        if not wdev.has_cuda:
            what = "a simulated device (it computes on the CPU)" if device.simulated else "the CPU"
            rows.append(Row("serving", dev, "footprint.nvml", Status.SKIP,
                            reason=f"no NVML on {what}: gpud measures the worker's resident memory"))
            rows.append(Row("serving", dev, "overlap", Status.SKIP,
                            reason=f"overlap is a property of CUDA streams; instances on {what} share its cores"))
            return rows
        progress.part("overlap")
        second, second_delta = await self._load(device, wdev, 1, loaded)
        if not second.ready:
            rows.append(Row("serving", dev, "load (2nd instance)", Status.FAIL, reason=second.error))
            return rows
        rows.append(footprint_row(dev, second.footprint_bytes, second_delta, opts))
        one = await served_rows_per_s(self.config, [first], 1, opts.seconds, opts.concurrency, rng)
        two = await served_rows_per_s(self.config, [first, second], 1, opts.seconds, opts.concurrency, rng)
        rows.append(overlap_row(dev, one, two, opts.min_overlap_gain))
        return rows

    async def _outputs(self, dev: str, inst: InstanceHandle, rng: np.random.Generator) -> list[Row]:
        scheduler = DynamicScheduler(self.config, "1")
        scheduler.add_instance(inst)
        names = [o.name for o in self.config.outputs]
        rows = []
        try:
            for batch in self.batch_sizes:
                feed = _feed(self.config, batch, rng)
                try:
                    response = await scheduler.infer(_request(self.config, feed))
                except InferenceError as exc:
                    rows.append(Row("serving", dev, f"outputs b={batch}", Status.FAIL, reason=exc.message))
                    continue
                got = {t.name: t.data for t in response.outputs}
                want = dict(zip(names, self.cpu_reference.run(names, feed)))
                rows.append(outputs_row(dev, batch, got, want, self.options.atol))
        finally:
            scheduler.remove_instance(inst)
        return rows

    async def _throughput(self, device: DeviceInfo, wdev: WorkerDevice, inst: InstanceHandle,
                          rng: np.random.Generator) -> Row:
        opts = self.options
        try:
            raw = await asyncio.to_thread(self.raw, wdev, self.model_dir, self.batch_sizes, opts.seconds)
        except (RuntimeError, OSError, subprocess.TimeoutExpired, ValueError) as exc:
            return Row("serving", device.id, "throughput", Status.FAIL, reason=f"raw onnxruntime: {exc}")
        served = {}
        for batch in self.batch_sizes:
            served[batch] = await served_rows_per_s(self.config, [inst], batch, opts.seconds, opts.concurrency, rng)
        raw_rows = {int(b): r for b, r in raw["rows_per_s"].items()}
        return throughput_row(device.id, served, raw_rows, raw.get("provider", ""), opts.min_served_ratio,
                              strict=wdev.has_cuda)


# --- rows (pure) ----------------------------------------------------------------------------------------------------
def provider_row(dev: str, has_cuda: bool, provider: str, offered: Sequence[str]) -> Row:
    """A GPU device must compute on a GPU provider: onnxruntime falls back to the CPU without a word when
    onnxruntime-gpu or its CUDA libraries are missing."""
    offers = ", ".join(offered) or "none"
    if not has_cuda:
        return Row("serving", dev, "provider", Status.PASS if provider == CPU_EP else Status.FAIL, provider, CPU_EP,
                   reason="computes on the CPU, as this device calls for")
    if provider in GPU_PROVIDERS:
        return Row("serving", dev, "provider", Status.PASS, provider, "CUDA or TensorRT EP",
                   reason=f"the worker's onnxruntime offers {offers}")
    if CUDA_EP not in offered:
        why = (f"the worker's onnxruntime offers only {offers}: install the gpu extra (onnxruntime-gpu in place "
               f"of onnxruntime)")
    else:
        why = ("onnxruntime offers the CUDA EP but the session fell back to the CPU: its CUDA or cuDNN libraries did "
               "not load (the worker's log says which)")
    return Row("serving", dev, "provider", Status.FAIL, provider or "(none)", "CUDA or TensorRT EP",
               reason=f"silent CPU fallback on a GPU: {why}")


def estimate_row(dev: str, measured_bytes: int, measured_by: str, estimate_bytes: int,
                 nvml_delta_bytes: int | None) -> Row:
    """Placement plans with the estimate until an instance has loaded; an estimate under what a load takes
    over-commits a device until then."""
    context = "" if nvml_delta_bytes is None else \
        f"; NVML saw {_mib(nvml_delta_bytes)} for this first load (with the worker's CUDA context)"
    diff = f"{(measured_bytes - estimate_bytes) / MIB:+.1f} MiB"
    if measured_bytes <= estimate_bytes:
        return Row("serving", dev, "footprint.estimate", Status.PASS, _mib(measured_bytes), _mib(estimate_bytes), diff,
                   reason=f"measured ({measured_by}) within the estimate{context}")
    return Row("serving", dev, "footprint.estimate", Status.WARN, _mib(measured_bytes), _mib(estimate_bytes), diff,
               reason=f"measured ({measured_by}) over the estimate placement uses before the first load{context}")


def footprint_row(dev: str, measured_bytes: int, nvml_delta_bytes: int | None, opts: ServingOptions) -> Row:
    """A second instance's footprint as gpud measures it (the worker's cudaMemGetInfo delta) against NVML's view of
    the same load: what placement counts must be what the device lost."""
    if nvml_delta_bytes is None:
        return Row("serving", dev, "footprint.nvml", Status.SKIP, _mib(measured_bytes), reason="no NVML reading")
    tolerance = max(opts.footprint_tolerance_bytes, opts.footprint_tolerance_ratio * nvml_delta_bytes)
    diff = measured_bytes - nvml_delta_bytes
    ok = abs(diff) <= tolerance
    return Row("serving", dev, "footprint.nvml", Status.PASS if ok else Status.FAIL, _mib(measured_bytes),
               _mib(nvml_delta_bytes), f"{diff / MIB:+.1f} MiB",
               reason=(f"2nd instance: gpud's measurement within {_mib(tolerance)} of NVML's memory delta" if ok else
                       f"2nd instance: gpud's measurement differs from NVML's memory delta by more than "
                       f"{_mib(tolerance)}: placement would count wrong"))


def outputs_row(dev: str, batch: int, got: dict[str, np.ndarray], want: dict[str, np.ndarray], atol: float) -> Row:
    worst = 0.0
    for name, ref in want.items():
        out = got.get(name)
        if out is None or out.shape != ref.shape:
            return Row("serving", dev, f"outputs b={batch}", Status.FAIL,
                       "missing" if out is None else str(out.shape), str(ref.shape),
                       reason=f"output {name}: not what onnxruntime on the CPU returns")
        scale = max(1.0, float(np.max(np.abs(ref))) if ref.size else 1.0)
        worst = max(worst, float(np.max(np.abs(out.astype(np.float64) - ref))) / scale if ref.size else 0.0)
    ok = worst <= atol
    return Row("serving", dev, f"outputs b={batch}", Status.PASS if ok else Status.FAIL, f"max diff {worst:.2e}",
               "onnxruntime CPU", reason=f"{'within' if ok else 'over'} {atol:g} of the output's magnitude")


def throughput_row(dev: str, served: dict[int, float], raw: dict[int, float], raw_provider: str, min_ratio: float,
                   strict: bool) -> Row:
    """Served rows/s at the best batch size against raw onnxruntime's best. `strict` (a real GPU): a shortfall
    fails; on the CPU it warns, since a shared machine's other load moves the figures."""
    if not served or not raw:
        return Row("serving", dev, "throughput", Status.FAIL, reason="nothing measured")
    bs, br = max(served, key=served.__getitem__), max(raw, key=raw.__getitem__)
    ratio = served[bs] / raw[br]
    by = ", ".join(f"b{b} {served.get(b, 0):.0f}/{raw.get(b, 0):.0f}" for b in sorted(set(served) | set(raw)))
    detail = f"served/raw rows/s by batch: {by}; raw on {raw_provider}"
    row = Row("serving", dev, "throughput", Status.PASS, f"{served[bs]:.0f} rows/s (b={bs})",
              f"{raw[br]:.0f} rows/s raw (b={br})", f"x{ratio:.2f}", reason=f"at least x{min_ratio:g}; {detail}")
    if ratio < min_ratio:
        row = dataclasses.replace(row, status=Status.FAIL if strict else Status.WARN,
                                  reason=f"under x{min_ratio:g} of raw onnxruntime; {detail}")
    return row


def overlap_row(dev: str, one_rows_per_s: float, two_rows_per_s: float, min_gain: float) -> Row:
    gain = two_rows_per_s / one_rows_per_s if one_rows_per_s > 0 else 0.0
    ok = gain >= min_gain
    return Row("serving", dev, "overlap", Status.PASS if ok else Status.FAIL,
               f"{two_rows_per_s:.0f} rows/s (2 instances)", f"{one_rows_per_s:.0f} rows/s (1 instance)",
               f"x{gain:.2f}", reason=(f"two instances' CUDA streams overlap (at least x{min_gain:g}, batch 1)" if ok
                                       else f"two instances serve under x{min_gain:g} of one at batch 1: their "
                                            f"CUDA streams do not overlap"))
