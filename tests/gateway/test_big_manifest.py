"""A large YAML manifest is parsed off the event loop: the gateway keeps
answering (and streaming) while it is parsed."""

from __future__ import annotations

import asyncio
import time

import httpx

from tests.gateway.conftest import Gw, problem


async def test_parsing_a_big_manifest_does_not_stall_other_requests(gw: Gw):
    # ~1 MB of YAML, under the body cap: seconds of pure-Python parsing.
    body = b"name: big\nbogus:\n" + b"".join(
        b"  k%d: [%d, {a: b}]\n" % (i, i) for i in range(36000)
    )
    assert len(body) < 1_000_000
    async with gw.http("acme") as http, httpx.AsyncClient(base_url=gw.url) as probe:
        started = time.monotonic()
        submit = asyncio.create_task(
            http.post("/api/v1/tasks", content=body, headers={"Content-Type": "application/yaml"})
        )
        worst, answered = 0.0, 0
        while not submit.done():
            t = time.monotonic()
            assert (await probe.get("/healthz", timeout=60)).status_code == 200
            worst = max(worst, time.monotonic() - t)
            answered += 1
            await asyncio.sleep(0.05)
        took = time.monotonic() - started
        problem(await submit, 422, "invalid_request")
    # Relative, so a loaded machine does not decide it: a parse on the event loop
    # makes one probe wait about as long as the whole submission took.
    assert answered >= 2, f"only {answered} probe(s) while the manifest parsed ({took:.2f}s)"
    assert worst < 0.6 * took, f"/healthz waited {worst:.2f}s of the {took:.2f}s parse"
