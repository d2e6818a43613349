"""sd_notify without libsystemd: a datagram to $NOTIFY_SOCKET (Type=notify units). Silent when not under systemd."""
from __future__ import annotations

import os
import socket


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
