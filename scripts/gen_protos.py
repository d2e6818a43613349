#!/usr/bin/env python3
"""Regenerate gpud/proto/*_pb2.py, *_pb2.pyi and grpc_service_pb2_grpc.py from gpud/proto/*.proto.

    python scripts/gen_protos.py            # rewrite the modules in gpud/proto/
    python scripts/gen_protos.py --out DIR  # write them to DIR instead (tests compare DIR with the tree)

Uses grpc_tools.protoc, whose bundled protoc fixes the protobuf runtime the generated code asks for
(`ValidateProtobufRuntimeVersion` in each *_pb2.py), so grpcio-tools and protobuf are pinned together.

protoc writes top-level imports (`import model_config_pb2`), which only work with gpud/proto on sys.path; we rewrite
them to `from gpud.proto import ...`. We also register descriptors in gpud.proto.DESCRIPTOR_POOL instead of protobuf's
default pool (see gpud/proto/__init__.py for why).
"""
from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = REPO_ROOT / "gpud" / "proto"
PROTO_FILES = ("model_config.proto", "grpc_service.proto")
PACKAGE = "gpud.proto"

_TOP_LEVEL_IMPORT = re.compile(r"^import (\w+_pb2) as (\w+)$", re.MULTILINE)
_DEFAULT_POOL = "_descriptor_pool.Default()"
_POOL_IMPORT = f"from {PACKAGE} import DESCRIPTOR_POOL as _GPUD_DESCRIPTOR_POOL\n"
_IMPORTS_MARKER = "# @@protoc_insertion_point(imports)\n"


def _run_protoc(out_dir: Path) -> None:
    from grpc_tools import protoc  # imported here so `--help` works without grpcio-tools

    include_dir = Path(protoc.__file__).parent / "_proto"  # google/protobuf/*.proto, should a file need them
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_DIR}",
        f"-I{include_dir}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(PROTO_DIR / name) for name in PROTO_FILES),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed (see its messages above)")


def _fix_module(text: str) -> str:
    """Package-qualify imports between generated modules and use gpud's own descriptor pool."""
    text = _TOP_LEVEL_IMPORT.sub(rf"from {PACKAGE} import \1 as \2", text)
    if _DEFAULT_POOL in text:
        if _IMPORTS_MARKER not in text:
            raise SystemExit("generated code changed shape: no imports insertion point; update gen_protos.py")
        text = text.replace(_IMPORTS_MARKER, _IMPORTS_MARKER + _POOL_IMPORT, 1)
        text = text.replace(_DEFAULT_POOL, "_GPUD_DESCRIPTOR_POOL")
    return text


def generate(out_dir: Path) -> list[Path]:
    """Write the fixed-up generated modules to out_dir; return their paths, sorted."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as raw_dir_name:
        raw_dir = Path(raw_dir_name)
        _run_protoc(raw_dir)
        written = []
        for raw in sorted(raw_dir.iterdir()):
            text = raw.read_text()
            # protoc writes an empty *_pb2_grpc.py for files without services; it would only be noise
            if raw.name.endswith("_pb2_grpc.py") and "class " not in text:
                continue
            target = out_dir / raw.name
            target.write_text(_fix_module(text))
            written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=PROTO_DIR, help="output directory (default: gpud/proto)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
