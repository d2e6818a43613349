"""The checked-in generated protobuf modules match the .proto files, and the .proto files match Triton's wire format."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = REPO_ROOT / "gpud" / "proto"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def _generated_files(directory: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(directory.iterdir()) if p.name.endswith(GENERATED_SUFFIXES)}


def test_checked_in_modules_are_regenerated_identically(tmp_path):
    pytest.importorskip("grpc_tools.protoc", reason="grpcio-tools not installed")
    subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "gen_protos.py"), "--out", str(tmp_path)],
        check=True, capture_output=True, timeout=120,
    )
    fresh = _generated_files(tmp_path)
    checked_in = _generated_files(PROTO_DIR)
    assert sorted(fresh) == sorted(checked_in), "run `python scripts/gen_protos.py` and keep its output"
    stale = [name for name in fresh if fresh[name] != checked_in[name]]
    assert not stale, f"stale generated modules {stale}: run `python scripts/gen_protos.py`"


def _messages(file_descriptor):
    """Every message of a file, nested ones included, by full name."""
    pending = list(file_descriptor.message_types_by_name.values())
    while pending:
        message = pending.pop()
        yield message.full_name, message
        pending.extend(message.nested_types)


@pytest.mark.parametrize("ours_module, triton_module", [
    ("gpud.proto.model_config_pb2", "tritonclient.grpc.model_config_pb2"),
    ("gpud.proto.grpc_service_pb2", "tritonclient.grpc.service_pb2"),
])
def test_fields_have_tritons_numbers_and_types(ours_module, triton_module):
    """Fields we share with the Triton protos that tritonclient ships have the same number, type and cardinality.

    Fields Triton added after that tritonclient release (e.g. ModelConfig.runtime) have no counterpart and are skipped;
    a number that tritonclient gives to a differently named field would be a wire conflict and fails."""
    import importlib

    pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] not installed")
    ours = dict(_messages(importlib.import_module(ours_module).DESCRIPTOR))
    theirs = dict(_messages(importlib.import_module(triton_module).DESCRIPTOR))
    mismatches = []
    for name, message in ours.items():
        if name not in theirs:
            continue
        their_fields = theirs[name].fields_by_number
        for field in message.fields:
            their = their_fields.get(field.number)
            if their is None:
                continue
            ours_sig = (field.name, field.type, field.is_repeated)
            theirs_sig = (their.name, their.type, their.is_repeated)
            if ours_sig != theirs_sig:
                mismatches.append(f"{name} #{field.number}: ours {ours_sig}, Triton {theirs_sig}")
    assert not mismatches


def test_service_methods_match_tritons():
    pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] not installed")
    from tritonclient.grpc import service_pb2 as triton

    from gpud.proto import grpc_service_pb2 as ours

    ours_service = ours.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    triton_service = triton.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert ours_service.full_name == "inference.GRPCInferenceService"  # the method paths clients call
    for method in ours_service.methods:
        their = triton_service.methods_by_name[method.name]
        assert (method.input_type.full_name, method.output_type.full_name) == (
            their.input_type.full_name, their.output_type.full_name)
