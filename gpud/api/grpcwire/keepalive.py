"""Keepalive, client ping policy and idle connections for gpud's gRPC server: gRPC core's rules (grpc/grpc
doc/keepalive.md; chttp2's ping_abuse_policy.cc) under Triton's flags and defaults (--grpc-keepalive-time etc.).

- Keepalive: every `time_ms` the server PINGs a connection that has a call open (any connection with
  `permit_without_calls`); no ACK within `timeout_ms` and the connection is closed (a dead or half-open client). At
  most `max_pings_without_data` PINGs go out while the server sends no HEADERS or DATA (0: no limit), as in core.
- Ping policy: a client PING sooner than `min_recv_ping_interval_without_data_ms` after the previous one is a
  strike; two hours is the interval instead while no call is open, unless `permit_without_calls` (RFC 1122's TCP
  keepalive). Sending HEADERS or DATA forgives the strikes. Over `max_ping_strikes` strikes (0: no limit) the
  connection gets GOAWAY ENHANCE_YOUR_CALM "too_many_pings" and is closed.
- Idle: a connection with no call open for `max_connection_idle_ms` (0: never; gRPC core's
  GRPC_ARG_MAX_CONNECTION_IDLE_MS, which Triton has no flag for) gets GOAWAY NO_ERROR and is closed. As core's idle
  filter, it is checked by a timer each period rather than timed per call: a connection goes after one to two
  periods without a call.
"""
from __future__ import annotations

from dataclasses import dataclass

MAX_MS = 2**31 - 1  # gRPC core's channel arguments are C ints (as Triton's flags)
IDLE_TRANSPORT_PING_INTERVAL_S = 2 * 3600.0  # the interval of client pings while no call is open (RFC 1122)


@dataclass(frozen=True)
class Keepalive:
    """The settings (Triton's flags; gRPC core's channel arguments, `grpc_options`)."""

    time_ms: int = 7_200_000  # GRPC_ARG_KEEPALIVE_TIME_MS
    timeout_ms: int = 20_000  # GRPC_ARG_KEEPALIVE_TIMEOUT_MS
    permit_without_calls: bool = False  # GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS
    max_pings_without_data: int = 2  # GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA (0: no limit)
    min_recv_ping_interval_without_data_ms: int = 300_000  # GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS
    max_ping_strikes: int = 2  # GRPC_ARG_HTTP2_MAX_PING_STRIKES (0: no limit)
    max_connection_idle_ms: int = 0  # GRPC_ARG_MAX_CONNECTION_IDLE_MS (0: never)

    def grpc_options(self) -> list[tuple[str, int]]:
        """The same, as grpcio's server options."""
        options = [("grpc.keepalive_time_ms", self.time_ms),
                   ("grpc.keepalive_timeout_ms", self.timeout_ms),
                   ("grpc.keepalive_permit_without_calls", int(self.permit_without_calls)),
                   ("grpc.http2.max_pings_without_data", self.max_pings_without_data),
                   ("grpc.http2.min_ping_interval_without_data_ms", self.min_recv_ping_interval_without_data_ms),
                   ("grpc.http2.max_ping_strikes", self.max_ping_strikes)]
        if self.max_connection_idle_ms:  # core's "never" is INT_MAX, not 0
            options.append(("grpc.max_connection_idle_ms", self.max_connection_idle_ms))
        return options


class PingStrikes:
    """A connection's client pings, judged as gRPC core's server does (chttp2 Chttp2PingAbusePolicy): pure, the
    time passed in (seconds of the connection's clock)."""

    __slots__ = ("min_interval_s", "max_strikes", "last_s", "strikes")

    def __init__(self, keepalive: Keepalive):
        self.min_interval_s = keepalive.min_recv_ping_interval_without_data_ms / 1000
        self.max_strikes = keepalive.max_ping_strikes
        self.last_s = float("-inf")
        self.strikes = 0

    def received(self, now_s: float, idle: bool) -> bool:
        """A PING came at `now_s`; `idle`: no call open and keepalive pings not permitted without calls. True: the
        strikes are over the limit (send GOAWAY ENHANCE_YOUR_CALM and close)."""
        allowed_s = self.last_s + (IDLE_TRANSPORT_PING_INTERVAL_S if idle else self.min_interval_s)
        self.last_s = now_s
        if allowed_s <= now_s:
            return False
        self.strikes += 1  # too soon
        return self.max_strikes != 0 and self.strikes > self.max_strikes

    def forgive(self) -> None:
        """The server sent HEADERS or DATA: data flows, earlier pings are no abuse."""
        self.last_s = float("-inf")
        self.strikes = 0
