"""gpud: a node daemon for GPU servers, and the same server in-process (`gpud.Server`)."""
__version__ = "0.1.0"

from gpud import compiled as _compiled  # noqa: E402 - before any other gpud module: they may load compiled

_compiled.install()

__all__ = ["Server", "InferenceError", "InferenceTimeout", "ErrorKind", "__version__"]


def __getattr__(name: str):
    # Imported on first use: the daemon, gpudctl and the device workers import `gpud` without the server's weight.
    if name in ("Server", "InferenceTimeout"):
        from gpud import inprocess

        return getattr(inprocess, name)
    if name in ("InferenceError", "ErrorKind"):
        from gpud.executor import types

        return getattr(types, name)
    raise AttributeError(f"module 'gpud' has no attribute {name!r}")
