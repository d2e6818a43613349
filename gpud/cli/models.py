"""`gpudctl load MODEL` / `gpudctl unload MODEL`: the repository API's load and unload (Triton's
`POST /v2/repository/models/<name>/load|unload`), over HTTP with the admin token or over the admin socket.
`gpudctl load --config FILE [--file VERSION/NAME=PATH ...]` loads with Triton's overrides."""
from __future__ import annotations

import argparse
import base64
import json
import sys
from typing import Any

from gpud.cli.client import GpudUnreachable, add_endpoint_arguments, endpoint, post_json


def models_main(action: str, argv: list[str]) -> int:
    what = ("Load a model of the running gpud's repository; loading a loaded model reloads it (its new versions "
            "serve before the old ones unload: no gap)." if action == "load" else
            "Unload a model from the running gpud: it finishes the requests it accepted, then its instances go.")
    p = argparse.ArgumentParser(prog=f"gpudctl {action}", description=f"{what} gpud must allow it "
                                "(--model-control-mode explicit or poll).")
    p.add_argument("model", help="the model's name (its directory in the repository)")
    if action == "load":
        p.add_argument("--config", metavar="FILE",
                       help="load with this model configuration instead of config.pbtxt (Triton's 'config' load "
                            "parameter): a JSON file of model_config.proto's ModelConfig, or a config.pbtxt; gpud "
                            "must run with --model-control-mode explicit")
        p.add_argument("--file", action="append", default=[], metavar="VERSION/NAME=PATH",
                       help="a model file for the load (Triton's 'file:' parameter), e.g. 1/model.onnx=./m.onnx; "
                            "repeat it; with files the model is loaded from them alone, and --config is needed")
    add_endpoint_arguments(p)
    args = p.parse_args(argv)
    try:
        body = _load_parameters(args) if action == "load" else {}
    except (OSError, ValueError) as exc:
        print(f"gpudctl {action}: {exc}", file=sys.stderr)
        return 2
    try:
        post_json(endpoint(args.url, args.socket), f"/v2/repository/models/{args.model}/{action}", body,
                  token_file=args.token_file)
    except GpudUnreachable as exc:
        print(f"gpudctl {action}: {exc}", file=sys.stderr)
        return 1
    print(f"model {args.model} {action}ed", file=sys.stderr)
    return 0


def _load_parameters(args: argparse.Namespace) -> dict[str, Any]:
    """The load request's body for --config and --file (ValueError or OSError naming the file at fault)."""
    params: dict[str, Any] = {}
    if args.config:
        params["config"] = _config_json(args.config)
    for spec in args.file:
        target, sep, path = spec.partition("=")
        if not sep or not target or not path:
            raise ValueError(f"--file {spec!r}: expected VERSION/NAME=PATH, e.g. 1/model.onnx=./model.onnx")
        with open(path, "rb") as f:
            params[f"file:{target}"] = base64.b64encode(f.read()).decode("ascii")
    if args.file and not args.config:
        raise ValueError("--file needs --config: the configuration of the model the files make up")
    return {"parameters": params} if params else {}


def _config_json(path: str) -> str:
    """A model configuration file as JSON text: JSON as it is, config.pbtxt (Triton's text format) converted."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        json.loads(text)
        return text
    except json.JSONDecodeError:
        pass
    from google.protobuf import json_format, text_format

    from gpud.proto import model_config_pb2 as mc
    try:
        message = text_format.Parse(text, mc.ModelConfig())
    except text_format.ParseError as exc:
        raise ValueError(f"{path}: neither JSON nor a model configuration in config.pbtxt's format: {exc}") from None
    return json_format.MessageToJson(message, preserving_proto_field_name=True)
