"""What `SANDHOLD_TRACES` and the OTLP endpoint variables switch on, each in a
fresh interpreter (tracing is configured once per process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from sandhold.telemetry.tracing import exporter_setting

SCRIPT = """
from sandhold.telemetry import context, tracing
provider = tracing.configure("probe")
print("configured" if provider else "off")
with context.span("outer", sandbox_id="sb-1"):
    with context.span("inner"):
        print(context.trace_id())
"""


def run(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SANDHOLD_", "OTEL_"))}
    return subprocess.run(
        [sys.executable, "-c", SCRIPT],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_file_exporter_writes_one_json_span_per_line(tmp_path) -> None:
    spans = tmp_path / "spans.jsonl"
    done = run({"SANDHOLD_TRACES": f"file:{spans}"})
    assert done.returncode == 0, done.stderr
    state, trace_id = done.stdout.split()
    assert state == "configured"
    written = [json.loads(line) for line in spans.read_text().splitlines()]
    assert sorted(s["name"] for s in written) == ["inner", "outer"]
    assert {s["context"]["trace_id"] for s in written} == {f"0x{trace_id}"}
    outer = next(s for s in written if s["name"] == "outer")
    assert outer["attributes"] == {"sandhold.sandbox_id": "sb-1"}
    assert outer["resource"]["attributes"]["service.name"] == "sandhold-probe"


def test_off_by_default_records_nothing_and_imports_no_sdk() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            SCRIPT + "import sys; print('opentelemetry.sdk' in sys.modules)",
        ],
        env={k: v for k, v in os.environ.items() if not k.startswith(("SANDHOLD_", "OTEL_"))},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["off", "None", "False"]


def test_which_exporter(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "SANDHOLD_TRACES",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    ):
        monkeypatch.delenv(name, raising=False)
    assert exporter_setting() == "off"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://collector:4318/v1/traces")
    assert exporter_setting() == "otlp"
    monkeypatch.setenv("SANDHOLD_TRACES", "off")  # the explicit choice wins
    assert exporter_setting() == "off"


def test_an_unknown_exporter_is_refused_by_name() -> None:
    done = run({"SANDHOLD_TRACES": "jaeger"})
    assert done.returncode != 0
    assert "SANDHOLD_TRACES='jaeger'" in done.stderr
