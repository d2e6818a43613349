"""Plain data (parsed YAML/JSON) -> typed devices and demands, with errors that name the source and the field.
Pure: the caller reads the file and passes its parsed content and name. Also the built-in node presets."""
from __future__ import annotations

from typing import Any

from gpud.placement import mig
from gpud.placement.model import (
    Assignment, Constraints, DEVICE_KINDS, Device, ModelDemand, parse_memory_bytes,
)

PRESETS: dict[str, dict[str, Any]] = {
    "dgx-a100-40gb": {"devices": [{"id": f"gpu{i}", "model": "A100-SXM4-40GB"} for i in range(8)]},
    "dgx-a100-80gb": {"devices": [{"id": f"gpu{i}", "model": "A100-SXM4-80GB"} for i in range(8)]},
    "dgx-h100": {"devices": [{"id": f"gpu{i}", "model": "H100-80GB"} for i in range(8)]},
    "dgx-h100-mig-balanced": {"devices": [
        {"id": f"gpu{i}", "model": "H100-80GB", "mig": ["1g.10gb", "1g.10gb", "2g.20gb", "3g.40gb"]}
        for i in range(8)]},
    "h100-mig-mixed": {"devices": [
        {"id": "gpu0", "model": "H100-80GB"}, {"id": "gpu1", "model": "H100-80GB"},
        {"id": "gpu2", "model": "H100-80GB", "mig": ["3g.40gb", "3g.40gb"]},
        {"id": "gpu3", "model": "H100-80GB", "mig": ["1g.10gb"] * 7}]},
    "hgx-h200": {"devices": [{"id": f"gpu{i}", "model": "H200-141GB"} for i in range(8)]},
    "h100-nvl-2": {"devices": [{"id": f"gpu{i}", "model": "H100-94GB"} for i in range(2)]},
    "a30-4": {"devices": [{"id": f"gpu{i}", "model": "A30-24GB"} for i in range(4)]},
}


def _where(source: str, path: str) -> str:
    return f"{source}: {path}"


def devices_from_data(data: Any, source: str = "<devices>") -> list[Device]:
    """{"devices": [{"id", "memory" | "memory_bytes", "compute", "kind", "healthy", "labels", "parent",
    "reserve", "instance_cap"} | {"id", "model", "mig": [profiles] | null, "instance_cap"}], "reserve": "1GiB"}
    `instance_cap` caps the model instances on the device (on each MIG instance of a GPU given by model)."""
    if not isinstance(data, dict) or not isinstance(data.get("devices"), list):
        raise ValueError(f"{source}: expected an object with a 'devices' list")
    default_reserve = None
    if "reserve" in data:
        default_reserve = parse_memory_bytes(data["reserve"], _where(source, "reserve"))
    out: list[Device] = []
    for k, entry in enumerate(data["devices"]):
        path = f"devices[{k}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{_where(source, path)}: expected an object, got {type(entry).__name__}")
        dev_id = entry.get("id", entry.get("name"))
        if not isinstance(dev_id, str) or not dev_id:
            raise ValueError(f"{_where(source, path + '.id')}: required, a non-empty string")
        reserve = entry.get("reserve")
        reserve_bytes = parse_memory_bytes(reserve, _where(source, path + ".reserve")) if reserve is not None \
            else default_reserve
        healthy = entry.get("healthy", True)
        if not isinstance(healthy, bool):
            raise ValueError(f"{_where(source, path + '.healthy')}: expected true or false")
        labels = entry.get("labels") or {}
        if not isinstance(labels, dict):
            raise ValueError(f"{_where(source, path + '.labels')}: expected an object")
        instance_cap = entry.get("instance_cap")
        if instance_cap is not None and (isinstance(instance_cap, bool) or not isinstance(instance_cap, int)
                                         or instance_cap < 0):
            raise ValueError(f"{_where(source, path + '.instance_cap')}: expected an integer >= 0, got "
                             f"{instance_cap!r}")
        try:
            if "model" in entry and "memory" not in entry and "memory_bytes" not in entry:
                model = mig.gpu_model(str(entry["model"]))
                layout = entry.get("mig")
                if layout is not None and not isinstance(layout, list):
                    raise ValueError("mig: expected a list of profile names or null")
                devs = mig.expand_gpu(dev_id, model, layout, healthy=healthy, labels=labels)
                if reserve_bytes is not None or instance_cap is not None:
                    devs = [Device(d.id, d.memory_bytes, d.compute_fraction, d.kind, d.healthy, d.labels,
                                   d.parent_id, reserve_bytes, instance_cap) for d in devs]
                out += devs
                continue
            mem = entry.get("memory", entry.get("memory_bytes", entry.get("memory_total_bytes")))
            if mem is None:
                raise ValueError(f"{_where(source, path + '.memory')}: required (bytes or e.g. '80GiB'), "
                                 f"or give 'model' (and 'mig')")
            memory_bytes = parse_memory_bytes(mem, _where(source, path + ".memory"))
            compute = entry.get("compute", entry.get("compute_fraction", 1.0))
            if isinstance(compute, bool) or not isinstance(compute, (int, float)):
                raise ValueError(f"{_where(source, path + '.compute')}: expected a number in [0, 1]")
            kind = entry.get("kind", "gpu")
            if kind not in DEVICE_KINDS:
                raise ValueError(f"{_where(source, path + '.kind')}: expected one of {sorted(DEVICE_KINDS)}, "
                                 f"got {kind!r}")
            if "model" in entry:
                labels = {"gpu.model": str(entry["model"]), **labels}
            out.append(Device(dev_id, memory_bytes, float(compute), kind, healthy, tuple(labels.items()),
                              entry.get("parent") or entry.get("parent_id"), reserve_bytes, instance_cap))
        except ValueError as e:
            msg = str(e)
            raise ValueError(msg if msg.startswith(source) else f"{_where(source, path)}: {msg}") from None
    ids = [d.id for d in out]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise ValueError(f"{source}: duplicate device ids {dup}")
    return out


