"""Triton's logging extension: the settings' rules (gpud.log_settings), their effect on a process's logging, the HTTP
and gRPC routes against tritonclient (over a FakeCore), and a real daemon whose every process follows a change."""
from __future__ import annotations

import io
import json
import logging
import re

import psutil
import pytest
import requests
import grpc
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2 as triton_pb
from tritonclient.grpc import service_pb2_grpc as triton_pb_grpc
from tritonclient.utils import InferenceServerException

from gpud.executor.errors import ErrorKind, InferenceError
from gpud.executor.protocol import SetLogging, dumps, loads
from gpud.executor.process_log import LogFormatter, LogSettings, apply, configure
from gpud.log_settings import LogControl, updated
from tests.daemon_harness import start_daemon, wait_for
from tests.fake_core import FakeCore
from tests.extension_servers import HttpClient, auth, serving

TIMEOUT_S = 10
TOKEN = "0123456789abcdef-logging"
DEFAULTS = {"log_file": "", "log_info": True, "log_warning": True, "log_error": True, "log_verbose_level": 0,
            "log_format": "default"}


# --- the settings ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("level, info, warning, error, verbose", [
    ("DEBUG", True, True, True, 1), ("INFO", True, True, True, 0), ("WARNING", False, True, True, 0),
    ("error", False, False, True, 0), (logging.CRITICAL, False, False, False, 0)])
def test_a_log_level_means_that_level_and_those_above(level, info, warning, error, verbose):
    assert LogSettings.of_level(level) == LogSettings(info, warning, error, verbose)


def test_an_unknown_log_level_is_refused():
    with pytest.raises(ValueError, match="unknown log level"):
        LogSettings.of_level("LOUD")


def test_each_level_is_switched_on_its_own():
    s = LogSettings(info=True, warning=False, error=True)
    assert [s.writes(n) for n in (logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR, logging.CRITICAL)] \
        == [False, True, False, True, True]
    assert s.threshold() == logging.INFO
    assert LogSettings(verbose_level=2).threshold() == logging.DEBUG
    assert LogSettings(info=False, warning=False).threshold() == logging.ERROR
    assert LogSettings(info=False, warning=False, error=False).threshold() > logging.CRITICAL


def test_a_request_changes_only_what_it_names():
    now = updated(LogSettings(), {"log_verbose_level": 3, "log_format": "ISO8601", "log_info": None})
    assert now == LogSettings(verbose_level=3, format="ISO8601")
    assert now.wire() == {**DEFAULTS, "log_verbose_level": 3, "log_format": "ISO8601"}
    assert list(now.wire()) == list(DEFAULTS)  # Triton's order
    # the extension document's spelling; the current log file ("") as a client read it back
    assert updated(LogSettings(), {"log_warnings": False, "log_errors": False, "log_file": ""}) \
        == LogSettings(warning=False, error=False)
    assert updated(LogSettings(), {}) == LogSettings()


@pytest.mark.parametrize("changes, kind, words", [
    ({"log_info": 1}, ErrorKind.INVALID_ARGUMENT, "expect boolean for 'log_info'"),
    ({"log_errors": "yes"}, ErrorKind.INVALID_ARGUMENT, "expect boolean for 'log_errors'"),
    ({"log_verbose_level": True}, ErrorKind.INVALID_ARGUMENT, "log_verbose_level"),
    ({"log_verbose_level": -1}, ErrorKind.INVALID_ARGUMENT, "from 0 to 4294967295"),
    ({"log_verbose_level": 2**32}, ErrorKind.INVALID_ARGUMENT, "from 0 to 4294967295"),
    ({"log_verbose_level": 1.5}, ErrorKind.INVALID_ARGUMENT, "log_verbose_level"),
    ({"log_format": "json"}, ErrorKind.INVALID_ARGUMENT, "invalid argument for log_format"),
    ({"log_level": "DEBUG"}, ErrorKind.INVALID_ARGUMENT, "unknown log setting 'log_level'"),
    ({"log_bogus": None}, ErrorKind.INVALID_ARGUMENT, "unknown log setting 'log_bogus'"),  # a null: not a read
    ({"log_file": "/tmp/gpud.log"}, ErrorKind.UNSUPPORTED, "log file location can not be updated"),
])
def test_a_bad_request_is_refused_and_changes_nothing(changes, kind, words):
    told = []
    control = LogControl(LogSettings(), apply_here=told.append)
    with pytest.raises(InferenceError) as refused:
        control.update({"log_info": False, **changes})  # a good setting beside the bad one is not applied either
    assert refused.value.kind is kind and words in refused.value.message
    assert control.settings == LogSettings() and told == []


