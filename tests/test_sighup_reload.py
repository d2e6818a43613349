"""gpud.reload and the reload part of gpud.model_control: which settings a reload applies, what it does with the
repository in each mode, and that a refused reload changes nothing. The end-to-end reload under load is in
test_e2e_sighup_reload.py."""
from __future__ import annotations

import asyncio
from dataclasses import replace
from types import SimpleNamespace

import pytest

from gpud.executor.types import ErrorKind, InferenceError
from gpud.api.admin import AdminAuth
from gpud.executor.process_log import LogSettings
from gpud.log_settings import LogControl
from gpud.settings import check_settings, prepare_settings, trace_settings_of
from gpud.tracing.settings import TraceSettings
from gpud.tracing.tracer import Tracer
from gpud.model_control import (ModelControl, RepositoryChanges, RepositoryPoller, as_operator, reload_plan)
from gpud.reload import Reloader, ReloadTargets, effective, settings_changes
from gpud.settings import Settings

TOKEN = "t" * 20


class TestSettingsChanges:
    def test_live_and_restart_only(self):
        running = Settings()
        new = replace(running, log_level="DEBUG", http_port=9000, hints_target_queue_seconds=0.02,
                      model_repository="/elsewhere")
        changes = {c.name: c for c in settings_changes(running, new)}
        assert set(changes) == {"log_level", "http_port", "hints_target_queue_seconds", "model_repository"}
        assert changes["log_level"].live and changes["hints_target_queue_seconds"].live
        assert not changes["http_port"].live and not changes["model_repository"].live
        kept = effective(running, new, changes.values())
        # the restart-only ones keep their running values, the live ones take the new ones
        assert (kept.http_port, kept.model_repository) == (8000, None)
        assert (kept.log_level, kept.hints_target_queue_seconds) == ("DEBUG", 0.02)

    @pytest.mark.parametrize("old, new, live", [("on", "advise", True), ("advise", "on", True),
                                                ("on", "off", False), ("off", "on", False)])
    def test_the_controller_switches_between_on_and_advise_only(self, old, new, live):
        [change] = settings_changes(Settings(placement_control=old), Settings(placement_control=new))
        assert change.live is live

    def test_load_model_follows_only_while_the_mode_stays(self):
        explicit = Settings(model_control_mode="explicit", load_model=("a",))
        [change] = settings_changes(explicit, replace(explicit, load_model=("a", "b")))
        assert change.live
        changes = {c.name: c.live for c in settings_changes(Settings(), explicit)}
        assert changes == {"model_control_mode": False, "load_model": False}

    def test_nothing_changed(self):
        assert settings_changes(Settings(), Settings()) == []


class TestReloadPlan:
    changes = RepositoryChanges(added=("new",), removed=("gone",), changed=("edited",))

    @pytest.mark.parametrize("mode", ["none", "poll"])
    def test_none_and_poll_apply_what_changed_as_a_poll(self, mode):
        plan = reload_plan(self.changes, on_disk=["new", "edited", "kept"], loaded={"edited", "gone", "kept"},
                           control=ModelControl(mode))
        assert plan.load == (("new", "new"), ("edited", "changed")) and plan.unload == ("gone",)

    def test_explicit_keeps_what_the_api_chose(self):
        # loaded: edited, gone, kept; on disk also "idle" (never loaded) and "wanted" (named by load_model)
        control = ModelControl("explicit", ("wanted",))
        plan = reload_plan(RepositoryChanges(("new",), ("gone", "never"), ("edited", "idle")),
                           on_disk=["new", "edited", "kept", "idle", "wanted"], loaded={"edited", "gone", "kept"},
                           control=control)
        # a changed loaded model reloads; a changed unloaded one, and a new one not named, stay unloaded
        assert plan.load == (("edited", "changed"), ("wanted", "named by load_model"))
        assert plan.unload == ("gone",)  # "never" was not loaded: nothing to unload

    def test_explicit_with_star_loads_every_model_not_loaded(self):
        plan = reload_plan(RepositoryChanges((), (), ()), on_disk=["a", "b"], loaded={"a"},
                           control=ModelControl("explicit", ("*",)))
        assert plan.load == (("b", "named by load_model"),) and plan.unload == ()


