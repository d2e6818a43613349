"""Minimal unary gRPC server on h2 + asyncio: one fixed answer per call (feasibility of a non-grpcio gRPC front end)."""
import asyncio
import sys
import h2.config
import h2.connection
import h2.events
RESP = b"x" * 100
FRAME = b"\x00" + len(RESP).to_bytes(4, "big") + RESP
HEADERS = [(":status", "200"), ("content-type", "application/grpc")]
TRAILERS = [("grpc-status", "0")]
class P(asyncio.Protocol):
    def connection_made(self, t):
        self.t = t
        self.c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding=None))
        self.c.initiate_connection(); t.write(self.c.data_to_send())
    def data_received(self, data):
        for ev in self.c.receive_data(data):
            if isinstance(ev, h2.events.DataReceived):
                self.c.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
            elif isinstance(ev, h2.events.StreamEnded):
                sid = ev.stream_id
                self.c.send_headers(sid, HEADERS); self.c.send_data(sid, FRAME); self.c.send_headers(sid, TRAILERS, end_stream=True)
        out = self.c.data_to_send()
        if out: self.t.write(out)
async def main():
    srv = await asyncio.get_running_loop().create_server(P, "127.0.0.1", int(sys.argv[1]))
    print("up", flush=True); await srv.serve_forever()
import uvloop; uvloop.run(main())
