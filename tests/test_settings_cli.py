"""gpud's settings file and command line: defaults, overrides, and clear errors for bad files."""
from __future__ import annotations

import subprocess
import sys

import pytest

from gpud.main import build_parser, resolve_settings
from gpud.settings import Settings, load_settings_file
from tests.daemon_harness import ROOT


def test_defaults_are_tritons_ports():
    s = resolve_settings(build_parser().parse_args([]))
    assert (s.http_port, s.grpc_port, s.metrics_port) == (8000, 8001, 8002)
    assert s.model_repository is None and s.node is None


def test_flags_override_the_file(tmp_path):
    f = tmp_path / "gpud.yaml"
    f.write_text("http_port: 9000\ngrpc-port: 9001\nmodel_repository: models\n")
    s = resolve_settings(build_parser().parse_args(["--config", str(f), "--http-port", "7000", "--address", "::1"]))
    assert (s.http_port, s.grpc_port) == (7000, 9001)
    assert s.model_repository == str(tmp_path / "models")  # relative to the file, not the working directory
    assert s.http_address == s.grpc_address == s.metrics_address == "::1"


def test_example_config_file_loads():
    overrides = load_settings_file(str(ROOT / "config" / "gpud.yaml"))
    assert Settings(**overrides).http_port == 8000


@pytest.mark.parametrize("text, message", [
    ("http_prot: 1\n", "unknown setting 'http_prot'"),
    ("http_port: eighty\n", "setting 'http_port': expected int"),
    ("allow_grpc: 3\n", "setting 'allow_grpc': expected bool"),
    ("- a\n- b\n", "expected a mapping"),
    ("http_port: [\n", "not valid YAML"),
])
def test_bad_settings_file_names_file_and_key(tmp_path, text, message):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(ValueError) as err:
        load_settings_file(str(f))
    assert str(f) in str(err.value) and message in str(err.value)


