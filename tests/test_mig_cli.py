"""`gpudctl mig`: the profile tables, and `recommend` end to end on presets, node files and model repositories, with
the mig-parted config checked against mig-parted's schema (version v1, mig-configs of device entries)."""
from __future__ import annotations

import json

import pytest
import yaml

from gpud.cli.main import main
from gpud.cli.mig import mig_main
from gpud.examples import write_example_repository
from gpud.placement import mig

MIX = {"models": [
    {"name": "embed", "memory": "2GiB", "compute": 0.1, "instances": 6},
    {"name": "asr", "memory": "10GiB", "compute": 0.25, "instances": 3},
    {"name": "llm-13b", "memory": "30GiB", "compute": 0.5, "instances": 2, "constraints": {"spread": True}},
    {"name": "tenant-a", "memory": "3GiB", "compute": 0.1, "constraints": {"kinds": ["mig"]}},
    {"name": "tenant-b", "memory": "4GiB", "compute": 0.1, "constraints": {"kinds": ["mig"]}},
]}


def check_mig_parted(text: str, gpus: list[tuple[str, str]]) -> dict:
    """mig-parted's config schema (pkg/types/v1): version "v1"; mig-configs maps a name to a list of entries with
    `devices` ("all" or a list of GPU indices), `mig-enabled` (bool) and, when enabled, `mig-devices` (profile name ->
    count). Each GPU index once; every layout valid on its GPU model."""
    data = yaml.safe_load(text)
    assert set(data) == {"version", "mig-configs"} and data["version"] == "v1"
    assert isinstance(data["mig-configs"], dict) and len(data["mig-configs"]) == 1
    (entries,) = data["mig-configs"].values()
    seen: list[int] = []
    for e in entries:
        assert set(e) <= {"devices", "device-filter", "mig-enabled", "mig-devices"}, e
        assert e["devices"] == "all" or (isinstance(e["devices"], list)
                                         and all(isinstance(i, int) and i >= 0 for i in e["devices"]))
        assert isinstance(e["mig-enabled"], bool)
        if not e["mig-enabled"]:
            assert "mig-devices" not in e
        else:
            assert isinstance(e["mig-devices"], dict) and e["mig-devices"]
            for name, count in e["mig-devices"].items():
                assert isinstance(name, str) and isinstance(count, int) and count > 0
            for i in e["devices"]:
                model = mig.gpu_model(gpus[i][1])
                mig.validate_layout(model, [n for n, c in e["mig-devices"].items() for _ in range(c)])
        seen += e["devices"]
    assert sorted(seen) == list(range(len(gpus)))
    return data


@pytest.fixture
def mix(tmp_path):
    p = tmp_path / "models.json"
    p.write_text(json.dumps(MIX))
    return str(p)


class TestProfiles:
    def test_table_lists_every_profile_with_memory_and_starts(self, capsys):
        assert main(["mig", "profiles", "A100-80GB"]) == 0
        out = capsys.readouterr().out
        assert out.startswith("A100-SXM4-80GB (NVIDIA A100-SXM4-80GB)")
        # 3g.40gb: profile 9, 40192 MiB = 39.25 GiB, 3 of 7 slices, 4 memory slots, 2 at most, starts 0 and 4
        assert [ln.split() for ln in out.splitlines() if " 3g.40gb " in ln] == [
            ["9", "3g.40gb", "39.25", "GiB", "3/7", "4", "2", "0,4"]]

    def test_json(self, capsys):
        assert mig_main(["profiles", "NVIDIA H100 80GB HBM3", "-o", "json"]) == 0
        data = json.loads(capsys.readouterr().out)
        assert data["name"] == "H100-80GB" and len(data["profiles"]) == 7
        one = next(p for p in data["profiles"] if p["name"] == "1g.10gb")
        assert one["starts"] == list(range(7)) and one["compute_fraction"] == pytest.approx(1 / 7, abs=1e-6)

    def test_no_gpu_lists_models(self, capsys):
        assert mig_main(["profiles"]) == 0
        assert "H200-141GB" in capsys.readouterr().out

    def test_unknown_gpu_is_an_input_error(self, capsys):
        assert mig_main(["profiles", "V100"]) == 2
        assert "unknown GPU model 'V100'" in capsys.readouterr().err


