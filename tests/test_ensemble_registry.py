"""Ensembles in the registry, the lifecycle, placement and the controller (gpud.ensembles): an ensemble has no
instances and is never placed, counted idle or scaled; it is ready while every step's model serves and fits;
loading it loads its steps' models as dependencies; unload_dependents unloads those again. The executor pool is the
scripted double of test_placement_service (loads succeed at once, nothing computes); everything else is real."""
from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from gpud.executor.types import ErrorKind, InferenceError, InferRequest, InferTensor
from gpud.scaling.sampler import read_counters
from gpud.cli.inspect import render_inspect
from gpud.scaling.controller import ScalingController
from gpud.scaling.rules import ScalingPolicy
from gpud.core import GpudCore
from gpud.core_api import RequestedPlacement
from gpud.ensembles import RegisteredEnsemble, models_to_load
from gpud.examples import CLASSES, PIXELS, make_classifier
from gpud.model_control import ModelControl
from gpud.placing.service import PlacementService
from gpud.scheduling import new_registry
from gpud.repository.layout import ModelRepository
from gpud.scaling.hints import HintDecision
from gpud.telemetry.serving import ModelState
from gpud.telemetry.simulated import SimulatedBackend
from tests.ensemble_models import ensemble_config, model_config, save_model, step, write_ensemble_repository
from tests.test_placement_service import NODE, ScriptedPool

STEPS = {"preprocess", "classifier", "postprocess"}


def make_core(tmp_path: Path, control: ModelControl = ModelControl(), repo: Path | None = None):
    if repo is None:
        repo = write_ensemble_repository(tmp_path / "repo")
    (tmp_path / "node.yaml").write_text(NODE)
    backend = SimulatedBackend.from_file(tmp_path / "node.yaml")
    registry, pool = new_registry(has_gpus=True), ScriptedPool()
    service = PlacementService(backend, pool, registry, device_reserve_bytes=0, time_limit_s=0)
    return GpudCore(ModelRepository(repo), registry, service, pool, control=control), pool, repo


def run(coro):
    return asyncio.run(coro)


def index(core: GpudCore) -> dict[str, tuple[str, str]]:
    return {r.name: (r.state.value, r.reason) for r in core.repository_index() if r.version or r.reason != "unloaded"}


def loaded(core: GpudCore) -> set[str]:
    return {name for name, m in core.registry.models.items() if m.versions}


def test_an_ensemble_is_registered_without_instances_and_never_placed(tmp_path):
    async def scenario():
        core, pool, _ = make_core(tmp_path)
        await core.start()
        vs = core.registry.version("pipeline")
        assert isinstance(vs, RegisteredEnsemble) and vs.ready and core.model_ready("pipeline")
        assert not vs.instances and not vs.scaled_to_zero and vs.bounds.maximum == 0
        loads = {key.split(":")[0] for event, key, _ in pool.events if event == "load"}
        assert loads == STEPS | {"classifier_b", "add", "embed"}  # the ensembles themselves: nothing to load
        demands = {d.name for d in core.placement.inputs().demands}
        assert not demands & {"pipeline", "fanout", "lookup"}
        view = next(v for v in core.snapshot().versions() if v.model == "pipeline")
        assert view.is_ensemble and view.state is ModelState.READY and view.instances == ()
        assert [(p.index, p.model, p.version, p.serving_version, p.ready) for p in view.pipeline] == \
            [(0, "preprocess", "-1", "1", True), (1, "classifier", "-1", "1", True), (2, "postprocess", "-1", "1", True)]
        assert index(core)["pipeline"] == ("READY", "")
    run(scenario())


def test_readiness_follows_the_steps_and_a_refused_request_names_the_step(tmp_path):
    async def scenario():
        core, _, _ = make_core(tmp_path, ModelControl("explicit", ("*",)))
        await core.start()
        await core.unload_model("classifier")
        why = "step 1 (model 'classifier'): model 'classifier' has no loaded version"
        assert not core.model_ready("pipeline") and index(core)["pipeline"] == ("UNAVAILABLE", why)
        assert index(core)["fanout"][1].startswith("step 1 (model 'classifier')")
        request = InferRequest("pipeline", [InferTensor("IMAGE", "UINT8", (1, PIXELS), None)])
        with pytest.raises(InferenceError) as e:
            core.submit(request, lambda r: None)
        assert e.value.kind is ErrorKind.UNAVAILABLE and why in e.value.message
        view = next(v for v in core.snapshot().versions() if v.model == "pipeline")
        assert (view.state, view.reason) == (ModelState.UNAVAILABLE, why)
        assert [p.ready for p in view.pipeline] == [True, False, True]
        await core.load_model("classifier")  # it serves again: so does the ensemble
        assert core.model_ready("pipeline") and index(core)["pipeline"] == ("READY", "")
    run(scenario())


