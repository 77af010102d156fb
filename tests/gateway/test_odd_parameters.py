"""Parameters that look almost right are 400 problems, never 500s."""

from __future__ import annotations

import base64

import httpx
import msgspec

from tests.gateway.conftest import problem

MISSING = "sb-0123456789abcdef"


async def test_non_ascii_digits_are_not_numbers(acme: httpx.AsyncClient):
    # str.isdigit() is true for '²' (U+00B2, a Latin-1 byte a header can carry), int() refuses it.
    events = f"/api/v1/sandboxes/{MISSING}/events"
    problem(await acme.get(events, headers={"Last-Event-ID": b"\xb2"}), 400, "invalid_header")
    problem(await acme.get(events, params={"after": "٣"}), 400, "invalid_header")
    problem(await acme.get("/api/v1/sandboxes", params={"limit": "²"}), 400, "invalid_parameter")
    problem(
        await acme.post(f"/api/v1/sandboxes/{MISSING}/stop", params={"wait": "١"}),
        400,
        "invalid_parameter",
    )


def _cursor(parts: object) -> str:
    return base64.urlsafe_b64encode(msgspec.json.encode(parts)).decode().rstrip("=")


async def test_a_forged_cursor_is_a_bad_parameter(acme: httpx.AsyncClient):
    for parts in ([{}, "sb-1"], [[1], "x"], [10**30, "x"], [1.0, None], [True, "x"]):
        got = await acme.get("/api/v1/sandboxes", params={"cursor": _cursor(parts)})
        problem(got, 400, "invalid_parameter")
        got = await acme.get("/api/v1/tasks", params={"cursor": _cursor(parts)})
        problem(got, 400, "invalid_parameter")
