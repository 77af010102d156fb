"""A real `sandhold up` (gateway included) with tokens for two tenants."""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import msgspec
import pytest
from sandhold.gateway import tokens

from tests.e2e.harness import Up


class Gw:
    """`sandhold up` plus what the HTTP tests need: its URL and tokens."""

    def __init__(self, up: Up, tokens_by_tenant: dict[str, str]) -> None:
        self.up = up
        self.url = up.gateway_url
        self.tokens = tokens_by_tenant

    def position(self) -> int:
        """How far the gateway's read model has applied the log."""
        with contextlib.closing(sqlite3.connect(f"file:{self.read_model}?mode=ro", uri=True)) as db:
            row = db.execute("SELECT value FROM meta WHERE key = 'position'").fetchone()
        return int(row[0]) if row else 0

    def headers(self, tenant: str = "acme", **extra: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[tenant]}", **extra}

    def http(self, tenant: str = "acme") -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, headers=self.headers(tenant), timeout=30)

    @property
    def read_model(self) -> Path:
        return Path(self.up.runtime["gateway"]["read_model"])


def start_gateway_up(data_dir: Path, *extra: str, env: dict[str, str] | None = None) -> Gw:
    data_dir.mkdir(parents=True)
    made = {}
    for tenant in ("acme", "globex", "default"):
        _, made[tenant] = tokens.create(data_dir / "tokens.json", tenant)
    return Gw(Up(data_dir, *extra, env=env).start(), made)


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gw]:
    running = start_gateway_up(tmp_path_factory.mktemp("gw") / "data")
    try:
        yield running
    finally:
        running.up.stop()


@pytest.fixture
async def acme(gw: Gw) -> AsyncIterator[httpx.AsyncClient]:
    async with gw.http("acme") as client:
        yield client


@pytest.fixture
async def globex(gw: Gw) -> AsyncIterator[httpx.AsyncClient]:
    async with gw.http("globex") as client:
        yield client


async def running_sandbox(http: httpx.AsyncClient, *, wait: float = 60.0) -> str:
    """Create a sandbox over HTTP and wait (on its event stream) until it runs."""
    created = await http.post("/api/v1/sandboxes")
    assert created.status_code == 201, created.text
    sandbox_id = created.json()["id"]
    async for event in sse_events(http, sandbox_id, timeout=wait):
        if event["type"] == "sandbox.started":
            return sandbox_id
        assert event["type"] != "sandbox.start_failed", event
    raise AssertionError("the event stream ended")


async def sse_events(
    http: httpx.AsyncClient,
    sandbox_id: str,
    *,
    last_event_id: int | None = None,
    timeout: float = 30.0,
    path: str | None = None,
    comments: list[str] | None = None,
):
    """Yield each event's `data` (with `seq` = its `id:`) from the SSE stream."""
    headers = {} if last_event_id is None else {"Last-Event-ID": str(last_event_id)}
    url = path or f"/api/v1/sandboxes/{sandbox_id}/events"
    async with http.stream(
        "GET", url, headers=headers, timeout=httpx.Timeout(timeout, connect=10)
    ) as response:
        async for fields in sse_frames(response, comments=comments):
            data = json.loads(fields["data"])
            assert int(fields["id"]) == data["seq"] and fields["event"] == data["type"]
            yield data


async def sse_frames(response: httpx.Response, *, comments: list[str] | None = None):
    """Each SSE frame with data of a streamed answer, as its fields (`id`,
    `event`, `data`); comment lines go to `comments` when given."""
    assert response.status_code == 200, await response.aread()
    assert response.headers["content-type"].startswith("text/event-stream")
    fields: dict[str, str] = {}
    async for line in response.aiter_lines():
        if line.startswith(":"):
            if comments is not None:
                comments.append(line)
            continue
        if line:
            name, _, value = line.partition(":")
            fields[name] = value.removeprefix(" ")
            continue
        if "data" in fields:
            yield fields
        fields = {}


def problem(response: httpx.Response, status: int, code: str) -> dict:
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["content-type"] == "application/problem+json", response.headers
    body = msgspec.json.decode(response.content)
    assert body["code"] == code and body["status"] == status, body
    assert body["type"] == f"urn:sandhold:problem:{code}" and body["title"]
    return body


@contextlib.asynccontextmanager
async def nats_client(gw: Gw, tenant: str, *, admin: bool = False):
    """A client of `tenant` as the operator, or as the admin for tests that look
    at what only the admin may (the gateway's consumers)."""
    from sandhold.client import connect

    client = await connect(gw.up.admin_url if admin else gw.up.url, tenant=tenant)
    try:
        yield client
    finally:
        await client.close()
