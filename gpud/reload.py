"""Reloading while serving: SIGHUP (the unit's `ExecReload=`, `systemctl reload gpud`).

A reload reads the settings file again (`--config`; the command-line flags still win over it) and checks the result
as start-up does; anything wrong and the reload is refused whole, with the reason in the log and in systemd's
STATUS=, and nothing changes. Otherwise it applies the settings that can change while serving (`LIVE_SETTINGS`:
log level, admin token, hints, controller, poll interval, `load_model`, HTTP request timeout and connection cap),
says for each other changed setting that it needs a restart (it keeps its running value), and re-reads the model
repository (`gpud.model_control.reload_plan`): new and changed models load beside the serving ones and take over with
no gap, removed ones finish what they accepted and unload. Listening sockets, connections and accepted requests are
not touched. The admin token file is read again at every reload, so a token rotated in place takes effect.

systemd hears of it (sd_notify): RELOADING=1 when it begins, READY=1 and a STATUS= line saying what it did when it
ends. A SIGHUP during start-up is kept and runs once gpud serves; SIGHUPs during a reload make one more reload.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, Protocol

from gpud.api.admin import AdminAuth
from gpud.log_settings import LogControl
from gpud.model_control import ModelControl, RepositoryPoller
from gpud.scaling.controller import ScalingController
from gpud.scaling.sampler import HintsSampler
from gpud.settings import Prepared, Settings, log_settings_of, trace_settings_of
from gpud.tracing.tracer import Tracer
from gpud.systemd_notify import notify
from gpud.telemetry.serving import ServingSnapshot

log = logging.getLogger("gpud")

# What a reload applies while serving. The others (addresses, ports, the repository path, the node, the device
# worker and queue settings, the model control mode, the admin socket, ...) are read once, at start.
LIVE_SETTINGS = frozenset({
    "log_level", "log_info", "log_warning", "log_error", "log_format", "admin_token_file", "load_model",
    "trace_file", "trace_level", "trace_rate", "trace_count", "trace_log_frequency",
    "repository_poll_seconds",
    "http_request_timeout_seconds", "http_max_connections", "grpc_max_connections",
    "hints_interval_seconds", "hints_rate_window_seconds", "hints_target_queue_seconds",
    "hints_target_utilization_ratio", "hints_tolerance", "hints_scale_up_stabilization_seconds",
    "hints_scale_down_stabilization_seconds",
    "placement_control", "control_interval_seconds", "control_max_steps_per_interval", "idle_unload_seconds",
})


@dataclass(frozen=True)
class SettingChange:
    name: str
    old: Any
    new: Any
    live: bool  # applied while serving; else it waits for a restart

    def describe(self) -> str:
        return f"{self.name} {self.old!r} -> {self.new!r}"


def settings_changes(running: Settings, new: Settings) -> list[SettingChange]:
    """Pure: the settings that differ, each marked live or restart-only. The controller can switch between on and
    advise, not be started or stopped; `load_model` follows only while the model control mode stays."""
    out = []
    for f in fields(Settings):
        old, now = getattr(running, f.name), getattr(new, f.name)
        if old == now:
            continue
        live = f.name in LIVE_SETTINGS
        if f.name == "placement_control":
            live = "off" not in (old, now)
        elif f.name == "load_model":
            live = running.model_control_mode == new.model_control_mode
        out.append(SettingChange(f.name, old, now, live))
    return out


def effective(running: Settings, new: Settings, changes: Collection[SettingChange]) -> Settings:
    """The settings in force after a reload: the new ones, with the restart-only ones at their running values."""
    return replace(new, **{c.name: c.old for c in changes if not c.live})


class _Core(Protocol):
    control: ModelControl
    tracer: Tracer | None

    def snapshot(self) -> ServingSnapshot: ...


class _Tunable(Protocol):  # the HTTP servers
    request_timeout_s: float
    max_connections: int


class _Capped(Protocol):  # gpud's gRPC servers
    max_connections: int


@dataclass
class ReloadTargets:
    """What a reload may change in place (built by gpud.main)."""
    core: _Core
    admin: AdminAuth
    hints: HintsSampler
    poller: RepositoryPoller
    controller: ScalingController | None = None  # None when off
    http_servers: Sequence[_Tunable] = field(default_factory=list)
    grpc_servers: Sequence[_Capped] = field(default_factory=list)
    log_control: LogControl | None = None  # the daemon's log settings (every process's); None: the root logger's


@dataclass(frozen=True)
class ReloadOutcome:
    time_unix_s: float
    refused: str | None = None  # why the reload was refused (then nothing changed)
    applied: tuple[str, ...] = ()  # "name old -> new" of the settings applied
    need_restart: tuple[str, ...] = ()  # "name old -> new" of those kept at their running value
    admin_token: str = "unchanged"  # unchanged | changed | set | removed
    load: tuple[tuple[str, str], ...] = ()  # (model, why)
    unload: tuple[str, ...] = ()
    failed: int = 0  # repository steps that failed (each logged with the model's reason)
    repository_error: str | None = None  # the repository could not be read (the settings were applied)

    def summary(self) -> str:
        """One line for systemd's STATUS= (the log has the detail)."""
        if self.refused is not None:
            return f"reload refused, nothing changed: {self.refused}"
        settings = f"{len(self.applied)} setting(s) applied"
        if self.need_restart:
            settings += f", {len(self.need_restart)} need a restart ({', '.join(self.names_needing_restart())})"
        if self.admin_token != "unchanged":
            settings += f", admin token {self.admin_token}"
        if self.repository_error is not None:
            return f"{settings}; repository not read: {self.repository_error}"
        models = [f"{why} {n}" for n, why in self.load] + [f"removed {n}" for n in self.unload]
        repository = ", ".join(models) if models else "no model changed"
        failed = f" ({self.failed} failed: see the log)" if self.failed else ""
        return f"{settings}; repository: {repository}{failed}"

    def names_needing_restart(self) -> list[str]:
        return [d.split(" ", 1)[0] for d in self.need_restart]


