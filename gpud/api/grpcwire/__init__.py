"""gpud's own gRPC server: HTTP/2 (cleartext, prior knowledge, as gRPC clients speak it) on asyncio, for unary and
streaming calls of any protobuf service. It exists because grpcio's Python server costs 250-370 µs of CPU per call
before the handler runs (docs/benchmarks.md, issue 25); this one decodes a call's repeated headers from a cache and
writes each answer's frames at once.

- `hpack_decoder`: the header decoder (RFC 7541) with a cache for header blocks that repeat (named apart from the
  `hpack` package, whose Huffman code and static table it uses).
- `frames`: HTTP/2 frame layout (RFC 9113) and the fixed frames gpud sends.
- `calls`: what a handler sees (the call's context), statuses, the gRPC message framing.
- `keepalive`: keepalive PINGs, the client ping policy and idle connections (gRPC core's rules, Triton's flags).
- `connection`: one client connection: streams, flow control, dispatch to the method's handler.
- `server`: listening, the connections, a graceful stop.
"""
