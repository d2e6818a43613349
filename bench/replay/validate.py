"""Is the serving model to be trusted? The same requests against the real gpud and against the model, side by side.

    cd bench && python -m replay.validate [--seconds 180] [--out results/]

Three models (one of each kind, the real ONNX files of replay.kinds, one onnxruntime thread each) on the CPU of
this machine (a node with no GPU: one device, 2 cores). Open-loop Poisson arrivals from a rate schedule with a load
step on one model are sent to a real gpud over HTTP (binary tensors) at their times; the same arrival times go
through the discrete-event model with gpud's control plane (replay.control), the CPU as a device of capacity 2
(cores) and each batch capped at 1 core (one thread). Both write the same statistics record (gpud.executor.stats), so
the figures compared are read the same way: requests, mean queue time, the share of requests queued under the SLO
(from the queue-time histogram), mean rows per batch, instance-seconds and the controller's adds and removes.
What the model leaves out shows as the difference: the front end's and the client's CPU on the same 2 cores, process
wake-ups, the real batcher's rules (it may wait for a fuller batch; the model takes what is queued).

    cd bench && python -m replay.validate --objectives [--seconds 180] [--step 40]

Issue 26's check of latency objectives: two models whose objectives are 10x apart (ranker 100 ms, vision 1 s;
`gpud_latency_objective_ms` in their config.pbtxt, so the controller scales them by their objectives), a load step
on the fast one. Per model, the attainment measured by the real gpud (its `gpud_model_requests_within_objective_total`
and `_over_objective_total`: server-side latency, queue + compute, a failed request over) against the attainment the
model predicts (the same counters of its record), in points. The model runs in variants that say where the
differences come from: batch times as stored (kinds.json, a quiet machine) or measured just before the run; the 2
cores whole, or less what the real run's batches did not get each second (the front end, the client, other
processes: this machine is shared) and a core while an instance loads; or the real run's own batch times. The
prediction judged is `now+cores` (VERDICT): everything it uses is measured before or beside the real run, nothing
fitted to the attainment.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import subprocess
import sys
import tempfile
import time
import urllib.request
from bisect import bisect_left
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import psutil

from gpud.executor.stats import LATENCY_BUCKETS_SECONDS, ModelStats
from gpud.telemetry.simulated import SimulatedBackend

from .control import ControlPlane, ControlSettings, ModelSpec, write_repository
from .des import Kind, Serving, SimDevice, SimModel, poisson_arrivals
from .kinds import SPECS, build, load_kinds, measure
from .policies import settings_for
from .scenario import Scenario

ROOT = Path(__file__).resolve().parents[2]
CORES = 2.0  # this machine's: the CPU device's capacity in the model
SLO_QUEUE_S = 0.1  # a bucket bound of the queue histogram, so both sides read the same share
CPU_NODE = "name: cpu-only\ndescription: this machine's CPU, no GPU (the serving model's check)\ngpus: []\n"


@dataclass(frozen=True)
class Case:
    specs: dict[str, ModelSpec]
    kinds: dict[str, Kind]
    rates: dict[str, np.ndarray]  # per second
    seconds: int


def case(seconds: int = 180, step_per_s: float = 150.0) -> Case:
    """ranker: 40 req/s, `step_per_s` in the middle third (150: one instance takes ~180 at full batches, so the load
    rule asks for a second); encoder 10 req/s; vision 4 req/s. About 1.5 of the 2 cores at the step."""
    kinds = {name: replace(k, share=1.0) for name, k in load_kinds().items()}  # one thread: at most one core
    third = seconds // 3
    ranker = np.full(seconds, 40.0)
    ranker[third:2 * third] = step_per_s
    rates = {"ranker": ranker, "encoder": np.full(seconds, 10.0), "vision": np.full(seconds, 4.0)}
    specs = {s.name: ModelSpec(s.name, s.name, 64 * 2**20, 1.0, device_kind="KIND_CPU", threads=1, min_instances=1,
                               max_instances=2) for s in SPECS}
    return Case(specs, kinds, rates, seconds)


OBJECTIVES_MS = {"ranker": 100.0, "vision": 1000.0}  # 10x apart: the fast model's objective and the slow one's
TOLERANCE_POINTS = 2.0  # issue 26: measured attainment within 2 points of the prediction
VERDICT = "now+cores"  # the model variant whose prediction is judged (the others say where differences come from)


def objectives_case(seconds: int = 180, step_per_s: float = 40.0) -> Case:
    """ranker (100 ms objective) 10 req/s, `step_per_s` in the middle third; vision (1 s) 1 req/s: about 0.4 of
    the 2 cores at the base load, where one instance of each meets its objective most of the time even with other
    processes on one core and more (this machine is shared; 50 ms was missed at the base load then, a 26 ms batch
    sharing two cores three ways, and 20 + 2 req/s collapsed); the step keeps one ranker instance busy nearly all
    the time, past its objective, so the objective's rule asks for a second."""
    kinds = {name: replace(k, share=1.0) for name, k in load_kinds().items() if name in OBJECTIVES_MS}
    third = seconds // 3
    ranker = np.full(seconds, 10.0)
    ranker[third:2 * third] = step_per_s
    rates = {"ranker": ranker, "vision": np.full(seconds, 1.0)}
    specs = {name: ModelSpec(name, name, 64 * 2**20, 1.0, device_kind="KIND_CPU", threads=1, min_instances=1,
                             max_instances=2, objective_ms=ms) for name, ms in OBJECTIVES_MS.items()}
    return Case(specs, kinds, rates, seconds)


