"""`gpudctl log`: show or change what the running gpud logs (Triton's logging extension, `/v2/logging`), over HTTP
with the admin token or over the admin socket."""
from __future__ import annotations

import argparse
from typing import Any

from gpud.cli.client import add_endpoint_arguments, show_or_change
from gpud.executor.process_log import FORMATS

_SWITCHES = {"on": True, "off": False}


def log_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="gpudctl log",
        description="Show what the running gpud logs, or change it while it runs: each level on its own, a verbose "
                    "level (above 0: DEBUG records), the timestamp format. A change applies at once to the daemon "
                    "and every process of it, holds until changed again or a reload changes the log settings, and is "
                    "an "
                    "admin action (the admin token, or the admin socket).",
        epilog="e.g. gpudctl log --verbose 1; gpudctl log --verbose 0 --format ISO8601; gpudctl log --info off")
    p.add_argument("--verbose", type=int, metavar="N", help="the verbose level: 0 none, 1 or more adds DEBUG")
    for level in ("info", "warning", "error"):
        p.add_argument(f"--{level}", choices=list(_SWITCHES), help=f"write {level.upper()} records or not")
    p.add_argument("--format", choices=FORMATS,
                   help="the timestamp: default (local time) or ISO8601 (UTC)")
    p.add_argument("--json", action="store_true", help="print the settings as gpud answers them (JSON)")
    add_endpoint_arguments(p)
    args = p.parse_args(argv)
    if args.verbose is not None and args.verbose < 0:
        p.error(f"--verbose must be 0 or more, got {args.verbose}")
    return show_or_change("gpudctl log", args, "/v2/logging", changes_of(args), render)


def changes_of(args: argparse.Namespace) -> dict[str, Any]:
    """The log setting request the flags make (Triton's names); empty: only show them."""
    changes: dict[str, Any] = {}
    if args.verbose is not None:
        changes["log_verbose_level"] = args.verbose
    for level in ("info", "warning", "error"):
        if getattr(args, level) is not None:
            changes[f"log_{level}"] = _SWITCHES[getattr(args, level)]
    if args.format is not None:
        changes["log_format"] = args.format
    return changes


def render(settings: dict[str, Any]) -> str:
    """The settings for a person: one per line."""
    def shown(value: Any) -> str:
        return ("on" if value else "off") if isinstance(value, bool) else str(value)

    names = ("log_info", "log_warning", "log_error", "log_verbose_level", "log_format")
    rows: list[tuple[str, str]] = [(name, shown(settings[name])) for name in names if name in settings]
    rows.append(("log_file", settings.get("log_file") or "(standard error; the journal under systemd)"))
    return "\n".join(f"{name:<18} {value}" for name, value in rows)
