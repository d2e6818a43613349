"""The one way every contestant builds its onnxruntime session, so the engine is configured identically everywhere.

gpud's worker (gpud/executor/onnxruntime_backend.py) uses: no spin-waiting, inter_op 1, sequential execution, intra_op
threads from the model config or onnxruntime's default. The raw in-process measurement and the peers' workers use the
same settings through this module. It depends on onnxruntime only, so the peers' virtual environments can import it.
"""
from __future__ import annotations

import onnxruntime as ort


def make_session(model_path: str, intra_op_threads: int = 0) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    opts.add_session_config_entry("session.inter_op.allow_spinning", "0")
    if intra_op_threads > 0:
        opts.intra_op_num_threads = intra_op_threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    return ort.InferenceSession(model_path, sess_options=opts, providers=["CPUExecutionProvider"])
