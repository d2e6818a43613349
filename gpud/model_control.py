"""Who may change which models gpud serves, as Triton's `--model-control-mode`:

- `none` (the default): every model in the repository is loaded at start-up; the repository API's load and unload
  answer 403 and name the flag. The control plane is closed.
- `explicit`: only the models named by `--load-model` (`*`: all) are loaded at start-up; the load and unload API
  load, reload (with no gap) and unload models.
- `poll`: as `none` at start-up, then every `--repository-poll-seconds` the repository is read again: new models
  load, removed ones unload, changed ones (config.pbtxt, version directories, model files) reload with no gap; the
  load and unload API work too. A request for a model new in the repository loads it at once (load on demand).
Model names are checked before any file is touched (`check_model_name`).

A reload (SIGHUP, `systemctl reload gpud`) re-reads the repository in every mode (`reload_plan`): it is the operator's
act, not the API's, so it loads and unloads even in `none` mode (`as_operator`).
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
from collections.abc import Awaitable, Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

from gpud.executor.types import ErrorKind, InferenceError

log = logging.getLogger("gpud")

ModelControlMode = Literal["none", "explicit", "poll"]
MODEL_CONTROL_MODES: tuple[ModelControlMode, ...] = ("none", "explicit", "poll")

# Set while the daemon itself changes models for its operator (a reload): the mode's refusal is for the API's
# callers. A context variable, so only the reloading task (and what it awaits) carries it, never a request's task.
_OPERATOR = contextvars.ContextVar("gpud_operator_action", default=False)


@contextlib.contextmanager
def as_operator() -> Iterator[None]:
    """Model loads and unloads made inside this block are the operator's (a reload): `check_api` lets them pass."""
    token = _OPERATOR.set(True)
    try:
        yield
    finally:
        _OPERATOR.reset(token)


@dataclass(frozen=True)
class ModelControl:
    mode: ModelControlMode = "none"
    load_models: tuple[str, ...] = ()  # explicit mode: loaded at start-up ("*": all)

    def __post_init__(self) -> None:
        if self.mode not in MODEL_CONTROL_MODES:
            raise ValueError(f"model_control_mode must be one of {', '.join(MODEL_CONTROL_MODES)}, got {self.mode!r}")
        if self.load_models and self.mode != "explicit":
            raise ValueError("--load-model needs --model-control-mode explicit (the other modes load every model)")
        for name in self.load_models:
            if name != "*":
                check_model_name(name)

    def loads_at_start(self, name: str) -> bool:
        return self.mode != "explicit" or "*" in self.load_models or name in self.load_models

    def check_api(self, action: str, name: str) -> None:
        """The repository API's load/unload: refused in mode none, with the way to allow it. UNAVAILABLE (503), the
        code Triton answers and clients match on (not a matter of who asks: nobody may, in this mode)."""
        if self.mode == "none" and not _OPERATOR.get():
            raise InferenceError(ErrorKind.UNAVAILABLE,
                                 f"cannot {action} model '{name}': model control is disabled; start gpud with "
                                 "--model-control-mode explicit (or poll) to load and unload models through the API")

    @property
    def loads_new_on_demand(self) -> bool:
        return self.mode == "poll"


def check_model_name(name: str) -> None:
    """A model name is a directory name in the repository: nothing that could reach outside it."""
    if (not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name or name.startswith(".")
            or os.path.isabs(name)):
        raise InferenceError(ErrorKind.INVALID_ARGUMENT,
                             f"invalid model name {name!r}: a model name is one directory name in the repository "
                             "(no '/', '\\', NUL, and not starting with '.')")


def model_fingerprint(model_dir: str) -> tuple:
    """What a change of the model on disk changes: names, sizes and modification times of its config and of the
    files in its version directories (one level below them, as the repository layout has them)."""
    out = []
    try:
        entries = sorted(os.scandir(model_dir), key=lambda e: e.name)
    except OSError:
        return ()
    for e in entries:
        try:
            if e.is_file():
                st = e.stat()
                out.append((e.name, st.st_size, st.st_mtime_ns))
            elif e.is_dir() and e.name.isdigit():
                for f in sorted(os.scandir(e.path), key=lambda f: f.name):
                    st = f.stat()
                    out.append((f"{e.name}/{f.name}", st.st_size, st.st_mtime_ns))
        except OSError:
            continue
    return tuple(out)


@dataclass(frozen=True)
class RepositoryChanges:
    added: tuple[str, ...]
    removed: tuple[str, ...]
    changed: tuple[str, ...]


