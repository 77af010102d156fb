"""The OpenAPI document (valid, complete, fuzzed), SSE keep-alives, and a slow
SSE client that must not make the gateway buffer the log. Against a
`sandhold up --hosts 0`: nothing is placed, so sandboxes stay pending."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import jsonschema_rs
import pytest
from sandhold.bus.append import last_sequence
from sandhold.domain import requests as rq
from sandhold.gateway.openapi import document

from tests.gateway.conftest import Gw, nats_client, sse_events, start_gateway_up
from tests.support.waiting import wait_until

ST = str(Path(sys.executable).parent / "st")


@pytest.fixture(scope="module")
def gw0(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gw]:
    data = tmp_path_factory.mktemp("gw0") / "data"
    running = start_gateway_up(data, "--hosts", "0", env={"SANDHOLD_SSE_KEEPALIVE": "0.3"})
    try:
        yield running
    finally:
        running.up.stop()


def test_the_openapi_document_is_valid_and_lists_every_route():
    from schemathesis.specs.openapi.definitions import OPENAPI_31_VALIDATOR

    doc = document()
    errors = [e.message for e in OPENAPI_31_VALIDATOR.iter_errors(doc)]
    assert errors == []
    for name, schema in doc["components"]["schemas"].items():
        assert jsonschema_rs.meta.is_valid(schema), name

    from sandhold.gateway.app import create_app

    class _NoBus:  # the app is only built to list its routes; nothing is served
        def jetstream(self) -> None:
            return None

    from sandhold.bus.names import Names
    from sandhold.gateway.web import Context

    app = create_app(Context(_NoBus(), Names("sh"), None, None))  # type: ignore[arg-type]
    served = {
        (method.lower(), route.path.replace(":str}", "}"))
        for route in app.routes
        for method in getattr(route, "methods", ())
        if method not in ("OPTIONS", "HEAD") and route.path.startswith("/api/")
    }
    documented = {(m, p) for p, ops in doc["paths"].items() for m in ops}
    assert served == documented


def test_the_schema_fuzzer_with_every_check_finds_no_mismatch(gw0: Gw, tmp_path: Path):
    """`schemathesis run --checks all`, stateful phase included (it follows the
    document's links from each create), against a live gateway: every request
    the document allows is answered as the document says."""
    (tmp_path / "schemathesis.toml").write_text(
        # A body over the 1 MB limit is refused before it is parsed: 413 is a rejection too.
        "[checks.negative_data_rejection]\n"
        'expected-statuses = ["400", "401", "403", "404", "405", "409", "413", "415", "422"]\n'
    )
    done = subprocess.run(
        [
            ST,
            "run",
            f"{gw0.url}/openapi.json",
            "-H",
            f"Authorization: Bearer {gw0.tokens['acme']}",
            "--checks",
            "all",
            # A deleted sandbox stays readable (phase `deleted`, its history and
            # saves: decision 025), so a read after DELETE answers 200 by design.
            "--exclude-checks",
            "use_after_free",
            "--exclude-path-regex",
            "/events$",  # endless streams; covered by their own tests
            "--max-examples",
            "10",
            "--workers",
            "1",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={
            **os.environ,
            "SCHEMATHESIS_HOOKS": "tests.support.schemathesis_hooks",
            "PYTHONPATH": str(Path(__file__).parents[2]),  # the repository, for `tests.`
        },
        timeout=110,
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert "✅  Stateful" in done.stdout, done.stdout[-3000:]  # it ran, and passed
    generated, passed = re.search(r"(\d+) generated, (\d+) passed", done.stdout).groups()
    assert int(generated) > 1000 and generated == passed, done.stdout[-3000:]


async def _waiting_for_a_host(http, sandbox_id: str) -> None:
    """Here no host is registered: once the scheduler said so, nothing more comes."""

    async def said() -> bool:
        shown = (await http.get(f"/api/v1/sandboxes/{sandbox_id}")).json()
        return shown["reason"] == "no host is registered"

    await wait_until(said, timeout=30, what="the sandbox waiting for a host")


async def test_an_idle_stream_gets_keep_alive_comments(gw0: Gw):
    async with gw0.http() as http:
        sandbox_id = (await http.post("/api/v1/sandboxes")).json()["id"]
        await _waiting_for_a_host(http, sandbox_id)
        comments: list[str] = []
        stream = sse_events(http, sandbox_id, comments=comments)
        assert (await anext(stream))["type"] == "sandbox.created"
        assert (await anext(stream))["type"] == "sandbox.waiting"
        reader = asyncio.ensure_future(anext(stream))  # nothing more will come
        await wait_until(lambda: ": keep-alive" in comments, timeout=10, what="a keep-alive")
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
            await reader
        await stream.aclose()


async def test_a_client_that_does_not_read_does_not_make_the_gateway_buffer(gw0: Gw):
    """The gateway pulls the next batch only once the last one was written, so a
    stalled client stalls its consumer instead of filling the gateway's memory."""
    async with gw0.http() as http:
        sandbox_id = (await http.post("/api/v1/sandboxes")).json()["id"]
    subject_events = 120  # ~60 KB each: more than every buffer on the way
    async with nats_client(gw0, "acme", admin=True) as client:  # it reads the consumers
        # the backlog is in the log before the client asks for it
        for start in range(0, subject_events, 20):
            await asyncio.gather(
                *(
                    client.send(
                        rq.RunCommand(
                            key=f"big-{i}",
                            tenant="acme",
                            sandbox_id=sandbox_id,
                            argv=["echo", str(i % 10) * 60_000],
                        )
                    )
                    for i in range(start, start + 20)
                )
            )
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        host, port = gw0.url.removeprefix("http://").split(":")
        sock.connect((host, int(port)))
        try:
            sock.sendall(
                f"GET /api/v1/sandboxes/{sandbox_id}/events HTTP/1.1\r\nHost: {host}\r\n"
                f"Authorization: Bearer {gw0.tokens['acme']}\r\n\r\n".encode()
            )
            head = sock.recv(1024)
            assert head.startswith(b"HTTP/1.1 200"), head
            subject = client.names.events("sandbox", sandbox_id)
            last = await last_sequence(client.js, client.names.events_stream, subject)

            async def delivered() -> int:
                for info in await client.js.consumers_info(client.names.events_stream):
                    if info.config.filter_subject == subject:
                        return info.delivered.stream_seq
                return 0

            # wait until the gateway stops pulling (its consumer stalls behind the client)
            seen: list[int] = []

            async def settled() -> bool:
                seen.append(await delivered())
                return len(seen) > 10 and seen[-1] == seen[-10] and seen[-1] > 0

            await wait_until(settled, timeout=30, interval=0.1, what="the consumer to stall")
            assert seen[-1] < last, "the gateway pulled the whole backlog for a stalled client"

            # once the client reads again, the stream goes on where it stalled...
            sock.setblocking(False)
            loop = asyncio.get_running_loop()
            received = b""
            deadline = time.monotonic() + 30
            while len(received) < 512 * 1024:
                assert time.monotonic() < deadline, "the stream did not go on"
                received += await loop.sock_recv(sock, 1 << 20)
        finally:
            sock.close()
    frames = received.split(b"\n\n")[:-1]  # complete frames only
    ids = [
        int(line[4:])
        for frame in frames
        for line in frame.decode(errors="replace").splitlines()
        if line.startswith("id: ")
    ]
    # ... and a reconnect with Last-Event-ID gets the rest
    async with gw0.http() as http:
        async for event in sse_events(http, sandbox_id, last_event_id=ids[-1], timeout=60):
            ids.append(event["seq"])
            if event["seq"] == last:
                break
    async with nats_client(gw0, "acme") as client:
        from sandhold.bus.read import read_subject

        logged = [r.seq for r in await read_subject(client.js, client.names.events_stream, subject)]
    assert ids == logged


async def test_a_json_client_gets_the_events_as_pages_that_wait_for_the_next(gw0: Gw):
    """`Accept: application/json` on an events path: one page, then the next
    after it, which waits (`?wait=`) for an event to come."""
    json_only = {"Accept": "application/json"}
    async with gw0.http() as http:
        sandbox_id = (await http.post("/api/v1/sandboxes")).json()["id"]
        await _waiting_for_a_host(http, sandbox_id)
        path = f"/api/v1/sandboxes/{sandbox_id}/events"
        first = await http.get(path, headers=json_only)
        assert first.status_code == 200 and first.headers["content-type"] == "application/json"
        page = first.json()
        assert [e["type"] for e in page["events"]] == ["sandbox.created", "sandbox.waiting"]
        last = page["last_event_id"]
        assert last == page["events"][-1]["seq"]
        # Nothing after it: an empty page, the same point back.
        empty = (await http.get(f"{path}?after={last}", headers=json_only)).json()
        assert empty == {"events": [], "last_event_id": last}
        # A page asked to wait is answered by the next event, whether it comes
        # while the page waits or just before (never by an empty page first).
        waiting = asyncio.ensure_future(http.get(f"{path}?after={last}&wait=30", headers=json_only))
        assert (await http.delete(f"/api/v1/sandboxes/{sandbox_id}")).status_code == 202
        later = (await asyncio.wait_for(waiting, 40)).json()
        assert later["events"] and all(e["seq"] > last for e in later["events"])
        # (the page holds what had come when it was answered: the delete's first event)
        assert later["events"][0]["type"] == "sandbox.delete_requested"
        bad = await http.get(f"{path}?wait=31", headers=json_only)
        assert bad.status_code == 400 and bad.json()["code"] == "invalid_parameter"
        # An EventSource (text/event-stream) still gets the stream.
        async with http.stream("GET", path, headers={"Accept": "text/event-stream"}) as stream:
            assert stream.headers["content-type"].startswith("text/event-stream")
