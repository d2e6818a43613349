"""A simulated node: real GPU models and MIG layouts read from a YAML description, for machines without a driver.

Only the inventory is simulated. Memory used and utilization come from the injected UsageSource (what gpud's
executor really loaded and how long its workers were really busy). A GPU's power draw and temperature follow that
utilization through its model's power table (gpud.telemetry.power_model; N/A for a model the table lacks), and its ECC
and watched XID counters read 0: the simulated node tells the story a healthy GPU would, so every dashboard panel moves.

Node file format (config/nodes/*.yaml):

    name: dgx-a100-2gpu-mig            # optional, defaults to the file's stem
    description: free text             # optional
    gpus:
      - model: NVIDIA A100-SXM4-80GB   # a model from gpud.placement.mig, spelled as NVML names it
      - model: NVIDIA A100-SXM4-80GB
        pci_bus_id: "00000000:0F:00.0" # optional
        mig: [3g.40gb, 2g.20gb, 1g.10gb, 1g.10gb]   # optional MIG layout; must fit the GPU's placements

A model not in the table needs `memory_total_bytes` and cannot have a MIG layout. The GPU models, their MIG profiles
and valid placements come from gpud.placement.mig, gpud's single table of them (pure data, shared with the planner).
"""
from __future__ import annotations

import os
import uuid as uuidlib
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from gpud.telemetry.devices import (
    ECC_COUNTER_KEYS,
    WATCHED_XIDS,
    DeviceInfo,
    DeviceReading,
    NoUsage,
    UsageSource,
    cpu_device,
    gpu_device_id,
    leaf_devices,
    mig_device_id,
)
from gpud.telemetry.power_model import power_spec, power_w, temperature_c
from gpud.placement.mig import NVML_NAMES, GpuModel, MigProfile, gpu_model_by_nvml_name, validate_layout

_PACKAGE_NODES = Path(__file__).resolve().parent / "nodes"
_REPO_NODES = Path(__file__).resolve().parents[2] / "config" / "nodes"
DEFAULT_NODE_NAME = "dgx-a100-2gpu-mig.yaml"


def _default_node_file() -> str:
    # A clone has config/nodes/ next to the package; an installed package carries its own copy in
    # gpud/telemetry/nodes/ (tests check the two copies are identical).
    repo = _REPO_NODES / DEFAULT_NODE_NAME
    return str(repo if repo.is_file() else _PACKAGE_NODES / DEFAULT_NODE_NAME)


DEFAULT_NODE_FILE = _default_node_file()

_TOP_KEYS = {"name", "description", "gpus"}
_GPU_KEYS = {"model", "pci_bus_id", "memory_total_bytes", "mig"}
_MIG_KEYS = {"profile", "gpu_instance_id"}

# Simulated UUIDs are stable: derived from the node name and the device id, never random.
_UUID_NAMESPACE = uuidlib.UUID("9f1c2d3e-4b5a-4c6d-8e7f-0a1b2c3d4e5f")


def _fake_uuid(prefix: str, node: str, device_id: str) -> str:
    return f"{prefix}-{uuidlib.uuid5(_UUID_NAMESPACE, f'{node}/{device_id}')}"