def repository_changes(before: dict[str, tuple], now: dict[str, tuple]) -> RepositoryChanges:
    """Pure: what a poll found, from the fingerprints of the last poll and of this one."""
    return RepositoryChanges(tuple(sorted(set(now) - set(before))), tuple(sorted(set(before) - set(now))),
                             tuple(sorted(n for n in set(now) & set(before) if now[n] != before[n])))


@dataclass(frozen=True)
class ReloadPlan:
    load: tuple[tuple[str, str], ...]  # (model, why): new, changed, named by load_model
    unload: tuple[str, ...]  # gone from the repository

    def summary(self) -> str:
        parts = [f"{why} {name}" for name, why in self.load] + [f"removed {name}" for name in self.unload]
        return ", ".join(parts) if parts else "no model changed"


def reload_plan(changes: RepositoryChanges, on_disk: Collection[str], loaded: Collection[str],
                control: ModelControl) -> ReloadPlan:
    """Pure: what a reload does with the repository. `none` and `poll`: what a poll does (new and changed models
    load, changed ones with no gap, removed ones unload). `explicit`: the models the API chose stay as they are,
    except that a changed loaded model reloads, a removed one unloads, and the models `load_model` names (`*`: all)
    that are not loaded load."""
    if control.mode != "explicit":
        load = [(n, "new") for n in changes.added] + [(n, "changed") for n in changes.changed]
        return ReloadPlan(tuple(load), changes.removed)
    load = [(n, "changed") for n in changes.changed if n in loaded]
    load += [(n, "named by load_model") for n in sorted(on_disk)
             if n not in loaded and n not in changes.removed and control.loads_at_start(n)]
    return ReloadPlan(tuple(sorted(load)), tuple(n for n in changes.removed if n in loaded))


class RepositoryPoller:
    """Applies what changed in the repository since it was last read: every `interval_s` in poll mode (`run`), and
    at a reload in every mode (`reload`). One at a time: a reload waits for a poll in progress."""

    def __init__(self, read: Callable[[], dict[str, tuple]], load: Callable[[str], Awaitable[None]],
                 unload: Callable[[str], Awaitable[None]], interval_s: float):
        self.read = read  # name -> fingerprint of every model directory
        self.load = load
        self.unload = unload
        self.interval_s = interval_s
        self.known: dict[str, tuple] = {}
        self._lock = asyncio.Lock()

    def start(self) -> None:
        """What start-up loaded is the first poll's."""
        self.known = self.read()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.poll()
            except OSError as exc:  # the repository is gone or unreadable for now: said, and polled again
                log.error("repository poll: cannot read the model repository: %s", exc)
            except Exception:  # noqa: BLE001 - one bad poll must not end polling
                log.exception("repository poll failed")

    async def poll(self) -> RepositoryChanges:
        async with self._lock:
            now = await asyncio.to_thread(self.read)
            changes = repository_changes(self.known, now)
            plan = ReloadPlan(tuple([(n, "new") for n in changes.added] + [(n, "changed") for n in changes.changed]),
                              changes.removed)
            await self._apply(plan, "repository poll")
            self.known = now
            return changes

    async def reload(self, control: ModelControl, loaded: Callable[[], Collection[str]]) -> tuple[ReloadPlan, int]:
        """Re-read the repository for a reload (`reload_plan`); the loads and unloads are the operator's. Returns
        the plan and how many of its steps failed (each logged with the model's reason)."""
        async with self._lock:
            now = await asyncio.to_thread(self.read)
            plan = reload_plan(repository_changes(self.known, now), now, loaded(), control)
            with as_operator():
                failed = await self._apply(plan, "reload")
            self.known = now
            return plan, failed

    async def _apply(self, plan: ReloadPlan, who: str) -> int:
        failed = 0
        steps = [(n, self.load, why) for n, why in plan.load] + [(n, self.unload, "removed") for n in plan.unload]
        for name, action, why in steps:
            log.info("%s: model %s %s", who, name, why)
            try:
                await action(name)
            except InferenceError as exc:  # the model says why (a bad config): logged, the rest goes on
                failed += 1
                log.error("%s: model %s: %s", who, name, exc.message)
        return failed


def poll_models(read_names: Callable[[], Sequence[str]], model_dir: Callable[[str], str]) -> dict[str, tuple]:
    return {name: model_fingerprint(model_dir(name)) for name in read_names()}