def test_gpud_refuses_a_bad_config_file_with_exit_2(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("nope: 1\n")
    out = subprocess.run([sys.executable, "-m", "gpud.main", "--config", str(f)], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 2 and "unknown setting 'nope'" in out.stderr


def test_gpud_refuses_a_bad_node_file_with_exit_2(tmp_path):
    f = tmp_path / "node.yaml"
    f.write_text("gpus: [{model: NVIDIA A100-SXM4-80GB, mig: [9g.99gb]}]\n")
    out = subprocess.run([sys.executable, "-m", "gpud.main", "--node", str(f), "--model-repository", str(tmp_path)],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 2 and str(f) in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("argv", [["--help"], ["--version"]])
def test_help_and_version(argv):
    out = subprocess.run([sys.executable, "-m", "gpud.main", *argv], capture_output=True, text=True, timeout=60,
                         cwd=ROOT)
    assert out.returncode == 0 and "gpud" in out.stdout


def test_gpudctl_usage():
    out = subprocess.run([sys.executable, "-m", "gpud.cli", "--help"], capture_output=True, text=True, timeout=60,
                         cwd=ROOT)
    assert out.returncode == 0 and "inspect" in out.stdout and "place" in out.stdout
    out = subprocess.run([sys.executable, "-m", "gpud.cli", "frobnicate"], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 2


def test_worker_hang_seconds_from_flag_and_file_and_a_negative_one_is_refused(tmp_path):
    assert resolve_settings(build_parser().parse_args([])).worker_hang_seconds == 300.0
    assert resolve_settings(build_parser().parse_args(["--worker-hang-secs", "0"])).worker_hang_seconds == 0.0
    f = tmp_path / "gpud.yaml"
    f.write_text("worker_hang_seconds: -1\n")
    with pytest.raises(ValueError, match="worker_hang_seconds must be >= 0"):
        resolve_settings(build_parser().parse_args(["--config", str(f)]))
    out = subprocess.run([sys.executable, "-m", "gpud.main", "--worker-hang-secs", "nan"], capture_output=True,
                         text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 2 and "worker_hang_seconds must be >= 0" in out.stderr


def test_placement_control_settings_and_clear_refusals(tmp_path):
    from gpud.settings import scaling_policy

    settings = resolve_settings(build_parser().parse_args(["--control-interval-seconds", "2"]))
    assert settings.placement_control == "on"  # the default
    policy = scaling_policy(settings)
    assert (policy.interval_seconds, policy.max_steps_per_interval) == (2.0, 4)
    assert policy.scale_down_cooldown_seconds == settings.hints_scale_down_stabilization_seconds  # no flapping
    f = tmp_path / "gpud.yaml"
    f.write_text("placement_control: on\n")  # YAML reads a bare `on` as true: refused, not taken as "on"
    with pytest.raises(ValueError, match=r"placement_control must be one of off, advise, on, got 'True' \(YAML reads "
                                         r"bare on/off as booleans: quote it"):
        scaling_policy(resolve_settings(build_parser().parse_args(["--config", str(f)])))
    out = subprocess.run([sys.executable, "-m", "gpud.main", "--control-interval-seconds", "0"], capture_output=True,
                         text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 2 and "control interval must be > 0 seconds" in out.stderr


def test_http_request_timeout_and_connection_cap_from_flags_and_bad_values_refused(tmp_path):
    default = resolve_settings(build_parser().parse_args([]))
    assert (default.http_request_timeout_seconds, default.http_max_connections) == (30.0, 10000)
    flags = resolve_settings(build_parser().parse_args(["--http-request-timeout-secs", "5",
                                                        "--http-max-connections", "64"]))
    assert (flags.http_request_timeout_seconds, flags.http_max_connections) == (5.0, 64)
    for bad in (["--http-request-timeout-secs", "0"], ["--http-request-timeout-secs", "nan"],
                ["--http-max-connections", "0"]):
        with pytest.raises(ValueError, match="http_request_timeout_seconds must be > 0 and http_max_connections"):
            resolve_settings(build_parser().parse_args(bad))


def test_request_limits_from_flags_and_file_and_bad_values_refused(tmp_path):
    default = resolve_settings(build_parser().parse_args([]))
    assert (default.max_request_bytes, default.max_header_bytes, default.max_tensor_elements) == \
        (64 * 2**20, 65536, 2**28)
    flags = resolve_settings(build_parser().parse_args(["--max-header-bytes", "8192",
                                                        "--max-tensor-elements", "1000000"]))
    assert (flags.max_header_bytes, flags.max_tensor_elements) == (8192, 1_000_000)
    f = tmp_path / "gpud.yaml"
    f.write_text("max_tensor_elements: 4096\n")
    assert resolve_settings(build_parser().parse_args(["--config", str(f)])).max_tensor_elements == 4096
    for flag in ("--max-request-bytes", "--max-header-bytes", "--max-tensor-elements"):
        key = flag[2:].replace("-", "_")
        with pytest.raises(ValueError, match=f"{key} must be >= 1, got 0"):
            resolve_settings(build_parser().parse_args([flag, "0"]))


def test_admin_actions_are_loopback_only_unless_opened(tmp_path):
    from gpud.api.admin import AdminAuth

    assert resolve_settings(build_parser().parse_args([])).admin_open is False
    assert resolve_settings(build_parser().parse_args(["--admin-open"])).admin_open is True
    f = tmp_path / "gpud.yaml"
    f.write_text("admin_open: true\n")
    assert resolve_settings(build_parser().parse_args(["--config", str(f)])).admin_open is True
    assert "loopback address only" in AdminAuth().describe()
    assert "any address (--admin-open)" in AdminAuth(open_to_network=True).describe()


def test_instance_bounds_defaults_from_flags_and_file_and_the_old_names(tmp_path, caplog):
    from gpud.scaling.bounds import BoundsDefaults
    from gpud.settings import prepare_settings

    s = resolve_settings(build_parser().parse_args([]))
    assert (s.min_instances, s.max_instances) == (None, None)  # the model's instance_group count; the node's room
    assert prepare_settings(s).bounds_defaults == BoundsDefaults(None, None)
    s = resolve_settings(build_parser().parse_args(["--min-instances", "0", "--max-instances", "6"]))
    assert prepare_settings(s).bounds_defaults == BoundsDefaults(0, 6)
    # The names of the hints' old bounds still work: a flag, and a config file key with a warning.
    s = resolve_settings(build_parser().parse_args(["--hints-max-instances", "4"]))
    assert s.max_instances == 4
    f = tmp_path / "gpud.yaml"
    f.write_text("hints_min_instances: 2\n")
    with caplog.at_level("WARNING", logger="gpud"):
        s = resolve_settings(build_parser().parse_args(["--config", str(f)]))
    assert s.min_instances == 2 and "setting 'hints_min_instances' is now 'min_instances'" in caplog.text
    with pytest.raises(ValueError, match=r"max_instances \(1\) must be >= min_instances \(2\)"):
        prepare_settings(resolve_settings(build_parser().parse_args(["--min-instances", "2", "--max-instances", "1"])))


def test_the_nodes_bounds_reach_the_models_that_set_none(tmp_path):
    from gpud.examples import write_example_repository
    from gpud.repository.layout import ModelRepository
    from gpud.scaling.bounds import BoundsDefaults, InstanceBounds
    from gpud.scheduling import new_registry

    write_example_repository(tmp_path, ["mlp", "cnn"])
    with open(tmp_path / "cnn" / "config.pbtxt", "a") as f:
        f.write('parameters { key: "gpud_max_instances" value: { string_value: "2" } }\n')
    registry = new_registry(True, bounds_defaults=BoundsDefaults(0, 5))
    for name, entry in ModelRepository(tmp_path).scan().items():
        registry.register(name, entry)
    assert registry.version("mlp").bounds == InstanceBounds(0, 5)  # the node's defaults
    assert registry.version("cnn").bounds == InstanceBounds(0, 2)  # its own maximum, the node's minimum
    view = next(v for v in registry.snapshot().versions() if v.model == "mlp")
    assert (view.min_instances, view.max_instances) == (0, 5)  # what the hints and the controller read
