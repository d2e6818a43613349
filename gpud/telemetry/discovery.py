"""Pick the device backend: a node file if one is given, else NVML, else the default simulated node.

The fallback is logged as one line that says what gpud runs on and why, so nobody wonders later why a GPU
server serves from its CPU.
"""
from __future__ import annotations

import logging
from typing import Any

from gpud.telemetry.devices import DeviceBackend, UsageSource, format_device_tree
from gpud.telemetry.nvml import NvmlBackend
from gpud.telemetry.simulated import DEFAULT_NODE_FILE, SimulatedBackend

log = logging.getLogger("gpud.telemetry.discovery")


def open_nvml(usage: UsageSource, nvml: Any = None,
              logger: logging.Logger = log) -> tuple[NvmlBackend | None, str | None]:
    """(the NVML backend, None) when a driver with at least one GPU answers, else (None, why not)."""
    nvml_backend = NvmlBackend(nvml=nvml, usage=usage, logger=logger)
    reason = nvml_backend.unavailable_reason()
    if reason is None and nvml_backend.gpu_count() == 0:
        reason = "NVML found 0 GPUs"
    if reason is None:
        return nvml_backend, None
    nvml_backend.close()
    return None, reason


def discover(node_file: str | None, usage: UsageSource, nvml: Any = None,
             logger: logging.Logger = log) -> DeviceBackend:
    """node_file given -> simulated from it (ValueError if it is bad). Else NVML; with no driver or zero GPUs ->
    the simulated default node. `nvml` injects an NVML module (tests pass a fake); None imports pynvml lazily."""
    backend: DeviceBackend
    if node_file is not None:
        backend = SimulatedBackend.from_file(node_file, usage)
        logger.info("devices: simulated node from %s (node file given)", node_file)
    else:
        nvml_backend, reason = open_nvml(usage, nvml, logger)
        if nvml_backend is not None:
            backend = nvml_backend
            logger.info("devices: NVML, %d GPU(s)", nvml_backend.gpu_count())
        else:
            backend = SimulatedBackend.from_file(DEFAULT_NODE_FILE, usage)
            logger.warning("devices: no NVIDIA GPU usable (%s); running on the simulated node %s, models execute "
                           "on the CPU", reason, DEFAULT_NODE_FILE)
    for line in format_device_tree(backend.devices()):
        logger.info("  %s", line)
    return backend
