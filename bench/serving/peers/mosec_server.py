"""mosec 0.9.8 serving one ONNX model, as its users write it: a Worker with dynamic batching.

Run inside .bench/venv-mosec:  BENCH_MODEL=path BENCH_SERDE=json|msgpack python mosec_server.py --port P ...
Settings come from the environment because mosec parses sys.argv itself.
  BENCH_SERDE=json:    body {"input": [256 floats]}           -> [16 floats]
  BENCH_SERDE=msgpack: body msgpack {"input": <float32 bytes>} -> msgpack <float32 bytes>
"""
import os
import sys

import numpy as np
from mosec import Server, Worker
from mosec.mixin import MsgpackMixin

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ort_session import make_session  # noqa: E402

MAX_BATCH_SIZE = int(os.environ.get("BENCH_MAX_BATCH", "64"))
MAX_WAIT_MS = int(os.environ.get("BENCH_MAX_WAIT_MS", "3"))


class JsonInfer(Worker):
    def __init__(self):
        super().__init__()
        self.session = make_session(os.environ["BENCH_MODEL"], int(os.environ.get("BENCH_INTRA_OP", "0")))

    def forward(self, data: list) -> list:
        x = np.asarray([d["input"] for d in data], dtype=np.float32)
        return self.session.run(["output"], {"input": x})[0].tolist()


class MsgpackInfer(MsgpackMixin, Worker):
    def __init__(self):
        super().__init__()
        self.session = make_session(os.environ["BENCH_MODEL"], int(os.environ.get("BENCH_INTRA_OP", "0")))

    def forward(self, data: list) -> list:
        x = np.stack([np.frombuffer(d["input"], dtype=np.float32) for d in data])
        out = self.session.run(["output"], {"input": x})[0]
        return [row.tobytes() for row in out]


if __name__ == "__main__":
    worker = MsgpackInfer if os.environ.get("BENCH_SERDE", "json") == "msgpack" else JsonInfer
    server = Server()
    server.append_worker(worker, num=1, max_batch_size=MAX_BATCH_SIZE, max_wait_time=MAX_WAIT_MS)
    server.run()
