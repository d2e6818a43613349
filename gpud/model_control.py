"""Who may change which models gpud serves, as Triton's `--model-control-mode`:

- `none` (the default): every model in the repository is loaded at start-up; the repository API's load and unload
  answer 403 and name the flag. The control plane is closed.
- `explicit`: only the models named by `--load-model` (`*`: all) are loaded at start-up; the load and unload API
  load, reload (with no gap) and unload models.
- `poll`: as `none` at start-up, then every `--repository-poll-seconds` the repository is read again: new models
  load, removed ones unload, changed ones (config.pbtxt, version directories, model files) reload with no gap; the
  load and unload API work too. A request for a model new in the repository loads it at once (load on demand).
Model names are checked before any file is touched (`check_model_name`).
"""
from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from executor.types import ErrorKind, InferenceError

log = logging.getLogger("gpud")

ModelControlMode = Literal["none", "explicit", "poll"]
MODEL_CONTROL_MODES: tuple[ModelControlMode, ...] = ("none", "explicit", "poll")


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
        """The repository API's load/unload: refused in mode none, with the way to allow it."""
        if self.mode == "none":
            raise InferenceError(ErrorKind.PERMISSION_DENIED,
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


class RepositoryPoller:
    """Poll mode: apply what changed in the repository since the last poll (load, reload, unload)."""

    def __init__(self, read: Callable[[], dict[str, tuple]], load: Callable[[str], Awaitable[None]],
                 unload: Callable[[str], Awaitable[None]], interval_s: float):
        self.read = read  # name -> fingerprint of every model directory
        self.load = load
        self.unload = unload
        self.interval_s = interval_s
        self.known: dict[str, tuple] = {}

    def start(self) -> None:
        """What start-up loaded is the first poll's."""
        self.known = self.read()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.poll()
            except Exception:  # noqa: BLE001 - one bad poll must not end polling
                log.exception("repository poll failed")

    async def poll(self) -> RepositoryChanges:
        now = await asyncio.to_thread(self.read)
        changes = repository_changes(self.known, now)
        for name, action, verb in [*((n, self.load, "new") for n in changes.added),
                                   *((n, self.load, "changed") for n in changes.changed),
                                   *((n, self.unload, "removed") for n in changes.removed)]:
            log.info("repository poll: model %s %s", name, verb)
            try:
                await action(name)
            except InferenceError as exc:  # the model says why (a bad config): logged, the rest goes on
                log.error("repository poll: model %s: %s", name, exc.message)
        self.known = now
        return changes


def poll_models(read_names: Callable[[], Sequence[str]], model_dir: Callable[[str], str]) -> dict[str, tuple]:
    return {name: model_fingerprint(model_dir(name)) for name in read_names()}
