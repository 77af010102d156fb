"""Structured logs: JSON lines naming the service, the ids in context and the
trace id; levels per logger from SANDHOLD_LOG."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest
from sandhold.telemetry import context, logs

from tests.e2e.harness import Up
from tests.support.waiting import wait_until

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture
def restored_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    named = {name: logging.getLogger(name).level for name in ("sandhold.x", "sandhold.y")}
    try:
        yield
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(level)
        for name, old in named.items():
            logging.getLogger(name).setLevel(old)


def test_levels_are_a_default_and_overrides_per_logger() -> None:
    assert logs.parse_levels("") == (logging.INFO, {})
    assert logs.parse_levels("debug") == (logging.DEBUG, {})
    assert logs.parse_levels("warning, sandhold.scheduler=debug,nats=ERROR") == (
        logging.WARNING,
        {"sandhold.scheduler": logging.DEBUG, "nats": logging.ERROR},
    )
    with pytest.raises(ValueError, match="loud"):
        logs.parse_levels("loud")


def test_a_line_is_json_with_service_ids_and_trace(
    monkeypatch: pytest.MonkeyPatch, restored_logging: None
) -> None:
    monkeypatch.setenv("SANDHOLD_LOG", "warning,sandhold.x=debug")
    monkeypatch.delenv("SANDHOLD_LOG_FORMAT", raising=False)
    out = io.StringIO()  # not a terminal: JSON
    logs.configure("scheduler", stream=out)
    with context.span("handle", parent=TRACEPARENT, sandbox_id="sb-1"):
        logging.getLogger("sandhold.x").debug("placing %s", "sb-1", extra={"command_id": "c-1"})
        logging.getLogger("sandhold.y").info("not shown: below warning")
    logging.getLogger("sandhold.y").warning("outside any span")
    first, second = (json.loads(line) for line in out.getvalue().splitlines())
    assert first == {
        "time": first["time"],
        "level": "debug",
        "service": "scheduler",
        "logger": "sandhold.x",
        "message": "placing sb-1",
        "sandbox_id": "sb-1",
        "command_id": "c-1",
        "trace_id": "0af7651916cd43dd8448eb211c80319c",
    }
    assert first["time"].endswith("Z")
    assert second["message"] == "outside any span"
    assert "sandbox_id" not in second and "trace_id" not in second


def test_a_terminal_gets_text_lines(
    monkeypatch: pytest.MonkeyPatch, restored_logging: None
) -> None:
    monkeypatch.setenv("SANDHOLD_LOG_FORMAT", "text")
    out = io.StringIO()
    logs.configure("saver", stream=out)
    with context.span("work", sandbox_id="sb-2"):
        logging.getLogger("sandhold.x").warning("hello")
    assert out.getvalue().rstrip().endswith("sandhold.x: hello [sandbox_id=sb-2]")


async def test_services_under_up_write_json_lines_at_the_levels_asked_for(
    plain_up: Up,
) -> None:
    logs_dir = plain_up.data_dir / "logs"

    def lines(service: str) -> list[dict]:
        text = (logs_dir / f"{service}.log").read_text()
        return [json.loads(line) for line in text.splitlines() if line.startswith("{")]

    # SANDHOLD_LOG=warning,sandhold.scheduler=info: the scheduler's info lines only.
    ready = await wait_until(
        lambda: [x for x in lines("scheduler") if x["message"] == "scheduler ready"],
        what="the scheduler's ready line",
    )
    assert ready[0]["service"] == "scheduler" and ready[0]["level"] == "info"
    for service in ("saver", "recovery", "host-agent-local"):
        assert all(x["level"] in ("warning", "error", "critical") for x in lines(service))
        assert (logs_dir / f"{service}.log").exists()
