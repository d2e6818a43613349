"""deploy/kubernetes/, offline: every manifest validates against the Kubernetes schemas (built-in kinds: the schemas
kubernetes-validate ships; ServiceMonitor, PrometheusRule, ScaledObject: tests/k8s_schemas/, vendored from their
CRDs) with unknown fields refused, as the API server's strict field validation does; each kustomization renders
(`kubectl kustomize`, skipped without kubectl) into valid manifests whose references hold; and what the manifests say
of gpud is what gpud does (its settings load, its ports, health routes and paths match, the pod is hardened, the
PrometheusRule is config/prometheus/gpud-rules.yml, the Deployment's pod is the DaemonSet's but for its GPUs)."""
from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import sys
import tomllib
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.daemon_harness import ROOT

DEPLOY = ROOT / "deploy" / "kubernetes"
SCHEMAS = ROOT / "tests" / "k8s_schemas"
KUBERNETES_VERSION = "1.30"  # the oldest release still supported when this was written
KUSTOMIZATIONS = ["base", "overlays/node", "overlays/fleet-keda", "overlays/fleet-hpa"]
CUSTOM = {("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor-monitoring.coreos.com-v1.json",
          ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheusrule-monitoring.coreos.com-v1.json",
          ("keda.sh/v1alpha1", "ScaledObject"): "scaledobject-keda.sh-v1alpha1.json"}
NOT_RESOURCES = {"kustomization.yaml", "gpud.yaml", "prometheus-adapter-rules.yaml"}  # kustomize's, gpud's, adapter's


# --- validation ------------------------------------------------------------------------------------------------------
def _strict(schema: Any) -> Any:
    """An object schema that lists its properties refuses others, unless it keeps unknown fields on purpose."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@cache
def _custom_validator(name: str):
    import jsonschema

    return jsonschema.Draft7Validator(_strict(json.loads((SCHEMAS / name).read_text())))


def schema_errors(doc: dict) -> list[str]:
    """Why `doc` is not a valid Kubernetes object ([] when it is)."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate not installed "
                                                                            "(the project's test extra)")
    custom = CUSTOM.get((doc.get("apiVersion"), doc.get("kind")))
    if custom is not None:
        return [f"{'.'.join(map(str, e.path))}: {e.message}" for e in _custom_validator(custom).iter_errors(doc)]
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{'.'.join(map(str, e.path))}: {e.message}"]
    except kubernetes_validate.SchemaNotFoundError as e:
        return [e.message]
    return []


def _resource_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*.yaml") if p.name not in NOT_RESOURCES)


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