def constraints_from_data(data: Any, where: str) -> Constraints:
    if data is None:
        return Constraints()
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected an object")
    unknown = set(data) - {"kinds", "labels", "devices", "spread"}
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}; use kinds, labels, devices, spread")
    kinds = data.get("kinds", [])
    if isinstance(kinds, str):
        kinds = [kinds]
    labels = data.get("labels", {})
    if not isinstance(labels, dict):
        raise ValueError(f"{where}.labels: expected an object of label -> value or list of values")
    spread = data.get("spread", False)
    if not isinstance(spread, bool):
        raise ValueError(f"{where}.spread: expected true or false")
    try:
        return Constraints(kinds=frozenset(kinds), labels=tuple(labels.items()),
                           devices=frozenset(data.get("devices", [])), spread=spread)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def models_from_data(data: Any, source: str = "<models>") -> list[ModelDemand]:
    """{"models": [{"name", "memory", "instances", "compute", "min_instances", "max_instances",
    "constraints": {"kinds", "labels", "devices", "spread"}}]}"""
    if not isinstance(data, dict) or not isinstance(data.get("models"), list):
        raise ValueError(f"{source}: expected an object with a 'models' list")
    out = []
    for k, entry in enumerate(data["models"]):
        path = f"models[{k}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{_where(source, path)}: expected an object")
        name = entry.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{_where(source, path + '.name')}: required, a non-empty string")
        mem = entry.get("memory", entry.get("memory_bytes"))
        if mem is None:
            raise ValueError(f"{_where(source, path + '.memory')}: required (bytes or e.g. '1.2GiB')")
        memory_bytes = parse_memory_bytes(mem, _where(source, path + ".memory"))
        ints = {}
        for f in ("instances", "min_instances", "max_instances"):
            v = entry.get(f)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                raise ValueError(f"{_where(source, path + '.' + f)}: expected an integer, got {v!r}")
            ints[f] = v
        compute = entry.get("compute", entry.get("compute_fraction", 0.0))
        if isinstance(compute, bool) or not isinstance(compute, (int, float)):
            raise ValueError(f"{_where(source, path + '.compute')}: expected a number in [0, 1]")
        cons = constraints_from_data(entry.get("constraints"), _where(source, path + ".constraints"))
        try:
            out.append(ModelDemand(name, memory_bytes, 1 if ints["instances"] is None else ints["instances"],
                                   float(compute), ints["min_instances"], ints["max_instances"], cons))
        except ValueError as e:
            raise ValueError(f"{_where(source, path)}: {e}") from None
    names = [m.name for m in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"{source}: duplicate model names {dup}")
    return out


def current_from_data(data: Any, source: str = "<current>") -> list[Assignment]:
    """A previous plan's JSON ({"placements": [{"model", "instance", "device"}]}) or a bare list of those."""
    rows = data.get("placements") if isinstance(data, dict) else data
    if not isinstance(rows, list):
        raise ValueError(f"{source}: expected a plan with a 'placements' list")
    out = []
    for k, r in enumerate(rows):
        if not isinstance(r, dict) or not isinstance(r.get("model"), str) or not isinstance(r.get("device"), str) \
                or isinstance(r.get("instance"), bool) or not isinstance(r.get("instance"), int):
            raise ValueError(f"{source}: placements[{k}]: expected {{model: str, instance: int, device: str}}")
        out.append(Assignment(r["model"], r["instance"], r["device"]))
    return out


# --- the other way: typed values -> plain data in the formats above (what gpud publishes as its planning inputs) --
def devices_to_data(devices: list[Device]) -> dict[str, Any]:
    """`devices_from_data`'s format: devices_from_data(devices_to_data(ds)) == ds."""
    rows = []
    for d in devices:
        row: dict[str, Any] = {"id": d.id, "memory_bytes": d.memory_bytes, "compute": d.compute_fraction,
                               "kind": d.kind, "healthy": d.healthy, "labels": dict(d.labels)}
        if d.parent_id is not None:
            row["parent"] = d.parent_id
        if d.memory_reserve_bytes is not None:
            row["reserve"] = d.memory_reserve_bytes
        if d.instance_cap is not None:
            row["instance_cap"] = d.instance_cap
        rows.append(row)
    return {"devices": rows}


def models_to_data(demands: list[ModelDemand]) -> dict[str, Any]:
    """`models_from_data`'s format: models_from_data(models_to_data(ms)) == ms."""
    rows = []
    for m in demands:
        c = m.constraints
        constraints: dict[str, Any] = {}
        if c.kinds:
            constraints["kinds"] = sorted(c.kinds)
        if c.labels:
            constraints["labels"] = {k: list(v) for k, v in c.labels}
        if c.devices:
            constraints["devices"] = sorted(c.devices)
        if c.spread:
            constraints["spread"] = True
        rows.append({"name": m.name, "memory_bytes": m.memory_bytes, "instances": m.instances,
                     "compute": m.compute_fraction, "min_instances": m.min_instances,
                     "max_instances": m.max_instances, **({"constraints": constraints} if constraints else {})})
    return {"models": rows}


def current_to_data(assignments: list[Assignment]) -> dict[str, Any]:
    """`current_from_data`'s format."""
    return {"placements": [{"model": a.model, "instance": a.instance, "device": a.device} for a in assignments]}
