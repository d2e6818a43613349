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
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import subprocess
import sys
import tempfile
import time
import urllib.request
from bisect import bisect_left
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from gpud.executor.stats import LATENCY_BUCKETS_SECONDS, ModelStats
from gpud.telemetry.simulated import SimulatedBackend

from .control import ControlPlane, ControlSettings, ModelSpec, write_repository
from .des import Kind, Serving, SimDevice, SimModel, poisson_arrivals
from .kinds import SPECS, build, load_kinds
from .policies import settings_for
from .scenario import Scenario

ROOT = Path(__file__).resolve().parents[2]
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
    write_repository(workdir / "repo", c.specs, {s.name: build(s) for s in SPECS})
    proc, ports = start_gpud(workdir, settings)
    base = f"http://127.0.0.1:{ports['http']}"
    counts: dict[str, list[tuple[float, int]]] = {name: [] for name in c.specs}
    loads: list[float] = []

    def inspect() -> dict:
        with urllib.request.urlopen(f"{base}/v2/gpud/inspect", timeout=10) as r:
            return json.loads(r.read())

    async def tick(start: float) -> None:
        loop = asyncio.get_running_loop()
        while True:
            doc = await loop.run_in_executor(None, inspect)
            for m in doc["models"]:
                counts.setdefault(m["name"], []).append((loop.time() - start, len(m["instances"])))
            await asyncio.sleep(1.0)

    try:
        widths = {s.name: s.width for s in SPECS}
        failures, late = asyncio.run(send_all(base, times, widths, tick))
        doc = inspect()
        loads = [i["load_seconds"] for m in doc["models"] for i in m["instances"]]
        decisions = doc.get("controller", {}).get("decisions", [])
        with urllib.request.urlopen(f"{base}/v2/models/stats", timeout=10) as r:
            stats = json.loads(r.read())
        with urllib.request.urlopen(f"http://127.0.0.1:{ports['metrics']}/metrics", timeout=10) as r:
            metrics = r.read().decode()
    finally:
        proc.terminate()
        proc.wait(60)
    return {"failures": failures, "late_p99_ms": float(np.percentile(late, 99) * 1e3) if late else 0.0,
            "stats": stats, "metrics": metrics, "counts": counts, "load_seconds": float(np.mean(loads)) if loads else 1.0,
            "steps": _steps(decisions)}


def _steps(decisions: list[dict]) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in decisions:
        if d["applied"]:
            out[d["action"]] = out.get(d["action"], 0) + 1
    return out


# --- the model ---------------------------------------------------------------------------------------------------------
def run_model(c: Case, settings: ControlSettings, times: dict[str, np.ndarray], load_s: float, workdir: Path) -> dict:
    specs = {n: replace(s, load_seconds=load_s) for n, s in c.specs.items()}
    (workdir / "cpu.yaml").write_text(CPU_NODE)
    backend = SimulatedBackend.from_file(workdir / "cpu.yaml")
    models = [SimModel(n, "1", c.kinds[specs[n].kind], specs[n].max_batch_size, times[n]) for n in sorted(specs)]
    serving = Serving([SimDevice("cpu", 2.0, False)], models, slo_queue_s=SLO_QUEUE_S)
    plane = ControlPlane(serving, backend, specs, settings, workdir / "model-repo")
    counts: dict[str, list[tuple[float, int]]] = {n: [] for n in specs}

    def sample() -> None:  # over the clients' time, as the real run's inspect polling
        for m in models:
            counts[m.name].append((serving.now_s, len(m.instances)))
        if serving.now_s < c.seconds:
            serving.at(serving.now_s + 1.0, sample)

    serving.at(0.0, sample)
    plane.start()
    serving.finish(float(c.seconds) + 30.0)
    records = {m.name: m.stats for m in models}
    steps: dict[str, int] = {}
    for (action, _reason, applied), n in plane.controller.actions.items():
        if applied == "true":
            steps[action] = steps.get(action, 0) + n
    plane.close()
    return {"records": records, "counts": counts, "steps": steps}


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=int, default=180)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--step", type=float, default=150.0, help="the ranker's rate in the middle third (req/s; 40: "
                   "no step)")
    p.add_argument("--out", default="replay-results")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    c = case(args.seconds, args.step)
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
