"""Small fakes shared by the unit tests."""
from __future__ import annotations


class FakeClock:
    """A clock (seconds) that moves only when told: set `now`, call `advance()`, or give a `step` that every read
    adds first, so time limits are reached without sleeping."""

    def __init__(self, now: float = 0.0, step: float = 0.0) -> None:
        self.now = now
        self.step = step

    def __call__(self) -> float:
        self.now += self.step
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def wait_until(decision: object) -> float:
    """A batcher Wait's deadline, to compare with pytest.approx (the compiled Wait takes only a float, so
    `Wait(until_s=pytest.approx(x))` cannot be built)."""
    from gpud.executor.batcher import Wait

    assert isinstance(decision, Wait), decision
    return decision.until_s


def replaces_functions_of(module: str):
    """Skips a test that replaces a module-level function of `module` (monkeypatch.setattr(module, name, ...)) when
    that module runs compiled: compiled code calls its module's functions directly, past the module attribute. The
    pure-Python pass of .ci/run runs it."""
    return _skipped_when_compiled(module, f"replaces a function of {module}")


def replaces_methods_of(module: str):
    """Skips a test that replaces a method on an object of `module`'s classes when that module runs compiled
    (gpud.compiled: a compiled class's methods cannot be replaced). The pure-Python pass of .ci/run runs it."""
    return _skipped_when_compiled(module, f"replaces a method of {module}'s classes")


def _skipped_when_compiled(module: str, what: str):
    import importlib

    import pytest

    from gpud import compiled

    importlib.import_module(module)
    return pytest.mark.skipif(compiled.is_compiled(module),
                              reason=f"{what}, compiled here: the pure-Python pass (GPUD_PURE_PYTHON=1) runs it")
