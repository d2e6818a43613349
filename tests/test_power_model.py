"""The simulated node's power and thermal model (gpud.telemetry.power_model): pure functions of the load."""
from __future__ import annotations

import pytest

from gpud.placement.mig import GPU_MODELS
from gpud.telemetry.power_model import POWER_SPECS, PowerSpec, power_spec, power_w, temperature_c

H100 = PowerSpec(idle_w=70.0, limit_w=700.0, idle_c=33.0, load_c=72.0)


class TestPower:
    @pytest.mark.parametrize("utilization, expected_w", [
        (None, 70.0),  # nothing known to run: idle
        (0.0, 70.0),
        (0.25, 227.5),  # 70 + 0.25 * (700 - 70)
        (1.0, 700.0),
        (1.7, 700.0),  # clamped: a busy ratio over 1 cannot draw over the limit
        (-0.1, 70.0),
    ])
    def test_idle_plus_utilization_times_the_span(self, utilization, expected_w):
        assert power_w(H100, utilization) == pytest.approx(expected_w)

    @pytest.mark.parametrize("draw_w, expected_c", [
        (70.0, 33.0),
        (385.0, 52.5),  # halfway: 33 + 0.5 * (72 - 33)
        (700.0, 72.0),
        (900.0, 72.0),  # clamped to the span
        (10.0, 33.0),
    ])
    def test_temperature_from_power(self, draw_w, expected_c):
        assert temperature_c(H100, draw_w) == pytest.approx(expected_c)

    def test_every_gpu_model_of_the_planner_table_has_a_power_model(self):
        assert {g.nvml_name for g in GPU_MODELS.values()} <= set(POWER_SPECS)
        assert power_spec("NVIDIA Z9000") is None  # unknown: power reads N/A, never invented

    @pytest.mark.parametrize("kwargs, words", [
        (dict(idle_w=0.0, limit_w=300.0, idle_c=30.0, load_c=70.0), "0 < idle_w < limit_w"),
        (dict(idle_w=400.0, limit_w=300.0, idle_c=30.0, load_c=70.0), "0 < idle_w < limit_w"),
        (dict(idle_w=50.0, limit_w=300.0, idle_c=70.0, load_c=70.0), "idle_c < load_c"),
    ])
    def test_bad_spec_refused(self, kwargs, words):
        with pytest.raises(ValueError, match=words):
            PowerSpec(**kwargs)