def test_the_control_applies_a_change_once_and_tells_every_listener():
    here, heard, failing = [], [], []

    def broken(settings):
        failing.append(settings)
        raise OSError("gone")

    control = LogControl(LogSettings(), apply_here=here.append)
    control.listeners += [broken, heard.append]
    assert control.update({"log_verbose_level": 1}) == LogSettings(verbose_level=1)
    control.update({"log_verbose_level": 1})  # no change: nobody is told
    control.set(LogSettings(verbose_level=1))
    assert here == heard == failing == [LogSettings(verbose_level=1)]  # one listener failing does not stop the next


# --- one process's logging -------------------------------------------------------------------------------------------
@pytest.fixture
def logger():
    """A logger with gpud's formatter on its own stream, standing for a process's root logger."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(LogFormatter("%(asctime)s %(levelname)s %(message)s"))
    lg = logging.getLogger(f"test-logging-extension-{id(stream)}")
    lg.propagate = False
    lg.addHandler(handler)
    lg.stream = stream  # type: ignore[attr-defined]
    yield lg
    lg.removeHandler(handler)


def _written(lg) -> list[str]:
    for level in (logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR, logging.CRITICAL):
        lg.log(level, "at %s", logging.getLevelName(level))
    lines = lg.stream.getvalue().splitlines()
    lg.stream.truncate(0)
    lg.stream.seek(0)
    return lines


def test_a_process_writes_the_levels_switched_on_in_the_format_asked(logger):
    apply(LogSettings(warning=False), logger)
    lines = _written(logger)
    assert [line.split()[-1] for line in lines] == ["INFO", "ERROR", "CRITICAL"]
    assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO ", lines[0]), lines[0]

    apply(LogSettings(info=False, verbose_level=1, format="ISO8601"), logger)
    lines = _written(logger)
    assert [line.split()[-1] for line in lines] == ["DEBUG", "WARNING", "ERROR", "CRITICAL"]
    assert re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z DEBUG ", lines[0]), lines[0]
    assert len(logger.handlers[0].filters) == 1  # applied again: the one filter follows, none is added

    apply(LogSettings(), logger)
    lines = _written(logger)
    assert [line.split()[-1] for line in lines] == ["INFO", "WARNING", "ERROR", "CRITICAL"]
    assert re.match(r"\d{4}-\d\d-\d\d \d\d:", lines[0]), lines[0]


def test_configure_adds_gpud_s_handler_once(logger):
    bare = logging.getLogger(f"test-logging-configure-{id(logger)}")
    bare.propagate = False
    try:
        configure(LogSettings(info=False), "%(message)s", bare)
        configure(LogSettings(), "%(message)s", bare)  # a second call: the handler there is kept, none added
        assert len(bare.handlers) == 1 and isinstance(bare.handlers[0].formatter, LogFormatter)
        assert bare.level == logging.INFO
        before = list(logger.handlers)
        configure(LogSettings(verbose_level=1), "%(message)s", logger)  # as logging.basicConfig: its own stay
        assert logger.handlers == before and logger.level == logging.DEBUG
    finally:
        bare.handlers.clear()


def test_the_worker_message_carries_the_settings():
    settings = LogSettings(info=False, verbose_level=7, format="ISO8601")
    message = loads(dumps(SetLogging(*settings.plain().values())))
    assert type(message) is SetLogging and LogSettings(*message) == settings


# --- HTTP and gRPC over a FakeCore -------------------------------------------------------------------------------------
@pytest.fixture
def core():
    return FakeCore()


@pytest.fixture(params=[None, TOKEN], ids=["loopback", "token"])
def servers(core, request):
    with serving(core, request.param) as running:
        yield running


def test_http_reads_and_changes_the_settings_as_tritonclient_expects(servers, core):
    client = HttpClient(f"127.0.0.1:{servers.http_port}", network_timeout=TIMEOUT_S)
    try:
        assert client.get_log_settings() == DEFAULTS
        changed = client.update_log_settings({"log_verbose_level": 2, "log_warning": False}, headers=auth(servers))
        assert changed == {**DEFAULTS, "log_verbose_level": 2, "log_warning": False}
        assert core.log_control.settings == LogSettings(warning=False, verbose_level=2)
        assert client.get_log_settings() == changed
        with pytest.raises(InferenceServerException, match="invalid argument for log_format"):
            client.update_log_settings({"log_format": "xml", "log_info": False}, headers=auth(servers))
        with pytest.raises(InferenceServerException, match="log file location"):
            client.update_log_settings({"log_file": "/var/log/gpud.log"}, headers=auth(servers))
        assert client.get_log_settings() == changed  # the refused requests changed nothing
    finally:
        client.close()


def test_http_errors_are_triton_shaped_and_a_change_is_an_admin_action(servers, core):
    url = f"http://127.0.0.1:{servers.http_port}/v2/logging"
    bad = requests.post(url, data=b"[1]", headers=auth(servers), timeout=TIMEOUT_S)
    assert bad.status_code == 400 and set(bad.json()) == {"error"}
    assert requests.post(url, json={"log_file": "x"}, headers=auth(servers), timeout=TIMEOUT_S).status_code == 501
    assert requests.put(url, json={}, timeout=TIMEOUT_S).status_code == 405
    # an empty request reads the settings: no token needed
    assert requests.post(url, data=b"", timeout=TIMEOUT_S).json() == DEFAULTS
    unauthenticated = requests.post(url, json={"log_info": False}, timeout=TIMEOUT_S)
    if servers.token:
        assert unauthenticated.status_code == 401, unauthenticated.text
        assert core.log_control.settings == LogSettings()
    else:  # no token: admin actions are taken from the loopback address, as this one is
        assert unauthenticated.status_code == 200 and unauthenticated.json()["log_info"] is False


def test_grpc_reads_and_changes_the_settings_as_tritonclient_expects(servers, core):
    with grpcclient.InferenceServerClient(servers.grpc_url) as client:
        assert client.get_log_settings(as_json=True, client_timeout=TIMEOUT_S)["settings"] == {
            "log_file": {"string_param": ""}, "log_info": {"bool_param": True},
            "log_warning": {"bool_param": True}, "log_error": {"bool_param": True},
            "log_verbose_level": {"uint32_param": 0}, "log_format": {"string_param": "default"}}
        if servers.token:
            with pytest.raises(InferenceServerException) as refused:
                client.update_log_settings({"log_info": False}, client_timeout=TIMEOUT_S)
            assert refused.value.status() == "StatusCode.UNAUTHENTICATED"
            assert core.log_control.settings == LogSettings()
        changed = client.update_log_settings({"log_verbose_level": 1, "log_format": "ISO8601", "log_error": None},
                                             headers=auth(servers), as_json=True, client_timeout=TIMEOUT_S)
        assert changed["settings"]["log_verbose_level"] == {"uint32_param": 1}
        assert changed["settings"]["log_format"] == {"string_param": "ISO8601"}
        assert core.log_control.settings == LogSettings(verbose_level=1, format="ISO8601")
    # a string where a boolean belongs, beside a good setting (Triton's own messages on a raw channel: tritonclient
    # picks each setting's type by its name)
    request = triton_pb.LogSettingsRequest()
    request.settings["log_warning"].bool_param = False
    request.settings["log_info"].string_param = "false"
    with grpc.insecure_channel(servers.grpc_url) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            triton_pb_grpc.GRPCInferenceServiceStub(channel).LogSettings(
                request, metadata=(("authorization", f"Bearer {TOKEN}"),) if servers.token else (),
                timeout=TIMEOUT_S)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "expect boolean for 'log_info'" in refused.value.details()
    assert core.log_control.settings == LogSettings(verbose_level=1, format="ISO8601")


def test_gpudctl_log_shows_and_changes_the_settings(servers, core, tmp_path, capsys):
    from gpud.cli.main import main as gpudctl

    url = ["--url", f"127.0.0.1:{servers.http_port}"]
    token = ["--token-file", str(tmp_path / "token")] if servers.token else []
    (tmp_path / "token").write_text(TOKEN + "\n")
    assert gpudctl(["log", *url]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "log_info           on", "log_warning        on", "log_error          on", "log_verbose_level  0",
        "log_format         default", "log_file           (standard error; the journal under systemd)"]
    assert gpudctl(["log", "--verbose", "2", "--warning", "off", "--format", "ISO8601", "--json", *url, *token]) == 0
    assert json.loads(capsys.readouterr().out) == {**DEFAULTS, "log_verbose_level": 2, "log_warning": False,
                                                   "log_format": "ISO8601"}
    assert core.log_control.settings == LogSettings(warning=False, verbose_level=2, format="ISO8601")
    if servers.token:  # a change without the token is refused, and says why
        assert gpudctl(["log", "--info", "off", *url]) == 1
        assert "HTTP 401" in capsys.readouterr().err
        assert core.log_control.settings.info is True
    with pytest.raises(SystemExit):
        gpudctl(["log", "--verbose", "-1", *url])
    assert core.log_control.settings.verbose_level == 2


@pytest.mark.parametrize("flags, settings", [
    ([], LogSettings()),
    (["--log-level", "DEBUG", "--log-info", "false", "--log-format", "ISO8601"],
     LogSettings(info=False, verbose_level=1, format="ISO8601")),
    (["--log-level", "ERROR", "--log-warning", "true"], LogSettings(info=False, warning=False)),  # the level first
    (["--log-verbose", "1", "--log-error", "false"], LogSettings(error=False, verbose_level=1)),
])
def test_tritonserver_s_log_flags_give_the_settings_gpud_starts_with(flags, settings):
    from gpud.main import build_parser, resolve_settings
    from gpud.settings import log_settings_of

    assert log_settings_of(resolve_settings(build_parser().parse_args(flags))) == settings


@pytest.mark.parametrize("values, words", [({"log_level": "LOUD"}, "log_level must be one of"),
                                           ({"log_format": "json"}, "log_format must be one of")])
def test_a_bad_log_setting_in_the_file_is_refused_with_its_name(values, words):
    from gpud.settings import Settings, check_settings

    with pytest.raises(ValueError, match=words):
        check_settings(Settings(**values))


def test_the_core_serves_the_extension_only_with_a_control(tmp_path):
    from tests.test_reload import core_on

    core, _ = core_on(tmp_path)
    assert "logging" not in core.server_metadata().extensions  # an application's process: its own logging
    with pytest.raises(InferenceError) as refused:
        core.update_log_settings({"log_info": False})
    assert refused.value.kind is ErrorKind.UNSUPPORTED and "application's" in refused.value.message
    core.log_control = LogControl(LogSettings(), apply_here=lambda s: None)
    assert "logging" in core.server_metadata().extensions
    assert core.update_log_settings({"log_info": False}) == core.log_settings() == LogSettings(info=False)


# --- a real daemon: every process follows ------------------------------------------------------------------------
@pytest.mark.slow
def test_every_process_of_the_daemon_follows_a_change(tmp_path):
    """Front ends in processes of their own and a device worker: each says at DEBUG that it follows, in the new
    format; back at verbose level 0 the daemon writes no DEBUG line."""
    d = start_daemon(None, tmp_path, "--http-processes", "1", "--grpc-processes", "1", "--log-warning", "false",
                     node=None)
    started = {**DEFAULTS, "log_warning": False}  # tritonserver's flag, at start
    try:
        assert "logging" in d.get_json("/v2")["extensions"]
        assert d.get_json("/v2/logging") == started
        # the front-end processes and the device worker start with the daemon's settings, not only follow a change
        kinds = ("gpud.frontproc.child", "gpud.executor.worker")
        children = [c.cmdline() for c in psutil.Process(d.proc.pid).children() if set(kinds) & set(c.cmdline())]
        assert sorted(k for cmd in children for k in kinds if k in cmd).count("gpud.frontproc.child") == 2, children
        assert any("gpud.executor.worker" in cmd for cmd in children), children
        for cmd in children:
            assert json.loads(cmd[cmd.index("--log-settings") + 1])["warning"] is False, cmd
        status, now = d.post_json("/v2/logging", {"log_verbose_level": 1, "log_format": "ISO8601"})
        assert status == 200 and now == {**started, "log_verbose_level": 1, "log_format": "ISO8601"}
        iso = r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z DEBUG "
        followers = (r"gpud\.frontend\[http 0\]", r"gpud\.frontend\[grpc 0\]", r"gpud\.worker\[")
        wait_for(lambda: all(re.search(iso + who + r".* log settings now: log_info True, log_warning False", d.log(),
                                       re.MULTILINE) for who in followers), 30, "every process's DEBUG line in ISO8601")
        assert re.search(r"INFO gpud: log settings: log_verbose_level 0 -> 1, log_format default -> ISO8601",
                         d.log()), d.log()
        # through a front-end process's gRPC too; the answer is the daemon's
        with grpcclient.InferenceServerClient(d.grpc_url) as client:
            back = client.update_log_settings({"log_verbose_level": 0, "log_format": "default"}, as_json=True,
                                              client_timeout=TIMEOUT_S)
        assert back["settings"]["log_verbose_level"] == {"uint32_param": 0}
        assert d.post_json("/v2/logging", {})[1] == started
        mark = len(d.log_lines)
        assert d.stop() == 0, d.log()
        assert not [line for line in d.log_lines[mark:] if " DEBUG " in line]
    finally:
        d.stop()
