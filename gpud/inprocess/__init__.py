"""gpud in an application's process: `Server` (server.py: the daemon's components on a thread of their own, and the
calls into them) and what one call is made of (calls.py)."""
from gpud.inprocess.calls import InferenceTimeout, make_request
from gpud.inprocess.server import DAEMON_ONLY_SETTINGS, Server

__all__ = ["DAEMON_ONLY_SETTINGS", "InferenceTimeout", "Server", "make_request"]
