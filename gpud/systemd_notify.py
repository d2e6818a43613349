"""sd_notify without libsystemd: a datagram to $NOTIFY_SOCKET (Type=notify units). Silent when not under systemd.

The watchdog (`WatchdogSec=` in the unit): systemd sets $WATCHDOG_USEC and restarts gpud when no `WATCHDOG=1`
arrives within it. The pings are sent from the event loop itself, so a stalled loop (a blocking call, a deadlock)
stops them and systemd restarts the daemon: a loop that cannot answer health checks is not reported healthy.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable, Mapping

log = logging.getLogger("gpud")


def notify(message: str) -> bool:
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return False
    if path.startswith("@"):  # abstract namespace socket
        path = "\0" + path[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.connect(path)
            s.sendall(message.encode())
        return True
    except OSError:
        return False


def watchdog_interval_s(env: Mapping[str, str], pid: int) -> float | None:
    """How often to ping: half of $WATCHDOG_USEC (systemd's advice), or None when the watchdog is off or meant for
    another process ($WATCHDOG_PID)."""
    usec = env.get("WATCHDOG_USEC", "")
    owner = env.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0 or (owner and owner != str(pid)):
        return None
    return int(usec) / 2e6


async def watchdog(interval_s: float, send: Callable[[str], bool] = notify) -> None:
    """Ping every `interval_s` from the event loop (cancel to stop)."""
    log.info("systemd watchdog: pinging every %.1f s", interval_s)
    while True:
        send("WATCHDOG=1")
        await asyncio.sleep(interval_s)
