"""How a GPU's power draw and temperature follow its load: the simulated node's sensors, as pure functions.

A GPU draws its idle power with nothing running and approaches its enforced power limit when fully busy; in between
the draw grows about linearly with the share of time kernels run. Its temperature follows its power: the idle
temperature at idle power, the steady temperature under full load at the limit, linear in between (the heat sink's
thermal resistance is about constant). So

    power_w       = idle_w + utilization_ratio * (limit_w - idle_w)
    temperature_c = idle_c + (power_w - idle_w) / (limit_w - idle_w) * (load_c - idle_c)

A GPU with MIG on draws for all its instances: its utilization is the compute-share-weighted sum of theirs.

The figures are the boards' default enforced power limits (what `nvidia-smi -q -d POWER` shows as the default limit,
and the data sheets' TDP) and typical idle draws and temperatures of air- or liquid-cooled servers. They are a model,
not a measurement: docs/gpu-validation.md says how to calibrate them against a real GPU's readings.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PowerSpec:
    """One GPU model's power and thermal envelope."""

    idle_w: float  # draw with no kernel running, clocks idle
    limit_w: float  # default enforced power limit (the board's TDP)
    idle_c: float  # temperature at idle power
    load_c: float  # steady temperature at the power limit

    def __post_init__(self) -> None:
        if not 0 < self.idle_w < self.limit_w:
            raise ValueError(f"power model needs 0 < idle_w < limit_w, got {self.idle_w} and {self.limit_w}")
        if not self.idle_c < self.load_c:
            raise ValueError(f"power model needs idle_c < load_c, got {self.idle_c} and {self.load_c}")


# By NVML device name (gpud.placement.mig's GPU models).
POWER_SPECS: dict[str, PowerSpec] = {
    "NVIDIA A100-SXM4-40GB": PowerSpec(idle_w=52.0, limit_w=400.0, idle_c=31.0, load_c=68.0),
    "NVIDIA A100-SXM4-80GB": PowerSpec(idle_w=60.0, limit_w=400.0, idle_c=32.0, load_c=70.0),
    "NVIDIA A30": PowerSpec(idle_w=30.0, limit_w=165.0, idle_c=30.0, load_c=72.0),
    "NVIDIA H100 80GB HBM3": PowerSpec(idle_w=70.0, limit_w=700.0, idle_c=33.0, load_c=72.0),
    "NVIDIA H100 NVL": PowerSpec(idle_w=60.0, limit_w=400.0, idle_c=32.0, load_c=74.0),
    "NVIDIA H200": PowerSpec(idle_w=75.0, limit_w=700.0, idle_c=33.0, load_c=72.0),
}


def power_spec(gpu_name: str) -> PowerSpec | None:
    """The model for an NVML device name, or None for a GPU the table does not know (its power reads N/A)."""
    return POWER_SPECS.get(gpu_name)


def power_w(spec: PowerSpec, utilization_ratio: float | None) -> float:
    """Draw at this utilization; None (nothing known to run) is idle. Clamped to 0..1."""
    u = min(1.0, max(0.0, utilization_ratio or 0.0))
    return spec.idle_w + u * (spec.limit_w - spec.idle_w)


def temperature_c(spec: PowerSpec, draw_w: float) -> float:
    """Steady temperature at this draw (linear between idle and the limit, clamped to that span)."""
    share = min(1.0, max(0.0, (draw_w - spec.idle_w) / (spec.limit_w - spec.idle_w)))
    return spec.idle_c + share * (spec.load_c - spec.idle_c)
