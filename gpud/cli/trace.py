"""`gpudctl trace`: show or change which requests the running gpud traces (Triton's trace extension,
`/v2[/models/M]/trace/setting`), over HTTP with the admin token or over the admin socket; or sum up a trace file
(`--summary FILE`, no daemon needed)."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any
from urllib.parse import quote

from gpud.cli.client import add_endpoint_arguments, show_or_change
from gpud.tracing.settings import LEVELS, OFF
from gpud.tracing.summary import render as render_summary
from gpud.tracing.summary import summarize

_CLEARABLE = {"level": "trace_level", "rate": "trace_rate", "count": "trace_count",
              "log-frequency": "log_frequency"}


def trace_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="gpudctl trace",
        description="Show which requests the running gpud traces, or change it while it runs: the level (OFF, "
                    "TIMESTAMPS, TENSORS), the rate (every N-th request), the count (then stop; -1 no limit) and "
                    "the log frequency (traces per file), for every model or for one (--model). A model's own "
                    "settings take the rest from the global ones; --clear gives a setting back to them. The trace "
                    "file is set when gpud starts (--trace-config triton,file=PATH). A change is an admin action "
                    "(the admin token, or the admin socket). With --summary, sum up trace files instead.",
        epilog="e.g. gpudctl trace --level TIMESTAMPS --rate 100; gpudctl trace --model mlp --level TENSORS "
               "--count 10; gpudctl trace --model mlp --clear level count; gpudctl trace --summary /tmp/trace.json")
    p.add_argument("--model", default="", metavar="NAME", help="a model's settings instead of the global ones")
    p.add_argument("--level", nargs="+", type=str.upper, choices=[OFF, *LEVELS], metavar="LEVEL",
                   help=f"OFF, or any of {', '.join(LEVELS)}")
    p.add_argument("--rate", type=int, metavar="N", help="trace every N-th request")
    p.add_argument("--count", type=int, metavar="N", help="take N more traces, then stop (-1: no limit)")
    p.add_argument("--log-frequency", type=int, metavar="N",
                   help="write every N traces to a file of their own (FILE.0, FILE.1, ...); 0: all to FILE")
    p.add_argument("--clear", nargs="+", choices=list(_CLEARABLE), metavar="SETTING",
                   help="give these settings back to the global ones (of the global ones: to what gpud started "
                        f"with): {', '.join(_CLEARABLE)}")
    p.add_argument("--json", action="store_true", help="print the settings as gpud answers them (JSON)")
    p.add_argument("--summary", nargs="+", metavar="FILE",
                   help="sum up these trace files per model (Triton's format, gpud's or Triton's own) and exit")
    add_endpoint_arguments(p)
    args = p.parse_args(argv)
    if args.summary:
        return _summary(args.summary)
    path = f"/v2/models/{quote(args.model, safe='')}/trace/setting" if args.model else "/v2/trace/setting"
    return show_or_change("gpudctl trace", args, path, changes_of(args), render)


def changes_of(args: argparse.Namespace) -> dict[str, Any]:
    """The trace setting request the flags make (Triton's names, values as strings); empty: only show them."""
    changes: dict[str, Any] = {}
    if args.level is not None:
        changes["trace_level"] = args.level
    for flag, name in (("rate", "trace_rate"), ("count", "trace_count"), ("log_frequency", "log_frequency")):
        value = getattr(args, flag)
        if value is not None:
            changes[name] = str(value)
    for flag in args.clear or ():
        changes[_CLEARABLE[flag]] = None
    return changes


def render(settings: dict[str, Any]) -> str:
    """The settings for a person: one per line."""
    rows = [(name, " ".join(value) if isinstance(value, list) else str(value)) for name, value in settings.items()]
    rows = [(name, value or "(none: set when gpud starts, --trace-config triton,file=PATH)") for name, value in rows]
    return "\n".join(f"{name:<14} {value}" for name, value in rows)


def _summary(paths: list[str]) -> int:
    objects: list[Any] = []
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                loaded = json.load(f)
        except (OSError, ValueError) as exc:
            print(f"gpudctl trace: {path}: cannot read a trace file: {exc}", file=sys.stderr)
            return 1
        if not isinstance(loaded, list):
            print(f"gpudctl trace: {path}: not a trace file (a JSON array of Triton's trace objects)", file=sys.stderr)
            return 1
        objects += loaded
    try:
        print(render_summary(summarize(objects)))
    except (ValueError, KeyError, TypeError) as exc:
        print(f"gpudctl trace: not a trace file: {exc}", file=sys.stderr)
        return 1
    return 0