def test_a_reload_may_load_in_mode_none_an_api_call_may_not():
    control = ModelControl("none")
    with pytest.raises(InferenceError) as exc:
        control.check_api("load", "m")
    assert exc.value.kind is ErrorKind.UNAVAILABLE
    with as_operator():
        control.check_api("load", "m")
    with pytest.raises(InferenceError):  # only inside the block
        control.check_api("load", "m")

    # A request's task runs in its own context: a reload in progress does not lend it the operator's right.
    async def request_task_created_before() -> None:
        async def api_call() -> None:
            await gate.wait()
            control.check_api("unload", "m")

        gate = asyncio.Event()
        api = asyncio.get_running_loop().create_task(api_call())
        with as_operator():
            gate.set()
            await asyncio.sleep(0)
        with pytest.raises(InferenceError):
            await api

    asyncio.run(request_task_created_before())


# --- the Reloader with fakes ---------------------------------------------------------------------------------------
class Fixture:
    """A Reloader over fakes: the settings it reads are `self.next` (an exception: raised), the repository is
    `self.disk` (name -> fingerprint), loads and unloads are recorded."""

    def __init__(self, running: Settings, disk: dict[str, tuple], loaded: set[str]):
        self.next: Settings | Exception = running
        self.disk = dict(disk)
        self.loaded = set(loaded)
        self.calls: list[tuple[str, str]] = []
        self.sent: list[str] = []
        prepared = prepare_settings(running)
        self.admin = AdminAuth(prepared.admin_token)
        self.hints = SimpleNamespace(policy=prepared.hint_policy, interval_s=running.hints_interval_seconds,
                                     rate_window_s=running.hints_rate_window_seconds)
        self.controller = SimpleNamespace(policy=prepared.scaling_policy, mode=running.placement_control)
        self.http = SimpleNamespace(request_timeout_s=running.http_request_timeout_seconds,
                                    max_connections=running.http_max_connections)
        self.grpc = SimpleNamespace(max_connections=running.grpc_max_connections)
        self.applied_logging: list[LogSettings] = []  # what the daemon's processes were told to log
        self.log_control = LogControl(LogSettings.of_level(running.log_level), apply_here=self.applied_logging.append)
        self.core = SimpleNamespace(control=prepared.model_control, snapshot=lambda: SimpleNamespace(
            models=[SimpleNamespace(name=n, versions=(1,)) for n in sorted(self.loaded)]),
            tracer=Tracer(trace_settings_of(running)))
        self.poller = RepositoryPoller(self._read_disk, self._load, self._unload, 15.0)
        self.poller.start()
        self.reloader = Reloader(self._read, prepare_settings, prepared, lambda: len(self.loaded),
                                 source="/etc/gpud/gpud.yaml", send=self.sent.append, wall_clock=lambda: 0.0)

    def _read_disk(self) -> dict[str, tuple]:
        if self.disk is None:
            raise FileNotFoundError("model repository /models is not a directory")
        return dict(self.disk)

    def _read(self) -> Settings:
        if isinstance(self.next, Exception):
            raise self.next
        check_settings(self.next)  # as the daemon's read does (gpud.main.resolve_settings)
        return self.next

    async def _load(self, name: str) -> None:
        self.core.control.check_api("load", name)  # as GpudCore.load_model does
        if name == "broken":
            raise InferenceError(ErrorKind.INVALID_ARGUMENT, "failed to load 'broken': bad config.pbtxt")
        self.calls.append(("load", name))
        self.loaded.add(name)

    async def _unload(self, name: str) -> None:
        self.core.control.check_api("unload", name)
        self.calls.append(("unload", name))
        self.loaded.discard(name)

    def reload(self):
        async def run():
            self.reloader.serving(ReloadTargets(self.core, self.admin, self.hints, self.poller, self.controller,
                                                [self.http], [self.grpc], self.log_control))
            return await self.reloader.reload()
        return asyncio.run(run())


