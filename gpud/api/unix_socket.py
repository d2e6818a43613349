"""The admin socket's file (`--admin-socket`): a unix stream socket whose permissions decide who may use it.

Created with mode 0660, owned by gpud's user and group (under systemd: /run/gpud, the unit's RuntimeDirectory), so
gpud's user and the members of its group may connect, nobody else. A socket file left by a gpud that died is
replaced; a live one (another gpud serving it) or a path that is not a socket is refused, never removed.
"""
from __future__ import annotations

import errno
import os
import socket
import stat

SOCKET_MODE = 0o660


def bind_unix_socket(path: str, mode: int = SOCKET_MODE) -> socket.socket:
    """A listening-ready socket bound at `path` with `mode`; OSError with the reason when it cannot be."""
    if len(os.fsencode(path)) > 107:  # sun_path holds 108 bytes with its NUL
        raise OSError(errno.ENAMETOOLONG, f"admin socket path {path} is longer than a unix socket path may be "
                                          "(107 bytes)")
    _remove_stale(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        # bind creates the file with 0777 & ~umask (under the unit's UMask=0077: 0600); set what we mean.
        os.chmod(path, mode)
    except OSError as exc:
        sock.close()
        hint = " (its directory must exist and be gpud's to write: under systemd, RuntimeDirectory=gpud makes " \
               "/run/gpud)" if exc.errno in (errno.ENOENT, errno.EACCES) else ""
        raise OSError(exc.errno, f"admin socket {path}: {exc.strerror}{hint}") from None
    return sock


def _remove_stale(path: str) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise OSError(errno.EEXIST, f"admin socket path {path} exists and is not a socket; not removing it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)  # left by a gpud that is gone
        return
    except OSError as exc:
        raise OSError(exc.errno, f"admin socket {path}: {exc.strerror}") from None
    finally:
        probe.close()
    raise OSError(errno.EADDRINUSE, f"admin socket {path} is in use (another gpud serves it)")


def remove_socket_file(path: str, sock_inode: int | None) -> None:
    """Remove our socket file at exit; one that another process has put there since is left alone."""
    try:
        if sock_inode is None or os.lstat(path).st_ino == sock_inode:
            os.unlink(path)
    except FileNotFoundError:
        pass