class TestRecommend:
    def test_table_explains_against_mig_off_and_balanced(self, mix, capsys):
        assert main(["mig", "recommend", "--gpus", "dgx-a100-80gb", "--models", mix]) == 0
        out = capsys.readouterr().out
        for needle in ("LAYOUT", "recommended", "MIG off", "balanced", "why:", "vs MIG off:", "vs balanced:"):
            assert needle in out
        # the two tenants must run on a MIG instance: MIG off serves 6 + 3 + 2 = 11 of the 13 instances
        assert "serves 2 more instance(s) (11/13 there)" in out

    def test_json_compares_layouts(self, mix, capsys):
        assert mig_main(["recommend", "--gpus", "dgx-h100", "--models", mix, "-o", "json"]) == 0
        data = json.loads(capsys.readouterr().out)
        rec = data["recommended"]
        assert rec["instances_placed"] == rec["instances"] == 13
        assert {a["name"] for a in data["alternatives"]} == {"MIG off", "balanced"}
        assert any(g["mig"] for g in rec["layouts"])  # the tenants need MIG somewhere
        assert data["plan"]["unplaced"] == []

    def test_mig_parted_output_has_mig_parted_schema(self, mix, capsys):
        assert mig_main(["recommend", "--gpus", "dgx-a100-80gb", "--models", mix, "-o", "mig-parted",
                         "--config-name", "inference"]) == 0
        data = check_mig_parted(capsys.readouterr().out, [(f"gpu{i}", "A100-SXM4-80GB") for i in range(8)])
        assert list(data["mig-configs"]) == ["inference"]
        assert any(e["mig-enabled"] for e in data["mig-configs"]["inference"])

    def test_big_models_keep_mig_off(self, tmp_path, capsys):
        p = tmp_path / "llm.yaml"
        p.write_text("models:\n  - {name: llm, memory: 60GiB, compute: 0.5, instances: 3}\n")
        assert mig_main(["recommend", "--gpus", "dgx-h100", "--models", str(p), "-o", "mig-parted"]) == 0
        data = check_mig_parted(capsys.readouterr().out, [(f"gpu{i}", "H100-80GB") for i in range(8)])
        assert not any(e["mig-enabled"] for e in data["mig-configs"]["gpud-recommended"])

    def test_node_description_and_repository(self, tmp_path, capsys):
        node = tmp_path / "node.yaml"
        node.write_text("gpus:\n  - {model: NVIDIA A100-SXM4-80GB, mig: [3g.40gb]}\n  - {model: NVIDIA A30}\n")
        repo = tmp_path / "repo"
        write_example_repository(repo)
        rc = mig_main(["recommend", "--gpus", str(node), "--models", str(repo), "-o", "mig-parted"])
        assert rc == 0, capsys.readouterr().err
        check_mig_parted(capsys.readouterr().out, [("gpu0", "A100-SXM4-80GB"), ("gpu1", "A30-24GB")])

    @pytest.mark.parametrize("gpus,message", [
        ("nope", "not a preset"),
        ("devices.yaml", "needs a known GPU 'model'"),
    ])
    def test_bad_gpus_are_input_errors(self, tmp_path, mix, capsys, monkeypatch, gpus, message):
        monkeypatch.chdir(tmp_path)
        (tmp_path / "devices.yaml").write_text("devices:\n  - {id: g0, memory: 80GiB}\n")
        assert mig_main(["recommend", "--gpus", gpus, "--models", mix]) == 2
        assert message in capsys.readouterr().err

    def test_too_much_demand_exits_1_and_says_what_is_left(self, tmp_path, capsys):
        p = tmp_path / "big.yaml"
        p.write_text("models:\n  - {name: llm, memory: 70GiB, compute: 1.0, instances: 9}\n")
        assert mig_main(["recommend", "--gpus", "dgx-h100", "--models", str(p)]) == 1
        captured = capsys.readouterr()
        assert "1 instance(s) left unplaced by the recommended layouts" in captured.out


@pytest.mark.parametrize("where", [[], ["--url", "http://127.0.0.1:9"], ["--socket", "/nonexistent/gpud.sock"]])
def test_live_models_from_a_gpud_that_is_not_there_is_a_clear_error(where, capsys, monkeypatch):
    # It used to crash with AttributeError ('NoneType' / 'str' object has no attribute 'socket_path'): the models
    # of a running gpud are read as `gpudctl place` reads them, from the endpoint --url or --socket names.
    monkeypatch.delenv("GPUD_ADMIN_SOCKET", raising=False)
    monkeypatch.setenv("GPUD_URL", "http://127.0.0.1:9")  # nothing listens on the discard port
    assert mig_main(["recommend", "--gpus", "dgx-a100-80gb", "--models", "live", *where]) == 2
    err = capsys.readouterr().err
    assert "gpudctl mig: error: cannot reach gpud at" in err and "Traceback" not in err
