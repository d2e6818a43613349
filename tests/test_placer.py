"""First placement (gpud.placer): first fit by free memory, with reasons for refusals."""
from __future__ import annotations

import pytest

from gpud.placer import DeviceRoom, candidate_kinds, choose_device

GiB = 2**30
ROOMS = [
    DeviceRoom("gpu0", "gpu", 0, free_bytes=2 * GiB, total_bytes=80 * GiB),
    DeviceRoom("gpu1/mig1.0", "mig", 1, free_bytes=10 * GiB, total_bytes=40 * GiB),
    DeviceRoom("cpu", "cpu", -1, free_bytes=20 * GiB, total_bytes=24 * GiB),
]


@pytest.mark.parametrize("need, kinds, gpus, want", [
    (1 * GiB, ("gpu", "mig"), (), "gpu0"),          # first device with room
    (5 * GiB, ("gpu", "mig"), (), "gpu1/mig1.0"),   # gpu0 has 2 GiB free < 5 GiB
    (5 * GiB, ("cpu",), (), "cpu"),
    (1 * GiB, ("gpu", "mig"), (1,), "gpu1/mig1.0"),  # instance_group gpus: [1]
    (2 * GiB, ("gpu", "mig"), (), "gpu0"),          # exactly fits: 2 GiB free >= 2 GiB
])
def test_first_fit(need, kinds, gpus, want):
    assert choose_device(ROOMS, need, kinds, gpus) == (want, "")


def test_refusal_names_every_device_and_its_room():
    device, why = choose_device(ROOMS, 11 * GiB, ("gpu", "mig"))
    assert device is None
    assert "needs 11.00 GiB" in why and "gpu0: 2.00 GiB free of 80.00 GiB" in why
    assert "gpu1/mig1.0: 10.00 GiB free of 40.00 GiB" in why


def test_no_device_of_the_kind():
    assert choose_device(ROOMS[2:], GiB, ("gpu", "mig")) == (None, "no device of kind gpu/mig on this node")


@pytest.mark.parametrize("kind, has_gpus, want", [
    ("KIND_AUTO", True, ("gpu", "mig")),
    ("KIND_AUTO", False, ("cpu",)),
    ("KIND_GPU", False, ("gpu", "mig")),
    ("KIND_CPU", True, ("cpu",)),
])
def test_candidate_kinds(kind, has_gpus, want):
    assert candidate_kinds(kind, has_gpus) == want
