"""What `gpudctl check` found: one row per thing checked, each with gpud's value, the reference it was checked
against, the difference and a status with the reason; a table for people and JSON for machines."""
from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any


class Status(enum.Enum):
    PASS = "pass"
    FAIL = "fail"  # the node or gpud is wrong here: the check exits non-zero
    WARN = "warn"  # worth knowing, not wrong (a figure off its target on a shared machine, a tool missing)
    SKIP = "skip"  # not checkable here (the reason says why)


@dataclass(frozen=True)
class Row:
    section: str  # "node", "device", "serving", "daemon"
    device: str  # gpud device id, "" for the node
    item: str  # what was checked: "memory.used", "outputs b=8", "throughput", ...
    status: Status
    gpud: str = ""  # gpud's value, as printed
    reference: str = ""  # what it was checked against (nvidia-smi, onnxruntime on the CPU, raw onnxruntime, ...)
    diff: str = ""
    reason: str = ""  # why it failed or was skipped; for a pass, what the tolerance was

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"status": self.status.value}


@dataclass
class Report:
    rows: list[Row] = field(default_factory=list)
    node: str = ""  # what was checked: "nvml (2 GPUs, driver 580.65.06)", "simulated:config/nodes/...", a URL

    def add(self, rows: Row | Iterable[Row]) -> None:
        self.rows.extend([rows] if isinstance(rows, Row) else rows)

    @property
    def failed(self) -> list[Row]:
        return [r for r in self.rows if r.status is Status.FAIL]

    def counts(self) -> dict[str, int]:
        return {s.value: sum(1 for r in self.rows if r.status is s) for s in Status}

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node, "ok": not self.failed, "counts": self.counts(),
                "rows": [r.to_json() for r in self.rows]}

    def render(self) -> str:
        header = ("STATUS", "SECTION", "DEVICE", "CHECK", "GPUD", "REFERENCE", "DIFF", "REASON")
        cells = [header] + [(r.status.value.upper(), r.section, r.device or "-", r.item, r.gpud, r.reference,
                             r.diff, r.reason) for r in self.rows]
        # the reason is last and free-length; the other columns are padded to their widest cell (bounded)
        widths = [min(40, max(len(c[i]) for c in cells)) for i in range(len(header) - 1)]
        lines = [f"gpudctl check: {self.node}", ""]
        for c in cells:
            lines.append("  ".join(v[:w].ljust(w) for v, w in zip(c, widths)) + "  " + c[-1])
        n = self.counts()
        verdict = "FAILED" if self.failed else "OK"
        lines += ["", f"{verdict}: {n['pass']} passed, {n['fail']} failed, {n['warn']} warnings, {n['skip']} skipped"]
        return "\n".join(lines)