class Reloader:
    """Runs reloads one at a time; `request()` is the SIGHUP handler."""

    def __init__(self, read: Callable[[], Settings], prepare: Callable[[Settings], Prepared], running: Prepared,
                 served_versions: Callable[[], int], *, source: str | None = None,
                 send: Callable[[str], bool] = notify, wall_clock: Callable[[], float] = time.time):
        self.read = read  # the settings file and the flags, as at start (ValueError: refused)
        self.prepare = prepare  # checks them and builds the policies (ValueError: refused)
        self.running = running
        self.served_versions = served_versions
        self.source = source  # the settings file, for the log
        self.send = send
        self.wall_clock = wall_clock
        self.targets: ReloadTargets | None = None  # set once serving: reloads wait until then
        self.reloads = 0
        self.last: ReloadOutcome | None = None
        self._pending = False
        self._stopped = False
        self._task: asyncio.Task | None = None

    # --- scheduling --------------------------------------------------------------------------------------------
    def request(self) -> None:
        """SIGHUP: reload now, or once serving, or after the reload in progress (several SIGHUPs meanwhile: one)."""
        if self._stopped:
            log.info("SIGHUP while stopping: not reloading")
            return
        self._pending = True
        if self.targets is None:
            log.info("SIGHUP during start-up: the reload runs once gpud serves")
            return
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="reload")

    def serving(self, targets: ReloadTargets) -> None:
        self.targets = targets
        if self._pending:
            self.request()

    def stop(self) -> None:
        self._stopped = True
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        while self._pending and not self._stopped:
            self._pending = False
            try:
                await self.reload()
            except Exception:  # noqa: BLE001 - a reload that fails must not take the daemon down
                log.exception("reload failed")
                # systemd heard RELOADING=1: it must hear that the reload is over
                self.send(f"READY=1\nSTATUS=serving {self.served_versions()} model version(s); the last reload "
                          "failed: see the log")

    # --- one reload --------------------------------------------------------------------------------------------
    async def reload(self) -> ReloadOutcome:
        assert self.targets is not None, "reload before serving"
        t = self.targets
        self.reloads += 1
        self.send(f"RELOADING=1\nMONOTONIC_USEC={time.monotonic_ns() // 1000}\nSTATUS=reloading: reading the "
                  "settings and the model repository")
        where = f" from {self.source}" if self.source else " (no settings file: the flags)"
        log.info("reload (SIGHUP): reading the settings%s and the model repository", where)
        try:
            new = self.read()
            self.prepare(new)  # everything checked before anything changes
            changes = settings_changes(self.running.settings, new)
            now = self.prepare(effective(self.running.settings, new, changes))
        except ValueError as exc:
            why = " ".join(str(exc).split())  # one line (YAML errors span several), for the log and STATUS=
            outcome = ReloadOutcome(self.wall_clock(), refused=why)
            log.error("reload refused: %s; nothing changed: the running settings and models stay as they are", why)
            return self._finish(outcome)
        token = self._apply(now, t)
        applied = tuple(c.describe() for c in changes if c.live)
        restart = tuple(c.describe() for c in changes if not c.live)
        if applied:
            log.info("reload: applied %s", "; ".join(applied))
        for c in changes:
            if not c.live:
                log.warning("reload: %s changed in the settings (%r -> %r) but takes effect only at a restart; "
                            "it stays %r", c.name, c.old, c.new, c.old)
        if not changes:
            log.info("reload: settings unchanged")
        self.running = now
        try:
            plan, failed = await t.poller.reload(now.model_control, lambda: _loaded(t.core))
        except OSError as exc:  # the repository is gone or unreadable: what serves stays as it is
            outcome = ReloadOutcome(self.wall_clock(), None, applied, restart, token,
                                    repository_error=str(exc))
            log.error("reload: cannot read the model repository (%s); the models serve as they were", exc)
        else:
            outcome = ReloadOutcome(self.wall_clock(), None, applied, restart, token, plan.load, plan.unload, failed)
        log.info("reload done: %s", outcome.summary())
        return self._finish(outcome)

    def _apply(self, p: Prepared, t: ReloadTargets) -> str:
        s = p.settings
        # only changed log settings: those a client changed (the logging extension) stay through other reloads
        now = log_settings_of(s)
        if now != log_settings_of(self.running.settings):
            if t.log_control is not None:
                t.log_control.set(now)
            else:
                logging.getLogger().setLevel(now.threshold())
        # only changed trace settings, as the log settings: those a client changed stay through other reloads
        trace_now = trace_settings_of(s)
        if trace_now != trace_settings_of(self.running.settings) and t.core.tracer is not None:
            t.core.tracer.restart(trace_now)
        t.hints.policy = p.hint_policy
        t.hints.interval_s = s.hints_interval_seconds
        t.hints.rate_window_s = s.hints_rate_window_seconds
        if t.controller is not None:
            t.controller.policy = p.scaling_policy
            t.controller.mode = p.scaling_mode
        t.core.control = p.model_control
        t.poller.interval_s = s.repository_poll_seconds
        for server in t.http_servers:
            server.request_timeout_s = s.http_request_timeout_seconds
            server.max_connections = s.http_max_connections
        for grpc_server in t.grpc_servers:
            grpc_server.max_connections = s.grpc_max_connections
        before = self.running.admin_token
        t.admin.set_token(p.admin_token)
        if p.admin_token == before:
            return "unchanged"
        if p.admin_token is None:
            log.warning("reload: the admin token is removed: admin actions over TCP are %s",
                        "refused (served on the admin socket)" if t.admin.socket_path else "open to anyone who "
                        "can reach the ports")
            return "removed"
        log.info("reload: the admin token is %s (read from %s)", "set" if before is None else "changed",
                 s.admin_token_file)
        return "set" if before is None else "changed"

    def _finish(self, outcome: ReloadOutcome) -> ReloadOutcome:
        self.last = outcome
        at = time.strftime("%H:%M:%S", time.localtime(outcome.time_unix_s))
        self.send(f"READY=1\nSTATUS=serving {self.served_versions()} model version(s); reload at {at}: "
                  f"{outcome.summary()}")
        return outcome

    # --- the inspect section -----------------------------------------------------------------------------------
    def inspect(self) -> dict[str, Any]:
        last = self.last
        return {"reloads": self.reloads, "settings_file": self.source, "last": None if last is None else {
            "time_unix_s": last.time_unix_s, "refused": last.refused, "applied": list(last.applied),
            "need_restart": list(last.need_restart), "admin_token": last.admin_token,
            "load": [{"model": n, "why": why} for n, why in last.load], "unload": list(last.unload),
            "failed": last.failed, "repository_error": last.repository_error, "summary": last.summary()}}


def _loaded(core: _Core) -> set[str]:
    return {m.name for m in core.snapshot().models if m.versions}
