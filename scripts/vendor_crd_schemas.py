#!/usr/bin/env python3
"""Vendor the schemas of the custom resources gpud's Kubernetes manifests use (deploy/kubernetes/), for the offline
validation in tests/test_kubernetes_manifests.py: each served version of each CustomResourceDefinition given becomes
tests/k8s_schemas/<kind>-<group>-<version>.json, its openAPIV3Schema without the descriptions (prose, most of the
size).

    python scripts/vendor_crd_schemas.py monitoring.coreos.com_servicemonitors.yaml \\
        monitoring.coreos.com_prometheusrules.yaml keda.sh_scaledobjects.yaml

The CRDs come from the projects' releases (prometheus-operator: example/prometheus-operator-crd/, KEDA:
config/crd/bases/); tests/k8s_schemas/README.md says which.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

OUT = Path(__file__).resolve().parent.parent / "tests" / "k8s_schemas"


def strip_descriptions(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: strip_descriptions(v) for k, v in node.items()
                if not (k == "description" and isinstance(v, str))}
    if isinstance(node, list):
        return [strip_descriptions(v) for v in node]
    return node


def vendor(crd_path: str) -> list[Path]:
    written = []
    for doc in yaml.safe_load_all(Path(crd_path).read_text()):
        if not doc or doc.get("kind") != "CustomResourceDefinition":
            continue
        spec = doc["spec"]
        for version in spec["versions"]:
            if not version.get("served", True):
                continue
            schema = strip_descriptions(version["schema"]["openAPIV3Schema"])
            out = OUT / f"{spec['names']['kind'].lower()}-{spec['group']}-{version['name']}.json"
            out.write_text(json.dumps(schema, indent=1, sort_keys=True) + "\n")
            written.append(out)
    return written


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    OUT.mkdir(parents=True, exist_ok=True)
    for path in argv:
        for out in vendor(path):
            print(f"{path} -> {out.relative_to(OUT.parent.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
