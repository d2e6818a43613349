"""gpud.model_control: the modes, model-name checks, the admin token, and what a repository poll finds."""
from __future__ import annotations


import pytest

from gpud.executor.types import ErrorKind, InferenceError
from gpud.api.admin import AdminAuth, read_token_file
from gpud.model_control import ModelControl, check_model_name, model_fingerprint, repository_changes


@pytest.mark.parametrize("name, ok", [
    ("resnet50", True), ("bert-large_v2", True), ("a.b", True),
    ("", False), (".", False), ("..", False), (".hidden", False), ("a/b", False), ("../etc", False),
    ("/etc/passwd", False), ("a\\b", False), ("a\0b", False),
])
def test_model_names(name, ok):
    if ok:
        check_model_name(name)
    else:
        with pytest.raises(InferenceError) as exc:
            check_model_name(name)
        assert exc.value.kind is ErrorKind.INVALID_ARGUMENT and "invalid model name" in exc.value.message


def test_modes():
    assert ModelControl().loads_at_start("any") and not ModelControl().loads_new_on_demand
    explicit = ModelControl("explicit", ("mlp",))
    assert explicit.loads_at_start("mlp") and not explicit.loads_at_start("cnn")
    assert ModelControl("explicit", ("*",)).loads_at_start("cnn")
    assert not ModelControl("explicit").loads_at_start("mlp")  # as Triton: nothing unless named
    assert ModelControl("poll").loads_new_on_demand
    with pytest.raises(InferenceError) as exc:
        ModelControl().check_api("unload", "cnn")
    assert exc.value.kind is ErrorKind.UNAVAILABLE and "--model-control-mode explicit" in exc.value.message
    ModelControl("explicit").check_api("unload", "cnn")
    ModelControl("poll").check_api("load", "cnn")


@pytest.mark.parametrize("mode, load, message", [
    ("auto", (), "model_control_mode must be one of none, explicit, poll"),
    ("none", ("mlp",), "--load-model needs --model-control-mode explicit"),
    ("explicit", ("../x",), "invalid model name"),
])
def test_refused_settings(mode, load, message):
    with pytest.raises((ValueError, InferenceError), match=message):
        ModelControl(mode, load)


def test_repository_changes():
    before = {"a": (1,), "b": (2,), "c": (3,)}
    now = {"a": (1,), "b": (9,), "d": (4,)}
    changes = repository_changes(before, now)
    assert (changes.added, changes.removed, changes.changed) == (("d",), ("c",), ("b",))


def test_a_fingerprint_changes_with_the_config_and_the_versions(tmp_path):
    model = tmp_path / "m"
    (model / "1").mkdir(parents=True)
    (model / "1" / "model.onnx").write_bytes(b"x")
    first = model_fingerprint(str(model))
    assert model_fingerprint(str(model)) == first
    (model / "config.pbtxt").write_text("max_batch_size: 4")
    second = model_fingerprint(str(model))
    assert second != first
    (model / "2").mkdir()
    (model / "2" / "model.onnx").write_bytes(b"y")
    assert model_fingerprint(str(model)) != second
    assert model_fingerprint(str(tmp_path / "missing")) == ()


def test_admin_token(tmp_path):
    AdminAuth().check(None, "anything")  # no token set: open
    auth = AdminAuth("t" * 20)
    auth.check("Bearer " + "t" * 20, "loading")
    auth.check("bearer " + "t" * 20, "loading")
    for header in (None, "", "Bearer", "Basic " + "t" * 20, "Bearer " + "u" * 20):
        with pytest.raises(InferenceError) as exc:
            auth.check(header, "loading model 'x'")
        assert exc.value.kind is ErrorKind.UNAUTHENTICATED
        assert "loading model 'x' needs the admin token" in exc.value.message
    (tmp_path / "short").write_text("abc\n")
    with pytest.raises(ValueError, match="at least 16 characters"):
        read_token_file(str(tmp_path / "short"))
    with pytest.raises(ValueError, match="admin token file"):
        read_token_file(str(tmp_path / "missing"))
    (tmp_path / "ok").write_text("  " + "k" * 16 + "\n")
    assert read_token_file(str(tmp_path / "ok")) == "k" * 16
