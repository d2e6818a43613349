"""`gpudctl load MODEL` / `gpudctl unload MODEL`: the repository API's load and unload (Triton's
`POST /v2/repository/models/<name>/load|unload`), over HTTP with the admin token or over the admin socket."""
from __future__ import annotations

import argparse
import sys

from gpud.cli.client import GpudUnreachable, add_endpoint_arguments, endpoint, post_json


def models_main(action: str, argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog=f"gpudctl {action}",
        description=f"{action.capitalize()} a model of the running gpud's repository. gpud must allow it "
                    "(--model-control-mode explicit or poll); a reload is a load of a loaded model (its new "
                    "version serves before the old one unloads: no gap).")
    p.add_argument("model", help="the model's name (its directory in the repository)")
    add_endpoint_arguments(p)
    args = p.parse_args(argv)
    try:
        post_json(endpoint(args.url, args.socket), f"/v2/repository/models/{args.model}/{action}", {},
                  token_file=args.token_file)
    except GpudUnreachable as exc:
        print(f"gpudctl {action}: {exc}", file=sys.stderr)
        return 1
    print(f"model {args.model} {action}ed", file=sys.stderr)
    return 0
