"""PyTriton (nvidia-pytriton 0.7, Triton 2.51) serving ONNX models through Python @batch functions.

Run inside .bench/venv-pytriton:
  python pytriton_server.py --http-port P --grpc-port P --metrics-port P [--max-batch-size 64 --delay-us 3000]
                            NAME=MODEL.onnx [NAME=MODEL.onnx ...]
Triton's dynamic batcher forms the batches (max_queue_delay_microseconds); @batch hands each to onnxruntime.
"""
import argparse
import os
import sys

import numpy as np
from pytriton.decorators import batch
from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
from pytriton.triton import Triton, TritonConfig, TritonSecurityConfig

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ort_session import make_session  # noqa: E402


def make_infer(session):
    @batch
    def infer(input):  # noqa: A002 - the tensor is called "input" in the model
        return {"output": session.run(["output"], {"input": input})[0]}

    return infer


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--http-port", type=int, required=True)
    p.add_argument("--grpc-port", type=int, required=True)
    p.add_argument("--metrics-port", type=int, required=True)
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--delay-us", type=int, default=3000)
    p.add_argument("--intra-op-threads", type=int, default=0)
    p.add_argument("models", nargs="+", metavar="NAME=PATH")
    args = p.parse_args()
    config = TritonConfig(http_address="127.0.0.1", http_port=args.http_port, grpc_address="127.0.0.1",
                          grpc_port=args.grpc_port, metrics_address="127.0.0.1", metrics_port=args.metrics_port,
                          allow_gpu_metrics=False)
    # PyTriton 0.7 puts the statistics endpoint behind a generated access token by default; perf_analyzer reads
    # statistics, and Triton itself restricts nothing by default, so open statistics only.
    security = TritonSecurityConfig(restricted_endpoints=["shared-memory", "model-repository", "trace", "logging"])
    with Triton(config=config, security_config=security) as triton:
        for spec in args.models:
            name, path = spec.split("=", 1)
            triton.bind(
                model_name=name,
                infer_func=make_infer(make_session(path, args.intra_op_threads)),
                inputs=[Tensor(name="input", dtype=np.float32, shape=(256,))],
                outputs=[Tensor(name="output", dtype=np.float32, shape=(16,))],
                config=ModelConfig(max_batch_size=args.max_batch_size,
                                   batcher=DynamicBatcher(max_queue_delay_microseconds=args.delay_us)),
                strict=False,
            )
        triton.serve()


if __name__ == "__main__":
    main()