def control_settings(c: Case) -> ControlSettings:
    scenario = Scenario(c.specs, c.kinds, {}, {}, c.rates, float(c.seconds), 0.0, SLO_QUEUE_S, 0.8, 0.0, 0.0)
    base = settings_for(scenario, incremental=True, interval_s=5.0, scale_up_s=5.0, scale_down_s=30.0,
                        idle_unload_s=600.0, hints_interval_s=2.5, rate_window_s=15.0)
    return base  # the bounds (1..2) are the models' own (gpud_min_instances, gpud_max_instances)


def daemon_flags(s: ControlSettings) -> list[str]:
    h, c = s.hints, s.control
    return ["--hints-interval-seconds", str(s.hints_interval_s), "--hints-rate-window-seconds", str(s.rate_window_s),
            "--hints-target-queue-seconds", str(h.target_queue_seconds),
            "--hints-target-utilization-ratio", str(h.target_utilization_ratio),
            "--hints-scale-up-stabilization-seconds", str(h.scale_up_stabilization_seconds),
            "--hints-scale-down-stabilization-seconds", str(h.scale_down_stabilization_seconds),
            "--control-interval-seconds", str(c.interval_seconds),
            "--control-max-steps-per-interval", str(c.max_steps_per_interval),
            "--idle-unload-seconds", str(c.idle_unload_seconds)]


def arrivals(c: Case, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: poisson_arrivals(c.rates[name], 1.0, rng) for name in sorted(c.specs)}


# --- the real daemon -------------------------------------------------------------------------------------------------
def start_gpud(workdir: Path, settings: ControlSettings) -> tuple[subprocess.Popen, dict]:
    (workdir / "cpu.yaml").write_text(CPU_NODE)
    ready = workdir / "ready.json"
    cmd = [sys.executable, "-m", "gpud.main", "--model-repository", str(workdir / "repo"), "--node",
           str(workdir / "cpu.yaml"), "--address", "127.0.0.1", "--http-port", "0", "--grpc-port", "0",
           "--metrics-port", "0", "--ready-file", str(ready), *daemon_flags(settings)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=open(workdir / "gpud.log", "w"), stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"gpud did not start; see {workdir / 'gpud.log'}")
        time.sleep(0.1)
    return proc, json.loads(ready.read_text())


