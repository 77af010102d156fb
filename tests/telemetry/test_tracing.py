"""Traces across real service processes: the client starts a trace, the
scheduler and the host-agent continue it through NATS headers, and every event
the request set off records its trace id in its envelope."""

from __future__ import annotations

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sandhold.client import Client, connect

from tests.conftest import wait_until
from tests.e2e.harness import Up
from tests.telemetry.otlp import OtlpReceiver

COMMAND_EVENTS = ["command.queued", "command.dispatched", "command.started", "command.ended"]


def request_span(spans: InMemorySpanExporter, name: str):
    [span] = [s for s in spans.get_finished_spans() if s.name == name]
    return span


async def command_trace_ids(client: Client, sandbox_id: str, command_id: str) -> dict[str, str]:
    records = await client.sandbox_records(sandbox_id)
    return {
        r.envelope.type: r.envelope.trace_id
        for r in records
        if getattr(r.envelope.event, "command_id", None) == command_id
    }


async def test_one_request_is_one_trace_across_scheduler_and_host_agent(
    tmp_path, receiver: OtlpReceiver, client_spans: InMemorySpanExporter
) -> None:
    up = Up(tmp_path / "data", env={"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint}).start()
    try:
        client = await connect(up.url)
        try:
            sandbox = await client.create_sandbox()
            await client.wait_for_phase(sandbox.id, {"running"}, timeout=30)
            result = await client.exec(sandbox.id, ["true"])
            assert result.command.state == "exited"
            root = request_span(client_spans, "request command.run")
            trace_id = f"{root.context.trace_id:032x}"

            known_parents = {f"{root.context.span_id:016x}"}
            expected = {
                ("sandhold-scheduler", "append command.queued"),
                ("sandhold-scheduler", "append command.dispatched"),
                ("sandhold-host-agent", "append command.started"),
                ("sandhold-host-agent", "append command.ended"),
            }

            def whole_trace() -> bool:
                # Each service exports in its own batches: wait for all of them.
                spans = receiver.trace(trace_id)
                known = {s.span_id for s in spans} | known_parents
                return expected <= {(s.service, s.name) for s in spans} and all(
                    s.parent_span_id in known for s in spans
                )

            await wait_until(whole_trace, timeout=30, what="the services' spans, one tree")
            spans = receiver.trace(trace_id)
            assert {"sandhold-scheduler", "sandhold-host-agent"} <= {s.service for s in spans}
            # One tree: every span's parent is the client's request or another span of it.
            known = {s.span_id for s in spans} | known_parents
            assert all(s.parent_span_id in known for s in spans), spans
            # Other requests are traces of their own.
            create = request_span(client_spans, "request sandbox.create")
            assert create.context.trace_id != root.context.trace_id
            ids = await command_trace_ids(client, sandbox.id, result.command.id)
            assert ids == dict.fromkeys(COMMAND_EVENTS, trace_id)
        finally:
            await client.close()
    finally:
        up.stop()


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
        assert ids == dict.fromkeys(COMMAND_EVENTS, f"{root.context.trace_id:032x}")
    finally:
        await client.close()


async def test_with_tracing_off_everywhere_no_trace_id_is_recorded(plain_up: Up) -> None:
    client = await connect(plain_up.url)
    try:
        sandbox = await client.create_sandbox()
        await client.wait_for_phase(sandbox.id, {"running"}, timeout=30)
        result = await client.exec(sandbox.id, ["true"])
        ids = await command_trace_ids(client, sandbox.id, result.command.id)
        assert ids == dict.fromkeys(COMMAND_EVENTS, None)
    finally:
        await client.close()