def _check_keys(path: str, where: str, data: dict[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ValueError(f"{path}: {where}: unknown field {unknown[0]!r} (allowed: {', '.join(sorted(allowed))})")


def load_node(path: str | os.PathLike[str]) -> list[DeviceInfo]:
    """Parse and validate a node file into devices (GPUs with their MIG instances, then the CPU).
    Raises ValueError naming the file and the field for anything wrong."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise ValueError(f"{path}: cannot read node file: {exc.strerror or exc}") from exc
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: top level must be a mapping with a 'gpus' list, got {type(data).__name__}")
    _check_keys(path, "top level", data, _TOP_KEYS)
    node = data.get("name", Path(path).stem)
    if not isinstance(node, str) or not node:
        raise ValueError(f"{path}: name: must be a non-empty string")
    gpus = data.get("gpus")
    if not isinstance(gpus, list):
        raise ValueError(f"{path}: gpus: must be a list of GPUs (may be empty), got {type(gpus).__name__}")
    devices: list[DeviceInfo] = []
    for index, gpu in enumerate(gpus):
        devices.extend(_load_gpu(path, node, index, gpu))
    devices.append(cpu_device(simulated=True))
    return devices


def _load_gpu(path: str, node: str, index: int, gpu: Any) -> list[DeviceInfo]:
    where = f"gpus[{index}]"
    if not isinstance(gpu, dict):
        raise ValueError(f"{path}: {where}: must be a mapping with a 'model', got {type(gpu).__name__}")
    _check_keys(path, where, gpu, _GPU_KEYS)
    model_name = gpu.get("model")
    if not isinstance(model_name, str) or not model_name:
        raise ValueError(f"{path}: {where}.model: required, a GPU model name such as 'NVIDIA A100-SXM4-80GB'")
    model = gpu_model_by_nvml_name(model_name)
    memory = gpu.get("memory_total_bytes")
    if memory is not None and (not isinstance(memory, int) or isinstance(memory, bool) or memory <= 0):
        raise ValueError(f"{path}: {where}.memory_total_bytes: must be a positive integer, got {memory!r}")
    if model is None and memory is None:
        raise ValueError(f"{path}: {where}.model: unknown GPU model {model_name!r} (known: "
                         f"{', '.join(sorted(NVML_NAMES))}); give memory_total_bytes for another model")
    total = memory if memory is not None else model.memory_bytes  # type: ignore[union-attr]
    pci = gpu.get("pci_bus_id", f"00000000:{index + 1:02X}:00.0")
    if not isinstance(pci, str):
        raise ValueError(f"{path}: {where}.pci_bus_id: must be a string like '00000000:07:00.0'")
    gid = gpu_device_id(index)
    mig = gpu.get("mig")
    layout = _load_mig(path, where, model_name, model, mig) if mig is not None else None
    parent = DeviceInfo(
        id=gid, kind="gpu", index=index, name=model_name, uuid=_fake_uuid("GPU", node, gid), pci_bus_id=pci,
        memory_total_bytes=total, mig_enabled=layout is not None, simulated=True, labels={"gpu_model": model_name},
    )
    out = [parent]
    for profile, gi in layout or []:
        assert model is not None  # a layout exists only for a known model
        mid = mig_device_id(gid, gi, 0)  # one compute instance spanning its GPU instance: CI id 0
        out.append(DeviceInfo(
            id=mid, kind="mig", index=index, name=model_name, uuid=_fake_uuid("MIG", node, mid), pci_bus_id=pci,
            memory_total_bytes=profile.memory_bytes, parent_id=gid, mig_profile=profile.name, gpu_instance_id=gi,
            compute_instance_id=0, compute_fraction=profile.compute_slices / model.compute_slices, simulated=True,
            labels={"gpu_model": model_name, "mig_profile": profile.name, "parent": gid},
        ))
    return out


def _load_mig(path: str, where: str, model_name: str, model: GpuModel | None,
              mig: Any) -> list[tuple[MigProfile, int]]:
    if model is None or not model.profiles:
        raise ValueError(f"{path}: {where}.mig: GPU model {model_name!r} has no known MIG profiles")
    if not isinstance(mig, list) or not mig:
        raise ValueError(f"{path}: {where}.mig: must be a non-empty list of MIG profiles such as ['3g.40gb']")
    profiles: list[MigProfile] = []
    gi_ids: list[int] = []
    for k, entry in enumerate(mig):
        at = f"{where}.mig[{k}]"
        gi = k + 1  # simulated GPU instance ids in listed order; a real driver picks its own
        if isinstance(entry, dict):
            _check_keys(path, at, entry, _MIG_KEYS)
            name = entry.get("profile")
            gi = entry.get("gpu_instance_id", gi)
            if not isinstance(gi, int) or isinstance(gi, bool) or gi < 0:
                raise ValueError(f"{path}: {at}.gpu_instance_id: must be a non-negative integer, got {gi!r}")
        else:
            name = entry
        # by name only: a bare number here is more likely a typo than a profile id
        spec = next((p for p in model.profiles if p.name == name), None) if isinstance(name, str) else None
        if spec is None:
            known = ", ".join(p.name for p in model.profiles)
            raise ValueError(f"{path}: {at}: unknown MIG profile {name!r} for {model_name} (known: {known})")
        if gi in gi_ids:
            raise ValueError(f"{path}: {at}.gpu_instance_id: {gi} is used twice on this GPU")
        profiles.append(spec)
        gi_ids.append(gi)
    try:
        validate_layout(model, [p.name for p in profiles])
    except ValueError as exc:
        slices = sum(p.compute_slices for p in profiles)
        reason = str(exc).removeprefix(f"{model.name}: ")
        raise ValueError(f"{path}: {where}.mig: layout {' + '.join(p.name for p in profiles)} does not fit one "
                         f"{model_name} ({slices} of {model.compute_slices} compute slices; {reason})") from None
    return list(zip(profiles, gi_ids))


class SimulatedBackend:
    """DeviceBackend over a node file. Readings come only from the UsageSource."""

    def __init__(self, devices: list[DeviceInfo], usage: UsageSource | None = None, source_file: str = "<memory>"):
        self._devices = list(devices)
        self._by_id = {d.id: d for d in self._devices}
        self._children: dict[str, list[str]] = {}
        for d in self._devices:
            if d.parent_id is not None:
                self._children.setdefault(d.parent_id, []).append(d.id)
        self._usage = usage or NoUsage()
        self._source_file = source_file

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], usage: UsageSource | None = None) -> SimulatedBackend:
        return cls(load_node(path), usage, os.fspath(path))

    @property
    def source(self) -> str:
        return f"simulated:{self._source_file}"

    def devices(self) -> list[DeviceInfo]:
        return list(self._devices)

    def leaf_devices(self) -> list[DeviceInfo]:
        return leaf_devices(self._devices)

    def sample_all(self) -> dict[str, DeviceReading]:
        return {d.id: self.sample(d.id) for d in self._devices}

    def sample(self, device_id: str) -> DeviceReading:
        info = self._by_id[device_id]  # KeyError for an unknown id
        healthy = self._usage.unhealthy_reason(device_id) is None
        if info.kind == "gpu" and info.mig_enabled:
            # Nothing runs on a MIG-on GPU itself: its memory in use is its instances' sum. Utilization is N/A,
            # as NVML reports it for a GPU with MIG on; its board draws for all its instances (by compute share).
            children = [self._by_id[c] for c in self._children.get(device_id, [])]
            used = [self._usage.memory_used_bytes(c.id) for c in children]
            known = [u for u in used if u is not None]
            busy = sum((self._usage.utilization_ratio(c.id) or 0.0) * c.compute_fraction for c in children)
            return self._board(info, DeviceReading(memory_used_bytes=sum(known) if known else None,
                                                   healthy=healthy), busy)
        reading = DeviceReading(
            utilization_ratio=self._usage.utilization_ratio(device_id),
            memory_used_bytes=self._usage.memory_used_bytes(device_id),
            healthy=healthy,
        )
        return self._board(info, reading, reading.utilization_ratio) if info.kind == "gpu" else reading

    @staticmethod
    def _board(info: DeviceInfo, reading: DeviceReading, utilization_ratio: float | None) -> DeviceReading:
        """What the board of a whole GPU reports besides its use: power and temperature from the power model,
        ECC and watched XID counters at 0 (a simulated GPU has no errors)."""
        spec = power_spec(info.name)
        draw_w = power_w(spec, utilization_ratio) if spec is not None else None
        return replace(
            reading,
            power_w=draw_w,
            power_limit_w=spec.limit_w if spec is not None else None,
            temperature_c=temperature_c(spec, draw_w) if spec is not None and draw_w is not None else None,
            ecc_errors={key: 0 for key in ECC_COUNTER_KEYS},
            xid_errors={xid: 0 for xid in WATCHED_XIDS},
        )

    def close(self) -> None:
        pass