def test_a_request_waits_while_a_steps_instances_are_down_for_now_as_a_clients_would(tmp_path):
    # A step model loaded but with no ready instance for now (its worker restarting): the ensemble is not ready (its
    # readiness says so) but accepts requests, whose step waits in that model's queue, bounded by its
    # unready_wait_s, as a request sent to the model itself does.
    async def scenario():
        core, _, _ = make_core(tmp_path)
        await core.start()
        pre = core.registry.version("preprocess")
        for inst in pre.instances:
            inst.ready = False
            inst.on_ready_change(inst)
        assert not core.model_ready("pipeline") and not core.model_ready("preprocess")
        assert core.registry.version("pipeline").accepts_requests
        image = np.zeros((1, PIXELS), np.uint8)
        request = InferRequest("pipeline", [InferTensor("IMAGE", "UINT8", image.shape, image)])
        answers: list = []
        cancel = core.submit(request, answers.append)
        await asyncio.sleep(0)  # one turn of the loop: the ensemble sends its first steps at its end
        assert pre.scheduler.pending_requests == 1 and answers == []
        cancel()  # the client goes away: its step's request leaves the queue
        assert pre.scheduler.pending_requests == 0 and answers == []
    run(scenario())


def test_a_step_model_reloaded_with_a_config_that_no_longer_fits_makes_the_ensemble_not_ready(tmp_path):
    async def scenario():
        core, _, repo = make_core(tmp_path, ModelControl("explicit", ("*",)))
        await core.start()
        wide = CLASSES + 1
        save_model(repo, "classifier", make_classifier(seed=5, classes=wide),
                   model_config("classifier", [("features", "TYPE_FP32", [PIXELS])], [("logits", "TYPE_FP32", [wide])]))
        await core.load_model("classifier")
        assert not core.model_ready("pipeline")
        assert "ensemble tensor 'logits': inconsistent shape: [-1,5] from step 1 (model 'classifier')'s output " \
               "'logits', [-1,4] from step 2 (model 'postprocess')'s input 'logits'" in index(core)["pipeline"][1]
    run(scenario())


def test_a_step_on_a_missing_model_or_version_and_a_cycle_of_ensembles_are_not_ready_with_the_reason(tmp_path):
    async def scenario():
        repo = write_ensemble_repository(tmp_path / "repo")
        io = ([("IMAGE", "TYPE_UINT8", [PIXELS])], [("F", "TYPE_FP32", [PIXELS])])
        save_model(repo, "nowhere", None, ensemble_config("nowhere", *io, [step("absent", {"raw": "IMAGE"},
                                                                               {"features": "F"})]))
        save_model(repo, "v2", None, ensemble_config("v2", *io, [step("preprocess", {"raw": "IMAGE"},
                                                                      {"features": "F"}, version=2)]))
        save_model(repo, "ring_a", None, ensemble_config("ring_a", *io, [step("ring_b", {"IMAGE": "IMAGE"},
                                                                              {"F": "F"})]))
        save_model(repo, "ring_b", None, ensemble_config("ring_b", *io, [step("ring_a", {"IMAGE": "IMAGE"},
                                                                              {"F": "F"})]))
        core, _, _ = make_core(tmp_path, repo=repo)
        await core.start()
        got = index(core)
        assert got["nowhere"] == ("UNAVAILABLE", "step 0 (model 'absent'): model 'absent' is not loaded")
        assert got["v2"] == ("UNAVAILABLE", "step 0 (model 'preprocess'): version 2 of model 'preprocess' is not "
                                            "loaded (loaded: 1)")
        assert "circular dependency between ensembles" in got["ring_a"][1]
        assert "circular dependency between ensembles" in got["ring_b"][1]
        assert got["pipeline"] == ("READY", "")  # the others serve
    run(scenario())


def test_explicit_loading_an_ensemble_loads_its_steps_as_dependencies_and_unload_dependents_unloads_them(tmp_path):
    async def scenario():
        core, _, _ = make_core(tmp_path, ModelControl("explicit", ("pipeline",)))
        await core.start()  # --load-model pipeline: its steps load with it, not explicitly
        assert loaded(core) == STEPS | {"pipeline"} and core.model_ready("pipeline")
        assert {n for n, m in core.registry.models.items() if m.versions and m.explicit} == {"pipeline"}
        await core.load_model("fanout")  # preprocess and classifier serve already; classifier_b and add load
        assert loaded(core) == STEPS | {"pipeline", "fanout", "classifier_b", "add"} and core.model_ready("fanout")
        await core.unload_model("fanout", unload_dependents=True)
        # classifier_b and add go; preprocess and classifier stay: pipeline uses them
        assert loaded(core) == STEPS | {"pipeline"}
        await core.load_model("classifier")  # now explicitly loaded too: unload_dependents keeps it
        await core.unload_model("pipeline", unload_dependents=True)
        assert loaded(core) == {"classifier"}
    run(scenario())


