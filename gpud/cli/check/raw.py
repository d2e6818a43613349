"""Raw onnxruntime on one device: the baseline `gpudctl check` holds gpud's served throughput against.

Run as `python -m gpud.cli.check.raw --device JSON --model-dir DIR --batch-sizes 1,8 --seconds S` in the environment
a worker for that device gets (gpud.executor.supervisor.worker_env: exactly that CUDA device visible). It builds the
session exactly as gpud's worker does (gpud.executor.onnxruntime_backend: same providers, stream, threads, FP32 policy)
and runs batches back to back in one thread, nothing else: the limit a server can approach. Prints one JSON object:
{"provider": ..., "rows_per_s": {"<batch>": rows/s}}.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from gpud.executor.device import WorkerDevice
from gpud.executor.datatypes import numpy_dtype
from gpud.executor.onnxruntime_backend import OnnxRuntimeInstance
from gpud.repository.layout import load_model


def measure(instance: OnnxRuntimeInstance, batch_sizes: list[int], seconds: float, seed: int = 0) -> dict[int, float]:
    """rows/s at each batch size: a warm-up of a fifth of `seconds` (at least 0.2 s: the first runs of a shape pay
    for kernel loading and algorithm search on a GPU), then batches back to back for `seconds`."""
    config = instance.config
    outputs = [o.name for o in config.outputs]
    rng = np.random.default_rng(seed)
    out = {}
    for batch in batch_sizes:
        feed = {spec.name: rng.standard_normal((batch, *spec.dims)).astype(numpy_dtype(spec.datatype))
                for spec in config.inputs}
        warm_until = time.perf_counter() + max(0.2, seconds / 5)
        instance.run(feed, outputs)
        while time.perf_counter() < warm_until:
            instance.run(feed, outputs)
        n, t0 = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - t0) < seconds or n == 0:
            instance.run(feed, outputs)
            n += 1
        out[batch] = n * batch / elapsed
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpud-check-raw", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", required=True, help="the device (gpud.executor.device.WorkerDevice as JSON)")
    parser.add_argument("--model-dir", required=True, help="a model directory of a Triton-layout repository")
    parser.add_argument("--batch-sizes", required=True, help="comma list, e.g. 1,8,64")
    parser.add_argument("--seconds", type=float, default=1.0, help="per batch size")
    args = parser.parse_args(argv)
    device = WorkerDevice(**json.loads(args.device))
    entry = load_model(args.model_dir)
    instance = OnnxRuntimeInstance(entry.model_path(), entry.config, device)
    rows = measure(instance, [int(b) for b in args.batch_sizes.split(",") if b], args.seconds)
    json.dump({"provider": instance.provider, "rows_per_s": {str(b): r for b, r in rows.items()}}, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
