"""Connections over HTTP (decision 031): PUT and DELETE
/api/v1/sandboxes/{id}/connections/{name}, through a real `sandhold up`."""

from __future__ import annotations

import uuid

import httpx

from tests.gateway.conftest import problem, running_sandbox
from tests.support.waiting import wait_until


async def _run(http: httpx.AsyncClient, sandbox_id: str, script: str) -> str:
    commands = f"/api/v1/sandboxes/{sandbox_id}/commands"
    command = (await http.post(commands, json={"argv": ["sh", "-c", script]})).json()

    async def ended() -> bool:
        shown = (await http.get(f"{commands}/{command['id']}")).json()
        return shown["ended_at"] is not None

    await wait_until(ended, timeout=30, what=f"{command['id']} to end")
    return (await http.get(f"{commands}/{command['id']}/output")).json()["stdout"]


async def test_a_connection_set_over_http_is_a_file_inside_and_never_in_a_response(
    acme: httpx.AsyncClient, globex: httpx.AsyncClient
):
    sandbox_id = await running_sandbox(acme)
    path = f"/api/v1/sandboxes/{sandbox_id}/connections/registry"
    value = f"tok-{uuid.uuid4().hex}"
    key = {"Idempotency-Key": f"c-{uuid.uuid4().hex}"}
    put = await acme.put(path, json={"value": value}, headers=key)
    assert put.status_code == 200, put.text
    assert put.json()["connections"] == ["registry"] and value not in put.text
    again = await acme.put(path, json={"value": value}, headers=key)
    assert again.status_code == 200 and again.json()["connections"] == ["registry"]
    assert await _run(acme, sandbox_id, "cat /run/connections/registry") == value
    events = await acme.get(
        f"/api/v1/sandboxes/{sandbox_id}/events", headers={"Accept": "application/json"}
    )
    assert "connection.set" in events.text and value not in events.text

    # Another tenant's token: the same 404 as for a sandbox that does not exist.
    problem(await globex.put(path, json={"value": "x"}), 404, "sandbox_not_found")
    problem(await globex.delete(path), 404, "sandbox_not_found")

    gone = await acme.delete(path)
    assert gone.status_code == 200 and gone.json()["connections"] == []
    assert await _run(acme, sandbox_id, "ls -A /run/connections") == ""
    problem(await acme.delete(path), 404, "connection_not_found")


async def test_bad_connection_input_is_a_problem_and_changes_nothing(acme: httpx.AsyncClient):
    sandbox_id = await running_sandbox(acme)
    base = f"/api/v1/sandboxes/{sandbox_id}/connections"
    cases = [
        (f"{base}/ok", b"not json", 400, "malformed_body"),
        (f"{base}/ok", b'{"value": 7}', 422, "invalid_request"),
        (f"{base}/ok", b'{"value": "v", "extra": 1}', 422, "invalid_request"),
        (f"{base}/ok", b"{}", 422, "invalid_request"),
        (f"{base}/.hidden", b'{"value": "v"}', 422, "invalid_request"),
        (f"{base}/{'x' * 65}", b'{"value": "v"}', 422, "invalid_request"),
        ("/api/v1/sandboxes/sb-nope/connections/ok", b'{"value": "v"}', 404, "sandbox_not_found"),
    ]
    for url, body, status, code in cases:
        sent = await acme.put(url, content=body, headers={"Content-Type": "application/json"})
        problem(sent, status, code)
    shown = (await acme.get(f"/api/v1/sandboxes/{sandbox_id}")).json()
    assert shown["connections"] == []
