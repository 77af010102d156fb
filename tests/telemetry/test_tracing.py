"""Traces across real service processes: the client starts a trace, the
scheduler and the host-agent continue it through NATS headers, and every event
the request set off records its trace id in its envelope."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sandhold.client import Client, connect
from sandhold.domain.task_manifest import load_manifest

from tests.e2e.harness import Up
from tests.support.waiting import wait_until
from tests.telemetry.otlp import OtlpReceiver

# (Queued on a running sandbox, a command is dispatched by that event: 098.)
COMMAND_EVENTS = ["command.queued", "command.started", "command.ended"]
# A command that ends within moments of its start has no `command.started` (095).
SHORT_COMMAND_EVENTS = ["command.queued", "command.ended"]


def request_span(spans: InMemorySpanExporter, name: str):
    [span] = [s for s in spans.get_finished_spans() if s.name == name]
    return span


async def command_trace_ids(client: Client, sandbox_id: str, command_id: str) -> dict[str, str]:
    """The trace id of each of the command's events, read from the log right
    after `exec` returned: exec answers only with an end the stream stored, so
    every event of the command is there by then."""
    records = await client.sandbox_records(sandbox_id)
    ids = {
        r.envelope.type: r.envelope.trace_id
        for r in records
        if getattr(r.envelope.event, "command_id", None) == command_id
    }
    assert set(ids) in (set(COMMAND_EVENTS), set(SHORT_COMMAND_EVENTS)), ids
    return ids


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    running = OtlpReceiver().start()
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def traced_up(tmp_path_factory: pytest.TempPathFactory, receiver: OtlpReceiver) -> Iterator[Up]:
    """Every service exports its spans to `receiver` over OTLP."""
    running = Up(
        tmp_path_factory.mktemp("traced") / "data",
        env={"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint},
    ).start()
    try:
        yield running
    finally:
        running.stop()


async def whole_trace(receiver: OtlpReceiver, root, expected: set[tuple[str, str]]) -> list:
    """The spans of `root`'s trace once `expected` (service, span name) are all in
    and every span's parent is the root or another span of it (one tree). Each
    service exports in its own batches: wait for all of them."""
    trace_id = f"{root.context.trace_id:032x}"
    known_parents = {f"{root.context.span_id:016x}"}

    def complete() -> bool:
        spans = receiver.trace(trace_id)
        known = {s.span_id for s in spans} | known_parents
        return expected <= {(s.service, s.name) for s in spans} and all(
            s.parent_span_id in known for s in spans
        )

    await wait_until(complete, timeout=30, what=f"one tree holding {expected}")
    return receiver.trace(trace_id)


async def test_one_request_is_one_trace_across_scheduler_and_host_agent(
    traced_up: Up, receiver: OtlpReceiver, client_spans: InMemorySpanExporter
) -> None:
    client = await connect(traced_up.url)
    try:
        sandbox = await client.create_sandbox()
        await client.wait_for_phase(sandbox.id, {"running"}, timeout=30)
        # (Long enough for its start to be reported, a span of its own: 095.)
        result = await client.exec(sandbox.id, ["sleep", "0.5"])
        assert result.command.state == "exited"
        root = request_span(client_spans, "request command.run")
        trace_id = f"{root.context.trace_id:032x}"

        spans = await whole_trace(
            receiver,
            root,
            {
                ("sandhold-scheduler", "append command.queued"),
                # (the run instruction, sent by the scheduler's pass, carried it)
                ("sandhold-host-agent", "host-agent RunCommandWork"),
                ("sandhold-host-agent", "append command.started"),
                ("sandhold-host-agent", "append command.ended"),
            },
        )
        assert {"sandhold-scheduler", "sandhold-host-agent"} <= {s.service for s in spans}
        # Other requests are traces of their own.
        create = request_span(client_spans, "request sandbox.create")
        assert create.context.trace_id != root.context.trace_id
        ids = await command_trace_ids(client, sandbox.id, result.command.id)
        assert ids == dict.fromkeys(COMMAND_EVENTS, trace_id)  # (its start too)
    finally:
        await client.close()


async def test_a_task_is_one_trace_from_submission_to_its_end(
    traced_up: Up, receiver: OtlpReceiver, client_spans: InMemorySpanExporter
) -> None:
    client = await connect(traced_up.url)
    try:
        view = await client.submit_task(
            load_manifest({"name": "traced", "agent": {"command": ["sh", "-c", "echo hi"]}})
        )
        task = await client.wait_for_task(
            view.id, lambda s: s if s.terminal else None, timeout=60, what="the task's end"
        )
        assert task.state == "completed"
        root = request_span(client_spans, "request task.submit")
        # The orchestrator runs it in the submission's trace, and the sandbox it
        # asked for and the command it ran there continue it.
        await whole_trace(
            receiver,
            root,
            {
                ("sandhold-orchestrator", "append task.submitted"),
                ("sandhold-orchestrator", "append task.completed"),
                ("sandhold-scheduler", "append sandbox.created"),
                ("sandhold-host-agent", "append command.ended"),
            },
        )
        trace_ids = {r.envelope.trace_id for r in await client.task_records(view.id)}
        assert trace_ids == {f"{root.context.trace_id:032x}"}
    finally:
        await client.close()


async def test_services_without_tracing_still_carry_the_callers_trace_id(
    plain_up: Up, client_spans: InMemorySpanExporter
) -> None:
    client = await connect(plain_up.url)
    try:
        sandbox = await client.create_sandbox()
        await client.wait_for_phase(sandbox.id, {"running"}, timeout=30)
        result = await client.exec(sandbox.id, ["true"])
        root = request_span(client_spans, "request command.run")
        ids = await command_trace_ids(client, sandbox.id, result.command.id)
        assert ids == dict.fromkeys(ids, f"{root.context.trace_id:032x}")
    finally:
        await client.close()


async def test_with_tracing_off_everywhere_no_trace_id_is_recorded(plain_up: Up) -> None:
    client = await connect(plain_up.url)
    try:
        sandbox = await client.create_sandbox()
        await client.wait_for_phase(sandbox.id, {"running"}, timeout=30)
        result = await client.exec(sandbox.id, ["true"])
        ids = await command_trace_ids(client, sandbox.id, result.command.id)
        assert ids == dict.fromkeys(ids, None)
    finally:
        await client.close()
