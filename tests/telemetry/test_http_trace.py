"""A trace can start at the HTTP gateway: a request with a `traceparent` header
continues the caller's trace, and the events it sets off record its id."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import httpx
import pytest
from sandhold.client import connect

from tests.gateway.conftest import Gw, start_gateway_up
from tests.support.waiting import wait_until


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gw]:
    running = start_gateway_up(tmp_path_factory.mktemp("gw") / "data")
    try:
        yield running
    finally:
        running.up.stop()


async def test_an_http_request_continues_the_callers_trace(gw: Gw) -> None:
    trace_id = secrets.token_hex(16)
    traceparent = f"00-{trace_id}-{secrets.token_hex(8)}-01"
    async with httpx.AsyncClient(base_url=gw.url, headers=gw.headers("acme"), timeout=30) as http:
        created = await http.post("/api/v1/sandboxes", headers={"traceparent": traceparent})
        assert created.status_code == 201, created.text
        untraced = await http.post("/api/v1/sandboxes")
        assert untraced.status_code == 201, untraced.text
    client = await connect(gw.up.url)
    try:

        async def started(sandbox_id: str):
            records = await client.sandbox_records(sandbox_id)
            return records if any(r.envelope.type == "sandbox.started" for r in records) else None

        records = await wait_until(
            lambda: started(created.json()["id"]), timeout=30, what="the sandbox to start"
        )
        # Created by the scheduler, placed, started by the host-agent: all in the caller's trace.
        assert {r.envelope.type: r.envelope.trace_id for r in records} == {
            "sandbox.created": trace_id,
            "sandbox.placed": trace_id,
            "sandbox.starting": trace_id,
            "sandbox.started": trace_id,
        }
        others = await client.sandbox_records(untraced.json()["id"])
        assert others and all(r.envelope.trace_id is None for r in others)
    finally:
        await client.close()
