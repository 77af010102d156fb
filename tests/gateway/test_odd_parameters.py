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


def _old_style(parts: object) -> str:
    return base64.urlsafe_b64encode(msgspec.json.encode(parts)).decode().rstrip("=")


async def test_a_cursor_without_the_shape_of_one_is_a_bad_parameter(acme: httpx.AsyncClient):
    for cursor in ("", "%%", _old_style([1.0, "sb-1"]), "1.5~sb-1", "x~sb-0123456789abcdef",
                   "1e9~sb-0123456789abcdef", "1.0~sb-0123456789abcdef~"):  # fmt: skip
        for path in ("/api/v1/sandboxes", "/api/v1/tasks"):
            problem(await acme.get(path, params={"cursor": cursor}), 400, "invalid_parameter")


async def test_any_cursor_of_the_right_shape_is_the_page_after_that_point(
    acme: httpx.AsyncClient,
):
    made = [(await acme.post("/api/v1/sandboxes")).json() for _ in range(3)]
    first = (await acme.get("/api/v1/sandboxes", params={"limit": 1})).json()
    assert first["next_cursor"] is not None
    # Client-made: a point in the list, not a secret. Before everything: all of it.
    everything = await acme.get("/api/v1/sandboxes", params={"cursor": "0.0~sb-0000000000000000"})
    assert {s["id"] for s in made} <= {s["id"] for s in everything.json()["items"]}
    # After everything: nothing, and no error.
    nothing = await acme.get(
        "/api/v1/sandboxes", params={"cursor": "999999999999.0~sb-ffffffffffffffff"}
    )
    assert nothing.status_code == 200 and nothing.json()["items"] == []
    tasks = await acme.get("/api/v1/tasks", params={"cursor": "1.5~tk-0123456789abcdef"})
    assert tasks.status_code == 200


async def test_an_integral_number_is_an_integer(acme: httpx.AsyncClient):
    """JSON has one number type: 64.0 is the integer 64, as JSON Schema says."""
    created = await acme.post("/api/v1/sandboxes", json={"pids_limit": 64.0, "cpu_limit": 2})
    assert created.status_code == 201, created.text
    assert (created.json()["pids_limit"], created.json()["cpu_limit"]) == (64, 2.0)
    refused = await acme.post("/api/v1/sandboxes", json={"pids_limit": 64.5})
    problem(refused, 422, "invalid_request")


async def test_every_resume_point_given_must_be_a_sequence(acme: httpx.AsyncClient):
    events = f"/api/v1/sandboxes/{MISSING}/events"
    got = await acme.get(events, headers={"Last-Event-ID": "0"}, params={"after": "-1"})
    problem(got, 400, "invalid_header")