async def send_all(url: str, times: dict[str, np.ndarray], width: dict[str, int],
                   on_tick) -> tuple[int, list[float]]:
    """Send every request at its time (open loop); returns failures and how late each was sent (s)."""
    import aiohttp

    loop = asyncio.get_running_loop()
    start = loop.time() + 1.0
    late: list[float] = []
    failures = 0
    bodies = {}
    for name, w in width.items():
        header = json.dumps({"inputs": [{"name": "x", "shape": [1, w], "datatype": "FP32",
                                         "parameters": {"binary_data_size": 4 * w}}],
                             "outputs": [{"name": "y", "parameters": {"binary_data": True}}]}).encode()
        bodies[name] = (header + np.full(w, 0.01, np.float32).tobytes(), len(header))

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one(name: str, t: float) -> None:
            nonlocal failures
            await asyncio.sleep(max(0.0, start + t - loop.time()))
            late.append(loop.time() - (start + t))
            body, header_len = bodies[name]
            try:
                async with session.post(f"{url}/v2/models/{name}/infer", data=body,
                                        headers={"Inference-Header-Content-Length": str(header_len)}) as r:
                    await r.read()
                    failures += r.status != 200
            except aiohttp.ClientError:
                failures += 1

        ticker = asyncio.create_task(on_tick(start))
        await asyncio.gather(*(one(name, float(t)) for name, ts in times.items() for t in ts))
        ticker.cancel()
    return failures, late


def run_real(c: Case, settings: ControlSettings, times: dict[str, np.ndarray], workdir: Path) -> dict:
    write_repository(workdir / "repo", c.specs, {s.name: build(s) for s in SPECS if s.name in c.specs})
    proc, ports = start_gpud(workdir, settings)
    base = f"http://127.0.0.1:{ports['http']}"
    counts: dict[str, list[tuple[float, int]]] = {name: [] for name in c.specs}
    cpu: list[tuple[float, float, float]] = []  # (s since the start, machine busy CPU s, gpud's workers' CPU s)
    loads: list[float] = []
    daemon = psutil.Process(proc.pid)

    def inspect() -> dict:
        with urllib.request.urlopen(f"{base}/v2/gpud/inspect", timeout=10) as r:
            return json.loads(r.read())

    def busy() -> tuple[float, float]:
        """CPU seconds so far: of the whole machine (every core, steal included), of gpud's workers (the batches)."""
        t = psutil.cpu_times()
        workers = 0.0
        for child in daemon.children(recursive=True):
            try:
                workers += sum(child.cpu_times()[:2])
            except psutil.Error:
                pass
        return t.user + t.nice + t.system + t.irq + t.softirq + t.steal, workers

    async def tick(start: float) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time() - start
            cpu.append((t, *await loop.run_in_executor(None, busy)))
            doc = await loop.run_in_executor(None, inspect)
            for m in doc["models"]:
                counts.setdefault(m["name"], []).append((loop.time() - start, len(m["instances"])))
            await asyncio.sleep(1.0)

    try:
        widths = {s.name: s.width for s in SPECS if s.name in c.specs}
        front, cpu0 = daemon, time.process_time()
        front0 = sum(front.cpu_times()[:2])  # the daemon's own process (front end, core); workers are children
        failures, late = asyncio.run(send_all(base, times, widths, tick))
        client_cpu_s, front_cpu_s = time.process_time() - cpu0, sum(front.cpu_times()[:2]) - front0
        doc = inspect()
        loads = [i["load_seconds"] for m in doc["models"] for i in m["instances"]]
        # per model, of the instances the controller added (the first ones loaded before the requests started)
        added = {m["name"]: [i["load_seconds"] for i in m["instances"] if i["index"] > 0] or
                 [i["load_seconds"] for i in m["instances"]] for m in doc["models"]}
        decisions = doc.get("controller", {}).get("decisions", [])
        with urllib.request.urlopen(f"{base}/v2/models/stats", timeout=10) as r:
            stats = json.loads(r.read())
        with urllib.request.urlopen(f"http://127.0.0.1:{ports['metrics']}/metrics", timeout=10) as r:
            metrics = r.read().decode()
    finally:
        proc.terminate()
        proc.wait(60)
    return {"failures": failures, "late_p99_ms": float(np.percentile(late, 99) * 1e3) if late else 0.0,
            "stats": stats, "metrics": metrics, "counts": counts,
            "load_seconds": float(np.mean(loads)) if loads else 1.0,
            "load_seconds_by_model": {n: float(np.mean(v)) for n, v in added.items() if v},
            "steps": _steps(decisions), "model_steps": _steps(decisions, by_model=True),
            "client_cpu_s": client_cpu_s, "frontend_cpu_s": front_cpu_s, "other_cores": other_cores(cpu)}