def test_unload_without_dependents_keeps_the_steps_and_in_mode_none_everything_is_explicit(tmp_path):
    async def scenario():
        core, _, _ = make_core(tmp_path, ModelControl("explicit", ("pipeline",)))
        await core.start()
        await core.unload_model("pipeline")
        assert loaded(core) == STEPS
    run(scenario())
    scanned = ModelRepository(write_ensemble_repository(tmp_path / "r2")).scan()
    assert models_to_load(scanned, ["pipeline"]) == {"classifier": False, "pipeline": True, "postprocess": False,
                                                     "preprocess": False}
    assert all(models_to_load(scanned, scanned).values())


def test_the_controller_hints_and_placement_requests_leave_the_ensemble_alone(tmp_path):
    async def scenario():
        core, _, _ = make_core(tmp_path)
        await core.start()
        assert ("pipeline", "1") not in read_counters(core.snapshot(), 0.0)  # no hint for it
        wanted = HintDecision(5, 5, 0, None, 5, None, "scripted")
        loop = ScalingController(core.snapshot, lambda: {("pipeline", "1"): wanted}, core.placement,
                           ScalingPolicy(interval_seconds=1), "on")
        await loop.tick()
        assert not [t for t in loop.targets if t.model == "pipeline"] and not loop.decisions
        assert {t.model for t in loop.targets} == STEPS | {"classifier_b", "add", "embed"}
        with pytest.raises(InferenceError) as e:
            await core.apply_placement([RequestedPlacement("pipeline", 0, "gpu0")])
        assert e.value.kind is ErrorKind.INVALID_ARGUMENT
        assert "'pipeline' is an ensemble: it has no instances of its own; place the models of its steps " \
               "(preprocess, classifier, postprocess)" in e.value.message
    run(scenario())


def test_inspect_shows_the_pipeline(tmp_path):
    async def scenario():
        core, pool, _ = make_core(tmp_path)
        pool.worker_info = lambda: []  # no worker processes here
        await core.start()
        doc = core.inspect()
        pipeline = next(m for m in doc["models"] if m["name"] == "pipeline")
        assert pipeline["instances"] == [] and pipeline["pipeline"][2] == {
            "step": 2, "model": "postprocess", "version": "-1", "serving_version": "1", "ready": True,
            "inputs": {"logits": "logits"}, "outputs": {"label": "LABEL", "probabilities": "PROBABILITIES"}}
        assert next(m for m in doc["models"] if m["name"] == "classifier")["pipeline"] is None
        text = render_inspect(doc)
        assert "PIPELINES (ensembles; the models of their steps are placed and scaled, not the ensemble)" in text
        assert "  pipeline:1 READY" in text
        assert "    step 1  classifier:1             (newest) ready      in: features->features  out: " \
               "logits->logits" in text
        assert "  pipeline               1 READY           -       0" in text  # no instances of its own
    run(scenario())


def test_in_poll_mode_a_request_for_a_new_ensemble_registers_its_steps_too(tmp_path):
    async def scenario():
        repo = tmp_path / "repo"
        core, _, _ = make_core(tmp_path, ModelControl("poll"), repo=repo)
        repo.mkdir()
        await core.start()  # an empty repository
        write_ensemble_repository(repo)
        core.lifecycle.register_new("pipeline")  # what its first request does in poll mode
        assert STEPS <= set(core.registry.models)  # its steps too: scaled to zero, each loads on its first request
        assert core.model_ready("pipeline")
    run(scenario())


def test_an_offline_plan_of_a_repository_with_ensembles_plans_their_steps_only(tmp_path, capsys):
    from gpud.cli.place import repository_demands
    from gpud.placing.inputs import planning_devices

    repo = write_ensemble_repository(tmp_path / "repo")
    (tmp_path / "node.yaml").write_text(NODE)
    devices = planning_devices(SimulatedBackend.from_file(tmp_path / "node.yaml").leaf_devices(),
                               device_reserve_bytes=0)
    demands = {d.name for d in repository_demands(str(repo), devices, 4)}
    assert demands == STEPS | {"classifier_b", "add", "embed"}
    assert capsys.readouterr().err == ""  # an ensemble is no model "left out": it has nothing to place
