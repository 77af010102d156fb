"""A command's output as Server-Sent Events (`GET .../output` with `Accept:
text/event-stream`): what was kept, live, then one `end` frame; a reconnect
with Last-Event-ID resumes after it, with nothing repeated or skipped."""

from __future__ import annotations

import base64
import json

import httpx

from tests.gateway.conftest import Gw, problem, running_sandbox, sse_frames

SSE = {"Accept": "text/event-stream"}


async def output_frames(
    http: httpx.AsyncClient, path: str, *, last_event_id: int | None = None, timeout: float = 60
) -> list[tuple[str, dict, int | None]]:
    """Every frame until the stream closes: (event, data, id)."""
    headers = dict(SSE)
    if last_event_id is not None:
        headers["Last-Event-ID"] = str(last_event_id)
    frames: list[tuple[str, dict, int | None]] = []
    async with http.stream(
        "GET", path, headers=headers, timeout=httpx.Timeout(timeout, connect=10)
    ) as response:
        async for fields in sse_frames(response):
            seq = int(fields["id"]) if "id" in fields else None
            frames.append((fields["event"], json.loads(fields["data"]), seq))
    return frames


def stdout_of(frames: list[tuple[str, dict, int | None]]) -> bytes:
    out = bytearray()
    for event, data, _ in frames:
        if event == "output" and data["stream"] == "stdout":
            assert data["offset"] == len(out), "a gap or a repeat"
            out += base64.b64decode(data["data"])
    return bytes(out)


async def test_output_streams_live_then_ends_and_resumes_after_a_reconnect(
    acme: httpx.AsyncClient,
) -> None:
    sandbox_id = await running_sandbox(acme)
    script = "for i in 1 2 3 4 5 6; do echo line $i; sleep 0.2; done; echo oops >&2; exit 4"
    ran = await acme.post(
        f"/api/v1/sandboxes/{sandbox_id}/commands",
        json={"argv": ["sh", "-c", script]},
        headers={"Idempotency-Key": "output-stream-1"},
    )
    assert ran.status_code == 202, ran.text
    path = f"/api/v1/sandboxes/{sandbox_id}/commands/{ran.json()['id']}/output"

    frames = await output_frames(acme, path)  # opened while it runs: closes at its end
    expected = b"".join(b"line %d\n" % i for i in range(1, 7))
    assert stdout_of(frames) == expected
    event, end, seq = frames[-1]
    assert event == "end" and seq is None
    assert end["state"] == "exited" and end["exit_code"] == 4, end
    assert end["output_kept"]["stdout"] == len(expected)
    errors = [f for f in frames if f[0] == "output" and f[1]["stream"] == "stderr"]
    assert b"".join(base64.b64decode(f[1]["data"]) for f in errors) == b"oops\n"

    # Resumed after the first chunk: the rest, each once, then the end again.
    chunks = [f for f in frames if f[0] == "output"]
    first = chunks[0]
    rest = await output_frames(acme, path, last_event_id=first[2])
    assert [f[2] for f in rest if f[0] == "output"] == [f[2] for f in chunks[1:]]
    assert rest[-1][0] == "end"
    # Resumed after everything: only the end.
    assert [f[0] for f in await output_frames(acme, path, last_event_id=chunks[-1][2])] == ["end"]


async def test_output_stream_refuses_bad_input_and_other_tenants(
    gw: Gw, acme: httpx.AsyncClient, globex: httpx.AsyncClient
) -> None:
    sandbox_id = await running_sandbox(acme)
    ran = await acme.post(
        f"/api/v1/sandboxes/{sandbox_id}/commands",
        json={"argv": ["true"]},
        headers={"Idempotency-Key": "output-stream-2"},
    )
    path = f"/api/v1/sandboxes/{sandbox_id}/commands/{ran.json()['id']}/output"
    problem(await globex.get(path, headers=SSE), 404, "sandbox_not_found")
    problem(await acme.get(path, headers={**SSE, "Last-Event-ID": "x1"}), 400, "invalid_header")
    missing = f"/api/v1/sandboxes/{sandbox_id}/commands/cmd-0000000000000000/output"
    problem(await acme.get(missing, headers=SSE), 404, "command_not_found")
    # Without asking for a stream, the JSON answer is as before.
    answer = await acme.get(path)
    assert answer.status_code == 200 and answer.headers["content-type"] == "application/json"
