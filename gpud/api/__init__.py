"""gpud's faces on the network: thin adapters over one `gpud.core_api.InferenceCore`, each owning its wire format.

KServe v2, wire-compatible with Triton (`tritonclient`, `perf_analyzer`):
- `http_server`: a small HTTP/1.1 server over httptools; it carries the KServe HTTP routes, the hot path, because
  aiohttp's per-request machinery costs more CPU than everything else gpud does for a small inference.
- `http_api`: the KServe HTTP routes and handlers; `http_infer`: inference request and response bodies (JSON and the
  binary tensor data extension).
- `grpc_api`: Triton's GRPCInferenceService, served by `grpcwire/` (gpud's own HTTP/2 server) or grpc.aio.
- `limits`: what a client may declare (tensor shapes), checked the same way by both front ends.
- `json_codec`: large JSON inference bodies decoded and large JSON answers encoded in child processes, so that the
  event loop never waits for them.

Prometheus:
- `metrics_server`: the /metrics endpoint on aiohttp. Scrapes are few and not latency-critical, so it uses the
  ordinary stack rather than the hot-path server.
"""

# Which server serves gRPC (--grpc-server): gpud's own (gpud.api.grpcwire), or grpcio's aio server
GRPC_SERVERS = ("gpud", "grpcio")
