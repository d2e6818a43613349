"""`gpudctl check`: validates a node (and gpud on it) end to end. See command.py."""
from gpud.cli.check.command import check_main

__all__ = ["check_main"]