@pytest.mark.parametrize("path", _resource_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_manifest_is_a_valid_kubernetes_object(path):
    for doc in _docs(path):
        assert schema_errors(doc) == [], (path, doc.get("kind"))


@pytest.mark.parametrize("kind, mutate, expected", [
    ("DaemonSet", lambda d: d["spec"]["template"]["spec"].update(nodeSelecter={}), "nodeSelecter"),
    ("DaemonSet", lambda d: d["spec"]["template"]["spec"]["containers"][0]["ports"][0].update(containerPort="http"),
     "is not of type 'integer'"),
    ("Service", lambda d: d["spec"]["ports"][0].pop("port"), "'port' is a required property"),
    ("ServiceMonitor", lambda d: d["spec"]["endpoints"][0].update(intervall="15s"), "intervall"),
    ("PrometheusRule", lambda d: d["spec"]["groups"][0]["rules"][0].update(expr=["not", "a query"]),
     "is not valid under any of the given schemas"),  # expr is an int-or-string
    ("PrometheusRule", lambda d: d["spec"]["groups"][1]["rules"][0].update(anotations={}), "anotations"),
    ("ScaledObject", lambda d: d["spec"].update(minReplicaCount="one"), "is not of type 'integer'"),
])
def test_the_validation_refuses_what_the_api_server_would(kind, mutate, expected):
    """Not a validation that passes anything: a misspelt field, a wrong type, a missing field are each caught."""
    doc = copy.deepcopy(next(d for p in _resource_files() for d in _docs(p) if d["kind"] == kind))
    assert schema_errors(doc) == []
    mutate(doc)
    errors = schema_errors(doc)
    assert errors and any(expected in e for e in errors), errors


# --- rendering -------------------------------------------------------------------------------------------------------
@cache
def _kubectl() -> str:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed (it renders kustomizations: `kubectl kustomize`)")
    out = subprocess.run([kubectl, "version", "--client"], capture_output=True, text=True, timeout=60).stdout
    found = re.search(r"Kustomize Version: v(\d+)", out)
    if not found or int(found.group(1)) < 4:
        pytest.skip(f"kubectl's kustomize is too old for components (needs v4+): {out.strip()!r}")
    return kubectl


@cache
def render(kustomization: str) -> tuple[dict, ...]:
    out = subprocess.run([_kubectl(), "kustomize", str(DEPLOY / kustomization)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def _one(docs, kind: str) -> dict:
    [doc] = [d for d in docs if d["kind"] == kind]
    return doc


def _workload(docs) -> dict:
    [doc] = [d for d in docs if d["kind"] in ("DaemonSet", "Deployment")]
    return doc


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_each_kustomization_renders_valid_manifests_whose_references_hold(kustomization):
    docs = render(kustomization)
    for doc in docs:
        assert schema_errors(doc) == [], doc["kind"]
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "inference", doc["kind"]
    workload = _workload(docs)
    pod = workload["spec"]["template"]
    assert workload["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for volume in pod["spec"]["volumes"]:
        if "configMap" in volume:
            assert ("ConfigMap", volume["configMap"]["name"]) in names  # the generated name, hash included
        if "persistentVolumeClaim" in volume:
            assert ("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"]) in names
    assert ("ServiceAccount", pod["spec"]["serviceAccountName"]) in names
    service = _one(docs, "Service")
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    container_ports = {p["name"] for p in pod["spec"]["containers"][0]["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= container_ports
    if kustomization != "base":
        monitor = _one(docs, "ServiceMonitor")
        assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
        assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}
        assert _one(docs, "PrometheusRule")["spec"]["groups"]
    if kustomization.startswith("overlays/fleet"):
        assert workload["kind"] == "Deployment"
        scaler = _one(docs, "ScaledObject" if kustomization.endswith("keda") else "HorizontalPodAutoscaler")
        target = scaler["spec"]["scaleTargetRef"]
        assert (target["kind"], target["name"]) == ("Deployment", workload["metadata"]["name"])
    else:
        assert workload["kind"] == "DaemonSet"


# --- what the manifests say of gpud ----------------------------------------------------------------------------------
def _daemonset() -> dict:
    return _docs(DEPLOY / "base" / "daemonset.yaml")[0]


def _deployment() -> dict:
    return _docs(DEPLOY / "components" / "fleet" / "deployment.yaml")[0]


def test_the_pod_runs_gpud_as_its_settings_say():
    from gpud.api.http_api import HttpApi
    from gpud.settings import prepare_settings
    from gpud.settings import Settings, load_settings_file
    from tests.fake_core import FakeCore

    settings = Settings(**load_settings_file(str(DEPLOY / "base" / "gpud.yaml")))
    prepare_settings(settings)  # gpud would start with it
    pod = _daemonset()["spec"]["template"]["spec"]
    [container] = pod["containers"]
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert set(mounts) == set(volumes)
    # the settings file is where --config reads it, from the generated ConfigMap
    config = container["args"][container["args"].index("--config") + 1]
    assert config == mounts["settings"]["mountPath"] + "/gpud.yaml" and volumes["settings"]["configMap"]
    # ports and probes are gpud's
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": settings.http_port, "grpc": settings.grpc_port, "metrics": settings.metrics_port}
    routes = HttpApi(FakeCore())._static
    for probe, path in [("startupProbe", "/v2/health/live"), ("livenessProbe", "/v2/health/live"),
                        ("readinessProbe", "/v2/health/ready")]:
        assert container[probe]["httpGet"] == {"path": path, "port": "http"} and path in routes
    # the repository is the read-only models volume; the admin socket's directory is writable; so is /dev/shm
    assert settings.model_repository == mounts["models"]["mountPath"] and mounts["models"]["readOnly"]
    assert volumes["models"]["persistentVolumeClaim"]["readOnly"]
    writable = {m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")}
    assert str(Path(settings.admin_socket).parent) in writable and "/dev/shm" in writable
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["XDG_CACHE_HOME"] in writable
    # preStop, then SIGTERM: gpud finishes the accepted requests before the kubelet kills it
    pre_stop_s = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pre_stop_s + settings.exit_timeout_seconds < pod["terminationGracePeriodSeconds"]
    # the image is this version of gpud
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert container["image"] == f"gpud:{version}"


def test_the_pod_is_hardened():
    """As the systemd unit: not root, no privilege escalation, no capabilities, a read-only root, the runtime's
    seccomp profile, no Kubernetes API token; the "restricted" Pod Security Standard holds in the namespace."""
    for workload in (_daemonset(), _deployment()):
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] > 0
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert pod["automountServiceAccountToken"] is False
        assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC")
        assert not any("hostPath" in v for v in pod["volumes"])
        sc = pod["containers"][0]["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
        assert sc["capabilities"] == {"drop": ["ALL"]} and sc["privileged"] is False
    namespace = _docs(DEPLOY / "base" / "namespace.yaml")[0]
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    assert _docs(DEPLOY / "base" / "serviceaccount.yaml")[0]["automountServiceAccountToken"] is False


def test_the_daemonset_runs_on_gpu_nodes_and_owns_their_gpus():
    pod = _daemonset()["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert pod["runtimeClassName"] == "nvidia"
    env = {e["name"]: e["value"] for e in pod["containers"][0]["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert "nvidia.com/gpu" not in pod["containers"][0]["resources"].get("limits", {})


def test_the_deployments_pod_is_the_daemonsets_but_for_its_gpus():
    """One pod written twice: they may differ only in how the pod gets GPUs and spreads (a change to one that is not
    made to the other fails here)."""
    ds, dep = _daemonset()["spec"]["template"], _deployment()["spec"]["template"]
    dep = copy.deepcopy(dep)
    container = dep["spec"]["containers"][0]
    assert container["resources"]["limits"].pop("nvidia.com/gpu") == 1  # from the device plugin, which sets
    assert "NVIDIA_VISIBLE_DEVICES" not in {e["name"] for e in container["env"]}  # NVIDIA_VISIBLE_DEVICES itself
    container["env"].insert(0, {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"})
    assert dep["spec"].pop("topologySpreadConstraints")
    assert dep == ds


def test_the_prometheus_rule_is_generated_from_the_rules_file():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_kubernetes.py"), "--check"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    rule = _docs(DEPLOY / "components" / "monitoring" / "prometheusrule.yaml")[0]
    rules = yaml.safe_load((ROOT / "config" / "prometheus" / "gpud-rules.yml").read_text())
    assert rule["spec"]["groups"] == rules["groups"]


def test_the_autoscalers_use_metrics_gpud_exports():
    from gpud.scaling.sampler import HintsSampler

    exported = {f.name for f in HintsSampler(lambda: None, lambda: [], _policy()).describe()}
    texts = [(DEPLOY / "components" / "keda" / "scaledobject.yaml").read_text(),
             (DEPLOY / "components" / "hpa" / "hpa.yaml").read_text(),
             (DEPLOY / "components" / "hpa" / "prometheus-adapter-rules.yaml").read_text()]
    used = {name for text in texts for name in re.findall(r"\bgpud_[a-z_]+\b", text)}
    assert used and used <= exported, used - exported
    # KEDA's queries select gpud's namespace, which the ServiceMonitor's targets carry
    for trigger in _docs(DEPLOY / "components" / "keda" / "scaledobject.yaml")[0]["spec"]["triggers"]:
        assert 'namespace="inference"' in trigger["metadata"]["query"]


def _policy():
    from gpud.settings import hint_policy
    from gpud.settings import Settings

    return hint_policy(Settings())
