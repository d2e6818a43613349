"""`gpudctl place`: exit codes, outputs, explanations, and input errors that name the file and the field."""
from __future__ import annotations

import json

import pytest

from gpud.examples import write_example_repository

from gpud.cli.place import place_main


def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


@pytest.fixture
def files(tmp_path):
    devices = _write(tmp_path, "devices.yaml", """
devices:
  - {id: gpu0, memory: 80GiB, compute: 1.0}
  - {id: gpu1, model: H100-80GB, mig: [3g.40gb, 3g.40gb]}
""")
    models = _write(tmp_path, "models.json", json.dumps({"models": [
        {"name": "llm", "memory": "30GiB", "instances": 2, "compute": 0.3},
        {"name": "bert", "memory": 1200000000, "instances": 3, "compute": 0.1},
    ]}))
    return tmp_path, devices, models


def test_json_output_places_everything(files, capsys):
    _, devices, models = files
    assert place_main(["--devices", devices, "--models", models, "-o", "json", "--time-limit", "0.2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["placements"]) == 5 and out["unplaced"] == []
    assert out["lower_bound"] <= out["devices_used"]
    assert set(out) >= {"placements", "unplaced", "devices_used", "lower_bound", "optimal", "moves"}


def test_unplaceable_model_is_explained_per_device(files, capsys):
    tmp_path, devices, _ = files
    models = _write(tmp_path, "big.yaml", "models:\n  - {name: giant, memory: 100GiB}\n")
    assert place_main(["--devices", devices, "--models", models]) == 1
    out = capsys.readouterr().out
    assert "UNPLACED" in out and "giant[0]: needs 100.00 GiB" in out
    for dev in ("gpu0:", "gpu1/mig0:3g.40gb@0:", "gpu1/mig1:3g.40gb@4:"):
        assert dev in out
    assert "insufficient memory: requested 100.00 GiB" in out and "<- closest" in out


def test_preset_and_table(capsys, tmp_path):
    models = _write(tmp_path, "m.yaml", "models:\n  - {name: a, memory: 10GiB, instances: 20, compute: 0.1}\n")
    assert place_main(["--devices", "dgx-h100-mig-balanced", "--models", models, "--time-limit", "0"]) == 0
    out = capsys.readouterr().out
    assert "DEVICE" in out and "devices used:" in out and "[" in out


def test_replan_with_current_prints_moves(files, capsys, tmp_path):
    _, devices, models = files
    assert place_main(["--devices", devices, "--models", models, "-o", "json", "--time-limit", "0"]) == 0
    plan_json = _write(tmp_path, "plan.json", capsys.readouterr().out)
    more = _write(tmp_path, "more.yaml", "models:\n  - {name: llm, memory: 30GiB, instances: 3, compute: 0.3}\n")
    assert place_main(["--devices", devices, "--models", more, "--current", plan_json, "-o", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    kinds = [m["kind"] for m in out["moves"]]
    assert kinds.count("add") == 1 and "remove" in kinds  # bert is gone, one llm added


@pytest.mark.parametrize("content,needle", [
    ("models:\n  - {name: a, memory: lots}\n", "models[0].memory: cannot parse size 'lots'"),
    ("models:\n  - {memory: 1GiB}\n", "models[0].name: required"),
    ("models:\n  - {name: a, memory: 1GiB, instances: two}\n", "models[0].instances: expected an integer"),
    ("models:\n  - {name: a, memory: 1GiB, constraints: {kinds: [tpu]}}\n", "models[0].constraints: "),
    ("nothing: here\n", "expected an object with a 'models' list"),
])
def test_input_errors_name_file_and_field(files, capsys, tmp_path, content, needle):
    _, devices, _ = files
    models = _write(tmp_path, "bad.yaml", content)
    assert place_main(["--devices", devices, "--models", models]) == 2
    err = capsys.readouterr().err
    assert models in err and needle in err


def test_device_errors_name_field(tmp_path, capsys):
    devices = _write(tmp_path, "d.yaml", "devices:\n  - {id: g0, model: H100-80GB, mig: [9g.99gb]}\n")
    models = _write(tmp_path, "m.yaml", "models:\n  - {name: a, memory: 1GiB}\n")
    assert place_main(["--devices", devices, "--models", models]) == 2
    err = capsys.readouterr().err
    assert "d.yaml: devices[0]" in err and "unknown MIG profile '9g.99gb'" in err


def test_apply_to_an_unreachable_gpud_is_a_clear_error(files, capsys):
    _, devices, models = files
    assert place_main(["--devices", devices, "--models", models, "--apply", "--url", "http://127.0.0.1:1"]) == 3
    assert "cannot reach gpud" in capsys.readouterr().err


def test_model_repository_estimates(tmp_path, capsys):
    repo = tmp_path / "repo"
    write_example_repository(repo, ["mlp"])  # a real ONNX file: the estimate is the daemon's own
    (repo / "mlp").rename(repo / "m1")
    cfg = (repo / "m1" / "config.pbtxt").read_text().replace('name: "mlp"', 'name: "m1"')
    (repo / "m1" / "config.pbtxt").write_text(cfg.replace("count: 1\n    kind: KIND_AUTO", "count: 2\n    kind: KIND_GPU"))
    assert place_main(["--devices", "dgx-h100", "--models", str(repo), "-o", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [p["model"] for p in out["placements"]] == ["m1", "m1"]


def test_without_an_exact_solver_the_output_says_plans_are_unproven(files, capsys, monkeypatch):
    import gpud.placement.solver as solver
    from gpud.placement import binpack1d

    monkeypatch.setattr(solver, "EXACT_SOLVER", None)
    monkeypatch.setattr(binpack1d, "highs_available", lambda: False)
    _, devices, models = files
    assert place_main(["--devices", devices, "--models", models, "--time-limit", "0.2"]) == 0
    assert "note: no exact solver installed" in capsys.readouterr().out
    assert place_main(["--devices", devices, "--models", models, "--time-limit", "0.2", "-o", "json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["exact_solver"] is None
    assert "plans are heuristic and unproven" in captured.err


def test_table_reports_bounds_gap_and_times(files, capsys):
    _, devices, models = files
    assert place_main(["--devices", devices, "--models", models, "--time-limit", "0.2"]) == 0
    out = capsys.readouterr().out
    assert "lower bound:" in out and "(memory " in out and "first plan" in out
    assert "no exact solver" not in out