def other_cores(samples: list[tuple[float, float, float]]) -> list[tuple[float, float]]:
    """(from s, cores) per interval between samples: the machine's busy CPU that was not gpud's workers' batches
    (the front end, the client, other processes, the hypervisor's steal)."""
    return [(t0, max(0.0, ((b1 - b0) - (w1 - w0)) / (t1 - t0)))
            for (t0, b0, w0), (t1, b1, w1) in zip(samples, samples[1:]) if t1 > t0]


def _steps(decisions: list[dict], by_model: bool = False) -> dict[str, int]:
    """Applied steps by action ("add": 1), or by model and action ("ranker add": 1)."""
    out: dict[str, int] = {}
    for d in decisions:
        if d["applied"]:
            key = f"{d['model']} {d['action']}" if by_model else d["action"]
            out[key] = out.get(key, 0) + 1
    return out


# --- the model --------------------------------------------------------------------------------------------------------
def run_model(c: Case, settings: ControlSettings, times: dict[str, np.ndarray], load_s: float | dict[str, float],
              workdir: Path,
              other: list[tuple[float, float]] | None = None, load_cores: float = 0.0) -> dict:
    """`other`: (from s, cores) measured in the real run (other_cores: the front end, the client, other processes),
    taken out of the 2 cores from then on; `load_cores`: what an instance load takes of them while it runs."""
    specs = {n: replace(s, load_seconds=load_s[n] if isinstance(load_s, dict) else load_s)
             for n, s in c.specs.items()}
    workdir = Path(tempfile.mkdtemp(dir=workdir))
    (workdir / "cpu.yaml").write_text(CPU_NODE)
    backend = SimulatedBackend.from_file(workdir / "cpu.yaml")
    models = [SimModel(n, "1", c.kinds[specs[n].kind], specs[n].max_batch_size, times[n]) for n in sorted(specs)]
    serving = Serving([SimDevice("cpu", CORES, False)], models, slo_queue_s=SLO_QUEUE_S)
    plane = ControlPlane(serving, backend, specs, settings, workdir / "model-repo")
    plane.pool.load_compute = load_cores
    counts: dict[str, list[tuple[float, int]]] = {n: [] for n in specs}

    def sample() -> None:  # over the clients' time, as the real run's inspect polling
        for m in models:
            counts[m.name].append((serving.now_s, len(m.instances)))
        if serving.now_s < c.seconds:
            serving.at(serving.now_s + 1.0, sample)

    serving.at(0.0, sample)
    for t, cores in other or []:
        serving.at(max(0.0, t), lambda cap=CORES - cores: serving.set_capacity("cpu", cap))
    plane.start()
    serving.finish(float(c.seconds) + 30.0)
    records = {m.name: m.stats for m in models}
    steps: dict[str, int] = {}
    for (action, _reason, applied), n in plane.controller.actions.items():
        if applied == "true":
            steps[action] = steps.get(action, 0) + n
    by_model = _steps([{"model": d.model, "action": d.action, "applied": d.applied}
                       for d in plane.controller.decisions], by_model=True)
    plane.close()
    return {"records": records, "counts": counts, "steps": steps, "model_steps": by_model}


