"""A Python client for the gRPC floor: `client.py PORT CALLS IN_FLIGHT` prints calls/s (run.sh)."""
import sys
import grpc
import time
port = int(sys.argv[1]); n = int(sys.argv[2]); conc = int(sys.argv[3])
ch = grpc.insecure_channel(f"127.0.0.1:{port}")
m = ch.unary_unary("/t.S/M")
m(b"a")
t = time.time(); inflight = []
done = 0
while done < n:
    while len(inflight) < conc: inflight.append(m.future(b"a"*100))
    inflight.pop(0).result(); done += 1
for f in inflight: f.result()
print(f"{n/(time.time()-t):.0f} calls/s")
