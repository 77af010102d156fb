"""The dashboard and the scrape config agree with what sandhold exports and
with compose.yaml, so a renamed metric or a new service is noticed here."""

from __future__ import annotations

import json
import re

import yaml
from sandhold.telemetry.log_metrics import CATALOG
from sandhold.telemetry.metrics import CHUNK_CACHE_CATALOG, PROCESS_CATALOG

from tests.conftest import ROOT

DEPLOY = ROOT / "deploy"
_SUFFIXES = ("_bucket", "_count", "_sum")


def exported_names() -> set[str]:
    names = set()
    for metric in (*CATALOG, *PROCESS_CATALOG, *CHUNK_CACHE_CATALOG):
        names.add(metric.name)
        if metric.kind == "histogram":
            names.update(metric.name + s for s in _SUFFIXES)
    return names


def test_every_dashboard_query_uses_metrics_sandhold_exports() -> None:
    dashboard = json.loads((DEPLOY / "grafana/dashboards/sandhold.json").read_text())
    queried = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            queried.update(re.findall(r"\b((?:sandhold_|tasks?_)[a-z_]+)\b", target["expr"]))
    assert queried, "no query names a sandhold metric"
    assert queried <= exported_names(), queried - exported_names()
    # The key numbers are on it.
    for shown in (
        "tasks_completed_total",
        "task_duration_seconds_bucket",
        "sandhold_save_lag_seconds",
        "sandhold_recovery_seconds_bucket",
        "sandhold_hosts",
    ):
        assert shown in queried


def test_prometheus_scrapes_every_service_compose_runs() -> None:
    config = yaml.safe_load((DEPLOY / "prometheus/prometheus.yml").read_text())
    targets = {
        job["job_name"]: {t for c in job["static_configs"] for t in c["targets"]}
        for job in config["scrape_configs"]
    }
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    runs = {
        name: spec["command"][2]
        for name, spec in compose["services"].items()
        if spec.get("command", [None])[:2] == ["sandhold", "run"]
    }
    folded = {name for name, service in runs.items() if service == "metrics"}
    assert folded == {"metrics-1", "metrics-2"}
    assert targets["sandhold-log"] == {f"{s}:9464" for s in folded}
    assert targets["sandhold-services"] == {f"{s}:9464" for s in set(runs) - folded}
    mounted = " ".join(compose["services"]["prometheus"]["volumes"])
    assert "./deploy/prometheus/prometheus.yml" in mounted
