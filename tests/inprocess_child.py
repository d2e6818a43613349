"""An application using gpud.Server, run as its own process by tests/test_inprocess_shutdown.py: it serves a few
requests, prints (one JSON line) its pid, its workers' pids and its shared-memory segments while serving, then
ends the way the mode says: stop(), an exception in a with block, async with, Ctrl-C (SIGINT to its process group)
while it waits, or exit without stopping (atexit)."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading

import numpy as np

import gpud
from gpud.executor.shm import _dir as shm_dir


def report(server: gpud.Server) -> None:
    server.infer("mlp", {"input": np.ones((2, 256), np.float32)})
    workers = [w["pid"] for w in server.inspect()["workers"]]
    prefix = f"gpud-{os.getpid()}-"
    segments = sorted(n for n in os.listdir(shm_dir()) if n.startswith(prefix))
    print(json.dumps({"pid": os.getpid(), "workers": workers, "segments": segments}), flush=True)


def main(repo: str, node: str, mode: str) -> int:
    # As an application started from a terminal: Ctrl-C raises KeyboardInterrupt, also when the test runner itself
    # was started with SIGINT ignored (`./scripts/test &`, nohup), which a child would otherwise inherit.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    settings = {"node": node, "placement_control": "off"}
    if mode == "stop":
        server = gpud.Server(repo, **settings).start()
        report(server)
        server.stop()
    elif mode == "with-error":
        try:
            with gpud.Server(repo, **settings) as server:
                report(server)
                raise KeyError("the application failed")
        except KeyError:
            pass
    elif mode == "async":
        async def run() -> None:
            async with gpud.Server(repo, **settings) as server:
                await server.infer_async("mlp", {"input": np.ones((1, 256), np.float32)})
                report(server)
        asyncio.run(run())
    elif mode == "ctrl-c":  # the terminal's Ctrl-C reaches the application and its workers (one process group)
        try:
            with gpud.Server(repo, **settings) as server:
                report(server)
                threading.Event().wait()
        except KeyboardInterrupt:
            pass
    elif mode == "atexit":
        report(gpud.Server(repo, **settings).start())  # never stopped: the interpreter's exit stops it
    else:
        raise SystemExit(f"unknown mode {mode}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
