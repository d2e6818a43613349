"""What `scripts/gpu-validate` does on a node with an NVIDIA GPU (issue 17): set up a venv with the gpu extra, run
`gpudctl check`, the serving harness's GPU path, the daemon on the real GPUs (its /metrics against nvidia-smi) and
the `gpu`-marked tests, and write one report. `--dry-run` prints the steps and runs nothing.

Never changes the GPU's settings (MIG mode included) and never resets it: every step only reads the GPU or runs
models on it.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ORT_GPU = "onnxruntime-gpu[cuda,cudnn]>=1.31.1"  # a CUDA 13 build: nvidia-cuda-runtime~=13.0, nvidia-cudnn-cu13
ORT_GPU_PIN = "onnxruntime-gpu>=1.31.1"
PROVIDERS_PY = ("import onnxruntime as o, sys; p = o.get_available_providers(); print(o.__version__, p); "
                "sys.exit('CUDAExecutionProvider' not in p)")


@dataclass
class Step:
    name: str
    what: str
    commands: list[list[str]]  # run in order; the step fails at the first that fails
    output: str = ""  # file under the report directory that keeps its output
    needs_env: bool = True  # skipped when the environment could not be set up
    run: Callable[["Step", "Context"], int] | None = None  # a step that is more than commands (the daemon)


@dataclass
class Result:
    step: Step
    code: int | None  # None: skipped
    seconds: float = 0.0
    text: str = ""


@dataclass
class Context:
    args: argparse.Namespace
    python: str
    out: Path
    results: list[Result] = field(default_factory=list)


def plan(args: argparse.Namespace) -> tuple[list[Step], str]:
    venv = Path(args.venv)
    python = str(venv / "bin" / "python")
    pip = [python, "-m", "pip", "install", "-q"]
    quick = args.quick
    steps = []
    if not args.skip_install:
        steps += [
            Step("venv", f"a virtual environment {venv} with gpud, its gpu and test extras",
                 [[sys.executable, "-m", "venv", str(venv)], [*pip, "--upgrade", "pip"],
                  [*pip, "-e", f"{ROOT}[gpu,test]"]], "install.log", needs_env=False),
            # onnxruntime (a main dependency) and onnxruntime-gpu install the same `onnxruntime` package: whichever
            # came last owns its files. Both out, then the GPU build alone, so the CUDA EP is really there.
            Step("onnxruntime-gpu", f"onnxruntime-gpu in place of onnxruntime ({ORT_GPU})",
                 [[python, "-m", "pip", "uninstall", "-y", "-q", "onnxruntime", "onnxruntime-gpu"],
                  [*pip, ORT_GPU], [*pip, "--force-reinstall", "--no-deps", ORT_GPU_PIN]], "install.log",
                 needs_env=False),
        ]
    steps += [
        Step("providers", "onnxruntime offers the CUDA EP (CUDA and cuDNN libraries from the nvidia-* wheels)",
             [[python, "-c", PROVIDERS_PY]], "providers.txt"),
        Step("node", "the node as nvidia-smi and pip see it", [
            ["nvidia-smi"], ["nvidia-smi", "-L"],
            ["nvidia-smi", "--query-gpu=index,name,driver_version,memory.total,power.limit,mig.mode.current",
             "--format=csv"],
            [python, "-m", "pip", "list", "--format=freeze"]], "node.txt"),
        Step("check", "gpudctl check: readings against nvidia-smi, the serving path on every leaf device",
             [[python, "-m", "gpud.cli.main", "check", "--expect-gpu", "--seconds", "0.5" if quick else "2"]],
             "check.txt"),
        Step("harness", "the serving harness's GPU path: served vs raw onnxruntime-gpu at batch 1..64",
             [[python, str(ROOT / "bench" / "serving" / "gpu.py"), "--duration", "2" if quick else "5",
               "--output", "{out}/gpu-bench.json"]], "harness.txt"),
        Step("daemon", "gpud on the real GPUs (NVML): gpudctl check --url and its /metrics against nvidia-smi",
             [[python, "-m", "gpud.main", "--model-repository", "{out}/models", "--address", "127.0.0.1",
               "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0", "--ready-file", "{out}/gpud.ready"],
              [python, "-m", "gpud.cli.main", "check", "--url", "127.0.0.1:<http port>", "--metrics-url",
               "http://127.0.0.1:<metrics port>/metrics"]], "daemon.txt", run=run_daemon_step),
        Step("ensemble", "issue 16's pipeline targets on the GPU: a 3-step ensemble against its slowest step alone "
             "(needs wrk on the PATH)",
             [[python, str(ROOT / "bench" / "ensemble_bench.py"), "--kind", "gpu", "--repeat", "1" if quick else "5",
               "--json", "{out}/ensemble.json"]], "ensemble.txt"),
        Step("gpu-tests", "the gpu-marked tests", [[python, "-m", "pytest", "-q", "-m", "gpu", str(ROOT / "tests")]],
             "gpu-tests.txt"),
    ]
    return steps, python


def _expand(cmd: list[str], ctx: Context) -> list[str]:
    return [c.replace("{out}", str(ctx.out)) for c in cmd]


def run_commands(step: Step, ctx: Context) -> int:
    code = 0
    with open(ctx.out / step.output, "a") as log:
        for cmd in step.commands:
            cmd = _expand(cmd, ctx)
            log.write(f"$ {shlex.join(cmd)}\n")
            log.flush()
            code = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
            log.write(f"(exit {code})\n\n")
            if code != 0:
                break
    return code


def run_daemon_step(step: Step, ctx: Context) -> int:
    """Start gpud with the example models on the real GPUs, check it from outside, stop it (SIGTERM, as systemd)."""
    serve, check = (_expand(c, ctx) for c in step.commands)
    subprocess.run([ctx.python, "-c", f"from gpud.examples import write_example_repository as w; "
                                      f"w({str(ctx.out / 'models')!r})"], cwd=ROOT, check=True)
    ready = ctx.out / "gpud.ready"
    with open(ctx.out / step.output, "a") as log, open(ctx.out / "gpud.log", "w") as daemon_log:
        log.write(f"$ {shlex.join(serve)}\n")
        daemon = subprocess.Popen(serve, cwd=ROOT, stdout=daemon_log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 300
            while not ready.exists():
                if daemon.poll() is not None or time.monotonic() > deadline:
                    log.write(f"gpud did not become ready (see gpud.log)\n")
                    return 1
                time.sleep(0.5)
            ports = json.loads(ready.read_text())
            check = [c.replace("<http port>", str(ports["http"])).replace("<metrics port>", str(ports["metrics"]))
                     for c in check]
            log.write(f"$ {shlex.join(check)}\n")
            log.flush()
            code = subprocess.run(check, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
            log.write(f"(exit {code})\n")
            return code
        finally:
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(60)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()


def report(ctx: Context) -> str:
    lines = [f"# gpud on a GPU: validation report ({time.strftime('%Y-%m-%d %H:%M %Z')})", "",
             f"Command: `{shlex.join(sys.argv)}` in `{ROOT}`", "", "| step | what | result | seconds |",
             "| --- | --- | --- | --- |"]
    for r in ctx.results:
        verdict = "skipped" if r.code is None else "ok" if r.code == 0 else f"FAILED (exit {r.code})"
        lines.append(f"| {r.step.name} | {r.step.what} | {verdict} | {r.seconds:.0f} |")
    for r in ctx.results:
        if r.code is None or not r.text:
            continue
        lines += ["", f"## {r.step.name}", "", "```", r.text.rstrip()[-20000:], "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/gpu-validate", description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="print the steps and their commands; run nothing")
    p.add_argument("--venv", default=str(ROOT / ".venv-gpu"), help="the virtual environment to set up and use "
                   "(default .venv-gpu; the project's .venv stays CPU-only)")
    p.add_argument("--out", default=None, help="report directory (default .bench/gpu-validation/<time>)")
    p.add_argument("--skip-install", action="store_true", help="use the venv as it is")
    p.add_argument("--quick", action="store_true", help="short measurements (a set-up check, not figures to record)")
    args = p.parse_args(argv)
    steps, python = plan(args)
    out = Path(args.out or ROOT / ".bench" / "gpu-validation" / time.strftime("%Y%m%d-%H%M%S"))
    if args.dry_run:
        print(f"scripts/gpu-validate would run, writing {out}/report.md:")
        for i, step in enumerate(steps, 1):
            print(f"{i}. {step.name}: {step.what}")
            for cmd in step.commands:
                print(f"     $ {shlex.join(cmd).replace('{out}', str(out))}")
        print(f"{len(steps) + 1}. report: {out}/report.md (every step's result and output)")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    ctx = Context(args, python, out)
    env_ok = True
    for step in steps:
        if step.needs_env and not env_ok:
            ctx.results.append(Result(step, None))
            continue
        print(f"[{time.strftime('%H:%M:%S')}] {step.name}: {step.what}", flush=True)
        t0 = time.monotonic()
        code = (step.run or run_commands)(step, ctx)
        text = (out / step.output).read_text() if step.output and (out / step.output).exists() else ""
        ctx.results.append(Result(step, code, time.monotonic() - t0, text))
        print(f"    {'ok' if code == 0 else f'FAILED (exit {code}), see {out / step.output}'}", flush=True)
        if code != 0 and step.name in ("venv", "onnxruntime-gpu", "providers"):
            env_ok = False  # nothing after this can run on the GPU
    (out / "report.md").write_text(report(ctx))
    print(f"report: {out / 'report.md'} (copy its tables into docs/gpu-validation.md)")
    return 0 if all(r.code == 0 for r in ctx.results) else 1


if __name__ == "__main__":
    sys.exit(main())