# --- comparing -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Figures:
    requests: int
    mean_queue_ms: float
    within_slo: float  # share of successful requests queued <= SLO_QUEUE_S
    rows_per_batch: float
    instance_seconds: float


def figures_from_record(st: ModelStats, counts: list[tuple[float, int]]) -> Figures:
    k = bisect_left(LATENCY_BUCKETS_SECONDS, SLO_QUEUE_S)  # buckets are non-cumulative; `le` inclusive
    n = st.success.count
    return Figures(n, st.queue.ns / n / 1e6 if n else 0.0, sum(st.histograms.queue[:k + 1]) / n if n else 0.0,
                   st.inference_count / st.execution_count if st.execution_count else 0.0, _integral(counts))


def figures_from_triton(model: dict, within: float, counts: list[tuple[float, int]]) -> Figures:
    s = model["inference_stats"]
    n = int(s["success"]["count"])
    return Figures(n, int(s["queue"]["ns"]) / n / 1e6 if n else 0.0, within,
                   int(model["inference_count"]) / int(model["execution_count"]) if model["execution_count"] else 0,
                   _integral(counts))


def _integral(counts: list[tuple[float, int]]) -> float:
    return sum((t1 - t0) * n for (t0, n), (t1, _) in zip(counts, counts[1:]))


