"""`gpudctl load MODEL` / `gpudctl unload MODEL`: the repository API's load and unload (Triton's
`POST /v2/repository/models/<name>/load|unload`), over HTTP with the admin token or over the admin socket."""
from __future__ import annotations

import argparse
import sys

from gpud.cli.client import GpudUnreachable, add_endpoint_arguments, endpoint, post_json


def models_main(action: str, argv: list[str]) -> int:
    what = ("Load a model of the running gpud's repository; loading a loaded model reloads it (its new versions "
            "serve before the old ones unload: no gap)." if action == "load" else
            "Unload a model from the running gpud: it finishes the requests it accepted, then its instances go.")
    p = argparse.ArgumentParser(prog=f"gpudctl {action}", description=f"{what} gpud must allow it "
                                "(--model-control-mode explicit or poll).")
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