def test_a_reload_applies_the_live_settings_and_re_reads_the_repository(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    running = Settings(model_repository="/models")
    f = Fixture(running, {"a": (1,), "b": (1,)}, {"a", "b"})
    f.next = replace(running, log_level="DEBUG", hints_target_queue_seconds=0.02, control_interval_seconds=3.0,
                     placement_control="advise", http_request_timeout_seconds=5.0, http_port=9000,
                     admin_token_file=str(token_file))
    f.disk = {"a": (2,), "c": (1,)}  # a changed, b removed, c new
    outcome = f.reload()
    assert f.applied_logging == [LogSettings(verbose_level=1)]  # DEBUG: in every process, through the control
    assert outcome.refused is None
    assert f.hints.policy.target_queue_seconds == 0.02
    assert (f.controller.policy.interval_seconds, f.controller.mode) == (3.0, "advise")
    assert f.http.request_timeout_s == 5.0
    assert f.reloader.running.settings.http_port == 8000  # restart-only: stays
    assert outcome.need_restart == ("http_port 8000 -> 9000",)
    assert outcome.admin_token == "set" and f.admin.enabled
    # the default mode is none, and yet the reload loads and unloads: the operator's act
    assert f.calls == [("load", "c"), ("load", "a"), ("unload", "b")]
    status = f.sent[-1]
    assert status.startswith("READY=1\nSTATUS=serving 2 model version(s); reload at ")
    assert "1 need a restart (http_port)" in status and "repository: new c, changed a, removed b" in status
    assert f.sent[0].startswith("RELOADING=1\nMONOTONIC_USEC=")
    assert f.reloader.inspect()["last"]["load"] == [{"model": "c", "why": "new"}, {"model": "a", "why": "changed"}]


@pytest.mark.parametrize("bad, message", [
    (ValueError("/etc/gpud/gpud.yaml: not valid YAML: while parsing\n  in line 1"), "not valid YAML: while parsing in"),
    (replace(Settings(), hints_target_utilization_ratio=2.0), "target_utilization_ratio must be in (0, 1]"),
    (replace(Settings(), hints_interval_seconds=60.0), "hints_interval_seconds <= hints_rate_window_seconds"),
    (replace(Settings(), admin_token_file="/nonexistent/token"), "admin token file /nonexistent/token"),
    (replace(Settings(), placement_control="True"), "quote it"),
])
def test_a_refused_reload_changes_nothing(bad, message):
    f = Fixture(Settings(), {"a": (1,)}, {"a"})
    policy, control = f.hints.policy, f.controller.policy
    f.next = bad
    f.disk = {"a": (2,), "new": (1,)}  # the repository changed too: not read
    outcome = f.reload()
    assert outcome.refused is not None and message in outcome.refused and "\n" not in outcome.refused
    assert f.hints.policy is policy and f.controller.policy is control and f.calls == []
    assert f.poller.known == {"a": (1,)}
    assert "reload refused, nothing changed: " in f.sent[-1] and f.sent[-1].startswith("READY=1\nSTATUS=serving 1")


def test_a_token_rotated_in_place_takes_effect(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    running = Settings(admin_token_file=str(token_file))
    f = Fixture(running, {}, set())
    token_file.write_text("u" * 20)
    assert f.reload().admin_token == "changed"
    f.admin.check("Bearer " + "u" * 20, "loading")
    with pytest.raises(InferenceError):
        f.admin.check("Bearer " + TOKEN, "loading")
    assert f.reload().admin_token == "unchanged"


def test_a_model_that_fails_to_load_is_counted_and_the_rest_goes_on():
    f = Fixture(Settings(), {"a": (1,)}, {"a"})
    f.disk = {"a": (1,), "broken": (1,), "good": (1,)}
    outcome = f.reload()
    assert outcome.failed == 1 and ("load", "good") in f.calls
    assert "(1 failed: see the log)" in outcome.summary()


def test_sighups_during_start_up_and_during_a_reload_make_one_reload_each():
    f = Fixture(Settings(), {"a": (1,)}, {"a"})
    reloads = []

    async def scenario() -> None:
        gate = asyncio.Event()
        real = f.reloader.reload

        async def slow_reload():
            reloads.append(1)
            await gate.wait()
            return await real()
        f.reloader.reload = slow_reload
        f.reloader.request()  # during start-up: kept
        assert reloads == []
        f.reloader.serving(ReloadTargets(f.core, f.admin, f.hints, f.poller, f.controller, [f.http]))
        await asyncio.sleep(0)
        assert reloads == [1]
        f.reloader.request()
        f.reloader.request()  # two more while one runs: one more
        gate.set()
        await f.reloader._task
        assert reloads == [1, 1]
        f.reloader.stop()
        f.reloader.request()  # stopping: ignored
        assert f.reloader._task.done()

    asyncio.run(scenario())
    assert len(reloads) == 2


def test_a_repository_that_cannot_be_read_leaves_the_models_serving_and_says_so():
    f = Fixture(Settings(), {"a": (1,)}, {"a"})
    f.next = replace(Settings(), hints_target_queue_seconds=0.02)
    f.disk = None
    outcome = f.reload()
    assert outcome.repository_error == "model repository /models is not a directory" and f.calls == []
    assert f.hints.policy.target_queue_seconds == 0.02  # the settings were fine: applied
    assert f.sent[-1].endswith("1 setting(s) applied; repository not read: model repository /models is not a "
                               "directory")


def test_a_reload_that_fails_unexpectedly_still_tells_systemd_it_is_over():
    f = Fixture(Settings(), {"a": (1,)}, {"a"})

    async def broken_unload(name: str) -> None:
        raise RuntimeError("a bug")
    f.poller.unload = broken_unload
    f.disk = {}

    async def scenario() -> None:
        f.reloader.serving(ReloadTargets(f.core, f.admin, f.hints, f.poller, f.controller, [f.http]))
        f.reloader.request()
        await f.reloader._task

    asyncio.run(scenario())
    assert f.sent[0].startswith("RELOADING=1") and f.sent[-1].startswith("READY=1\nSTATUS=serving 1 model")
    assert "the last reload failed: see the log" in f.sent[-1]


def test_a_reload_sets_the_connection_caps_of_both_front_ends():
    running = Settings(model_repository="/models")
    f = Fixture(running, {"a": (1,)}, {"a"})
    f.next = replace(running, http_max_connections=300, grpc_max_connections=200)
    outcome = f.reload()
    assert "grpc_max_connections 10000 -> 200" in outcome.applied and "http_max_connections 10000 -> 300" in \
        outcome.applied
    assert (f.http.max_connections, f.grpc.max_connections) == (300, 200)
    assert outcome.need_restart == ()


def test_a_reload_sets_the_log_settings_only_when_the_file_changed_them():
    running = Settings(model_repository="/models")
    f = Fixture(running, {}, set())
    f.log_control.update({"log_verbose_level": 2, "log_format": "ISO8601"})  # over the logging extension
    f.next = replace(running, hints_target_queue_seconds=0.02)
    f.reload()
    assert f.log_control.settings == LogSettings(verbose_level=2, format="ISO8601")  # kept through the reload
    f.next = replace(running, log_level="WARNING")
    f.reload()
    assert f.log_control.settings == LogSettings(info=False)  # the file's new level, as at a start
    assert f.applied_logging[-1] == LogSettings(info=False)
    f.next = replace(running, log_level="WARNING", log_format="ISO8601")  # tritonserver's --log-format
    outcome = f.reload()
    assert f.log_control.settings == LogSettings(info=False, format="ISO8601")
    assert outcome.applied == ("log_format 'default' -> 'ISO8601'",)


def test_a_reload_sets_the_trace_settings_only_when_the_file_changed_them(tmp_path):
    running = Settings(model_repository="/models", trace_file=str(tmp_path / "trace.json"))
    f = Fixture(running, {}, set())
    tracer = f.core.tracer
    tracer.update("", {"trace_rate": "5"})  # over the trace extension
    tracer.update("m", {"trace_level": ["TIMESTAMPS"]})  # a model's own
    f.next = replace(running, hints_target_queue_seconds=0.02)
    f.reload()
    assert tracer.settings().rate == 5  # kept through a reload that left them alone
    f.next = replace(running, trace_level=("TIMESTAMPS",), trace_rate=100, trace_file=str(tmp_path / "new.json"))
    outcome = f.reload()
    assert "trace_rate 1000 -> 100" in outcome.applied and not outcome.need_restart
    assert tracer.settings() == TraceSettings(("TIMESTAMPS",), 100, -1, 0, str(tmp_path / "new.json"))
    assert tracer.settings("m") == tracer.settings()  # its level is its own; the rest, the file's new ones
    assert tracer.update("m", {"trace_level": None}) == tracer.settings()
    f.next = replace(running, trace_level=("TIMESTAMPS",), trace_file="")  # nothing to write to: refused
    outcome = f.reload()
    assert outcome.refused and "trace file name is not given" in outcome.refused
    assert tracer.settings().file == str(tmp_path / "new.json")

