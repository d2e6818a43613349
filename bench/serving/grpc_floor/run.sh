#!/usr/bin/env bash
# The floor of a gRPC call in Python (docs/benchmarks.md, issue 25): a generic unary handler answering 100 bytes,
# grpcio's servers (grpc.aio, grpc.aio on uvloop, the thread-pool server), a minimal one on the h2 library and gpud's
# own (gpud.api.grpcwire, with the project's .venv), each driven by the same Python client (20,000 calls, 32 in
# flight); prints calls/s and the server's CPU per call.
#   bash bench/serving/grpc_floor/run.sh        (makes a venv with grpcio, h2 and uvloop under .bench/)
set -euo pipefail
cd "$(dirname "$0")"
venv=../../../.bench/venv-grpc-floor
[ -x "$venv/bin/python" ] || { python3 -m venv "$venv" && "$venv/bin/pip" install -q grpcio h2 uvloop; }
cpu() { awk '{print $14+$15}' "/proc/$1/stat"; }
for mode in aio aio-uvloop sync h2 gpud; do
  case $mode in
    h2) "$venv/bin/python" h2_server.py 50113 & ;;
    gpud) PYTHONPATH=../../.. ../../../.venv/bin/python gpud_server.py 50113 & ;;
    *) "$venv/bin/python" grpcio_server.py "$mode" 50113 & ;;
  esac
  pid=$!; sleep 2; t0=$(cpu $pid)
  rate=$("$venv/bin/python" client.py 50113 20000 32)
  t1=$(cpu $pid); kill $pid; wait $pid 2>/dev/null || true
  echo "$mode: $rate, server CPU $(( (t1 - t0) * 10000 / 20000 )) us a call"
done