def queue_share_from_metrics(metrics_text: str, model: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    le = count = 0.0
    for fam in text_string_to_metric_families(metrics_text):
        if fam.name != "gpud_model_queue_duration_seconds":
            continue
        for s in fam.samples:
            if s.labels.get("model") != model:
                continue
            if s.name.endswith("_bucket") and float(s.labels["le"]) == SLO_QUEUE_S:
                le = s.value
            elif s.name.endswith("_count"):
                count = s.value
    return le / count if count else 0.0


@dataclass(frozen=True)
class Attainment:
    """Requests within a model's latency objective and over it (failed ones over), as gpud's record counts them."""

    within: int
    over: int

    @property
    def share(self) -> float:
        total = self.within + self.over
        return self.within / total if total else math.nan


def attainment_from_record(st: ModelStats) -> Attainment:
    return Attainment(st.within_objective, st.over_objective)


def attainment_from_metrics(metrics_text: str, model: str) -> Attainment:
    """The real side: gpud_model_requests_{within,over}_objective_total of the model (its versions summed)."""
    from prometheus_client.parser import text_string_to_metric_families

    counts = {"within": 0.0, "over": 0.0}
    for fam in text_string_to_metric_families(metrics_text):
        for which in counts:
            if fam.name == f"gpud_model_requests_{which}_objective":
                counts[which] += sum(s.value for s in fam.samples
                                     if s.name.endswith("_total") and s.labels.get("model") == model)
    return Attainment(int(counts["within"]), int(counts["over"]))


def gap_points(measured: Attainment, predicted: Attainment) -> float:
    """How far the prediction is above the measurement, in percentage points (negative: below)."""
    return 100.0 * (predicted.share - measured.share)


def within_tolerance(gap: float, tolerance_points: float = TOLERANCE_POINTS) -> bool:
    """Inclusive, at the printed precision (95% - 97% is 2 points, not 2.0000000000000018)."""
    return round(abs(gap), 9) <= tolerance_points


def kind_from_batch_stats(name: str, batch_stats: list[dict], min_batches: int = 5) -> Kind | None:
    """A kind whose batch times are the real run's own (compute input + infer + output per batch, by batch size,
    from the statistics extension's batch_stats); sizes run fewer than `min_batches` times are left out."""
    points = []
    for b in sorted(batch_stats, key=lambda b: int(b["batch_size"])):
        n = int(b["compute_infer"]["count"])
        if n >= min_batches:
            ns = sum(int(b[phase]["ns"]) for phase in ("compute_input", "compute_infer", "compute_output"))
            points.append((int(b["batch_size"]), ns / n / 1e9))
    return Kind(name, tuple(points), 1.0) if points else None


def _mean_latency_ms(st: ModelStats) -> float:
    return st.success.ns / st.success.count / 1e6 if st.success.count else math.nan


def main_objectives(args: argparse.Namespace) -> int:
    c = objectives_case(args.seconds, 40.0 if args.step is None else args.step)
    settings = control_settings(c)
    times = arrivals(c, args.seed)
    work = Path(tempfile.mkdtemp(prefix="gpud-validate-"))
    total = sum(len(t) for t in times.values())
    # The batch times as this machine gives them now (it is shared: the stored kinds.json is a quiet machine's)
    now = {name: Kind(name, tuple(rows), 1.0) for name, rows in measure(9, tuple(c.specs)).items()}
    print(f"{total} requests over {c.seconds} s; gpud's log: {work / 'gpud.log'}; batch times now (ms): "
          + "; ".join(f"{n} " + " ".join(f"b{r}={t * 1e3:.0f}" for r, t in k.batch_seconds) for n, k in now.items()),
          flush=True)
    real = run_real(c, settings, times, work)
    cpu_per_request_s = (real["client_cpu_s"] + real["frontend_cpu_s"]) / total
    real_stats = {e["name"]: e for e in real["stats"]["model_stats"]}
    served = {n: kind_from_batch_stats(n, real_stats[n]["batch_stats"]) or now[n] for n in c.specs}
    loads = {n: real["load_seconds_by_model"].get(n, real["load_seconds"]) for n in c.specs}
    variants = {  # the prediction judged is VERDICT's; the others show where the differences come from
        "stored": run_model(c, settings, times, loads, work),
        "now": run_model(replace(c, kinds=now), settings, times, loads, work),
        "stored+cores": run_model(c, settings, times, loads, work, other=real["other_cores"],
                                  load_cores=1.0),
        "now+cores": run_model(replace(c, kinds=now), settings, times, loads, work,
                               other=real["other_cores"], load_cores=1.0),
        "served": run_model(replace(c, kinds=served), settings, times, loads, work),
    }
    print("attainment of each model's objective (share of requests within it), measured and predicted; gap = "
          "predicted - measured, points; model variants: stored = kinds.json's batch times, now = measured before "
          "the run, +cores = the cores the real run's batches did not have each second (front end, client, other "
          "processes) taken out, and a core while an instance loads, "
          f"served = the real run's own batch times (after the fact); within 2: {VERDICT}")
    print(f"{'model':<7} {'objective':>9} {'measured':>9} " + " ".join(f"{v:>15}" for v in variants)
          + f" {'within 2':>8}")
    rows = []
    for name in sorted(c.specs):
        measured = attainment_from_metrics(real["metrics"], name)
        predicted = {v: attainment_from_record(m["records"][name]) for v, m in variants.items()}
        gaps = {v: gap_points(measured, a) for v, a in predicted.items()}
        print(f"{name:<7} {OBJECTIVES_MS[name]:7.0f}ms {measured.share:9.2%} "
              + " ".join(f"{predicted[v].share:7.2%} {gaps[v]:+6.2f}" for v in variants)
              + f" {'yes' if within_tolerance(gaps[VERDICT]) else 'NO':>8}")
        rows.append({"model": name, "objective_ms": OBJECTIVES_MS[name], "measured": measured.__dict__,
                     "predicted": {v: a.__dict__ for v, a in predicted.items()}, "gap_points": gaps})
    print(f"{'model':<7} {'':>19} " + " ".join(f"{v:>15}" for v in variants) + "   (mean latency ms; "
          "instance-seconds; most instances)")
    for name in sorted(c.specs):
        ok = real_stats[name]["inference_stats"]["success"]
        real_ms = int(ok["ns"]) / int(ok["count"]) / 1e6 if int(ok["count"]) else math.nan
        cells = [f"{_mean_latency_ms(m['records'][name]):5.0f} {_integral(m['counts'][name]):5.0f} "
                 f"{max(n for _, n in m['counts'][name]):3d}" for m in variants.values()]
        counts = real["counts"].get(name, [])
        print(f"{name:<7} real {real_ms:5.0f} {_integral(counts):5.0f} {max((n for _, n in counts), default=0):3d}  "
              + " ".join(f"{x:>15}" for x in cells))
    print(f"controller steps: real {real['model_steps']}; " + "; ".join(f"{v} {m['model_steps']}"
                                                                        for v, m in variants.items()))
    print(f"failed requests (real): {real['failures']}; client send lateness p99 {real['late_p99_ms']:.1f} ms; CPU "
          f"outside the batches {cpu_per_request_s * 1e3:.2f} ms/request (client {real['client_cpu_s']:.0f} s, "
          f"gpud's front end {real['frontend_cpu_s']:.0f} s); cores not the batches' (mean) "
          f"{np.mean([x for _, x in real['other_cores']] or [0.0]):.2f}; load times used (s) "
          + ", ".join(f"{n} {t:.1f}" for n, t in loads.items()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "validate-objectives.json").write_text(json.dumps(
        {"rows": rows, "real_steps": real["model_steps"], "steps": {v: m["model_steps"] for v, m in variants.items()},
         "failures": real["failures"], "cpu_per_request_s": cpu_per_request_s,
         "other_cores": real["other_cores"],
         "batch_seconds": {"now": {n: k.batch_seconds for n, k in now.items()},
                           "served": {n: k.batch_seconds for n, k in served.items()}}}, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=int, default=180)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--step", type=float, default=None, help="the ranker's rate in the middle third (req/s; "
                   "default 150 over a base of 40, with --objectives 40 over 10; the base rate: no step)")
    p.add_argument("--objectives", action="store_true", help="issue 26's check: two models with latency objectives "
                   "10x apart, measured attainment against the model's prediction")
    p.add_argument("--out", default="replay-results")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    if args.objectives:
        return main_objectives(args)
    c = case(args.seconds, 150.0 if args.step is None else args.step)
    settings = control_settings(c)
    times = arrivals(c, args.seed)
    work = Path(tempfile.mkdtemp(prefix="gpud-validate-"))
    print(f"{sum(len(t) for t in times.values())} requests over {c.seconds} s; gpud's log: {work / 'gpud.log'}",
          flush=True)
    real = run_real(c, settings, times, work)
    model = run_model(c, settings, times, real["load_seconds"], work)
    rows = []
    print(f"{'model':<8} {'':<6} {'requests':>8} {'queue ms':>9} {f'<= {SLO_QUEUE_S * 1e3:g} ms':>9} "
          f"{'rows/batch':>10} {'inst-s':>7}")
    for entry in real["stats"]["model_stats"]:
        name = entry["name"]
        mine = figures_from_record(model["records"][name], model["counts"][name])
        # the real share under the SLO comes from gpud's own histogram, as the model's does
        within = queue_share_from_metrics(real["metrics"], name)
        theirs = figures_from_triton(entry, within, real["counts"].get(name, []))
        for label, f in (("real", theirs), ("model", mine)):
            print(f"{name:<8} {label:<6} {f.requests:8d} {f.mean_queue_ms:9.1f} {f.within_slo:9.2%} "
                  f"{f.rows_per_batch:10.2f} {f.instance_seconds:7.0f}")
        rows.append({"model": name, "real": theirs.__dict__, "model_": mine.__dict__})
    print(f"controller steps: real {real['steps']}, model {model['steps']}; failed requests (real): "
          f"{real['failures']}; client send lateness p99 {real['late_p99_ms']:.1f} ms; load time used "
          f"{real['load_seconds']:.2f} s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "validate.json").write_text(json.dumps({"rows": rows, "real_steps": real["steps"],
                                                   "model_steps": model["steps"], "failures": real["failures"]},
                                                  indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
