"""What the dashboard and the rules ask Prometheus for: metric names in PromQL expressions, the dashboard's panel
queries with Grafana's variables expanded, and the rules file's expressions (for tests that check them)."""
from __future__ import annotations

import json
import re

import yaml

from tests.daemon_harness import ROOT

DASHBOARD = ROOT / "config" / "grafana" / "gpud.json"
RULES = ROOT / "config" / "prometheus" / "gpud-rules.yml"
# Template variables as Grafana would expand them with "All" selected (allValue ".+"), and the range variables.
VARIABLES = {"$instance": ".+", "$model": ".+", "$device": ".+", "$__rate_interval": "10s", "$__range": "5m",
             "$__interval": "2s"}

_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
             "offset", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers that are not functions, keywords, label names or strings."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range selectors
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)  # label lists
    names = set()
    for m in re.finditer(r"(?<![\w:.])([a-zA-Z_:][\w:]*)\s*(\()?", expr):
        name, call = m.group(1), m.group(2)
        if call or name.lower() in _KEYWORDS:
            continue
        names.add(name)
    return names


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, expression) of every panel query, variables expanded."""
    dash = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for var, value in VARIABLES.items():
                expr = expr.replace(var, value)
            assert "$" not in expr, f"panel {panel['title']!r}: unexpanded variable in {expr}"
            out.append((panel["title"], expr))
    return out


def rule_exprs() -> tuple[list[str], dict[str, str]]:
    """Every rule's expression, and recording rule name -> its expression."""
    doc = yaml.safe_load(RULES.read_text())
    exprs, recorded = [], {}
    for group in doc["groups"]:
        for rule in group["rules"]:
            exprs.append(rule["expr"])
            if "record" in rule:
                recorded[rule["record"]] = rule["expr"]
    return exprs, recorded
