"""gpud.placer: which device kinds an instance group may use."""
from __future__ import annotations

import pytest

from gpud.placer import candidate_kinds


@pytest.mark.parametrize("kind, has_gpus, want", [
    ("KIND_AUTO", True, ("gpu", "mig")),
    ("KIND_AUTO", False, ("cpu",)),
    ("KIND_GPU", False, ("gpu", "mig")),
    ("KIND_CPU", True, ("cpu",)),
])
def test_candidate_kinds(kind, has_gpus, want):
    assert candidate_kinds(kind, has_gpus) == want
