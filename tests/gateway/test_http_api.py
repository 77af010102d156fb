"""The HTTP API through a real `sandhold up`: idempotency, tenancy, bad input."""

from __future__ import annotations

import os
import signal

import httpx
import msgspec

from tests.gateway.conftest import Gw, problem, running_sandbox, sse_events
from tests.support.waiting import wait_until

RUN = {"argv": ["sh", "-c", "echo out; echo err >&2; exit 3"]}


async def _ended(http: httpx.AsyncClient, sandbox_id: str, command_id: str) -> dict:
    async def check():
        shown = (await http.get(f"/api/v1/sandboxes/{sandbox_id}/commands/{command_id}")).json()
        return shown if shown["ended_at"] is not None else None

    return await wait_until(check, timeout=30, what=f"{command_id} to end")


async def test_idempotency_key_over_http(acme: httpx.AsyncClient):
    sandbox_id = await running_sandbox(acme)
    commands = f"/api/v1/sandboxes/{sandbox_id}/commands"
    first = await acme.post(commands, json=RUN, headers={"Idempotency-Key": "run-once"})
    again = await acme.post(commands, json=RUN, headers={"Idempotency-Key": "run-once"})
    assert first.status_code == again.status_code == 202
    assert first.json()["id"] == again.json()["id"]
    assert first.headers["location"] == f"{commands}/{first.json()['id']}"
    listed = (await acme.get(commands)).json()["items"]
    assert [c["id"] for c in listed] == [first.json()["id"]]  # one command, not two

    other_body = {"argv": ["sh", "-c", "exit 0"]}
    conflict = await acme.post(commands, json=other_body, headers={"Idempotency-Key": "run-once"})
    body = problem(conflict, 409, "idempotency_conflict")
    assert "run-once" in body["detail"]
    assert len((await acme.get(commands)).json()["items"]) == 1

    ended = await _ended(acme, sandbox_id, first.json()["id"])
    assert (ended["state"], ended["exit_code"]) == ("exited", 3)
    output = (await acme.get(f"{commands}/{ended['id']}/output")).json()
    assert (output["stdout"], output["stderr"], output["encoding"]) == ("out\n", "err\n", "utf-8")
    assert output["complete"] and output["missing_bytes"] == {"stdout": 0, "stderr": 0}

    # the same key on create: one sandbox
    a = await acme.post("/api/v1/sandboxes", headers={"Idempotency-Key": "one-box"})
    b = await acme.post("/api/v1/sandboxes", headers={"Idempotency-Key": "one-box"})
    assert a.json()["id"] == b.json()["id"]
    c = await acme.post(
        "/api/v1/sandboxes", json={"save_interval_s": 60}, headers={"Idempotency-Key": "one-box"}
    )
    problem(c, 409, "idempotency_conflict")
    await acme.delete(f"/api/v1/sandboxes/{a.json()['id']}")


async def test_a_token_sees_only_its_tenant(
    gw: Gw, acme: httpx.AsyncClient, globex: httpx.AsyncClient
):
    sandbox_id = await running_sandbox(acme)
    base = f"/api/v1/sandboxes/{sandbox_id}"
    run = await acme.post(f"{base}/commands", json=RUN)
    command_id = run.json()["id"]
    await _ended(acme, sandbox_id, command_id)
    snap = await acme.post(f"{base}/snapshots", json={"name": "mine"})
    assert snap.status_code == 202, snap.text
    save_id = snap.json()["id"]
    missing = "sb-0123456789abcdef"

    # Every endpoint answers the other tenant exactly as for a sandbox that does not exist.
    requests = [
        ("GET", "{base}", None),
        ("GET", "{base}/commands", None),
        ("GET", "{base}/commands/{command_id}", None),
        ("GET", "{base}/commands/{command_id}/output", None),
        ("POST", "{base}/commands/{command_id}/cancel", None),
        ("POST", "{base}/commands", RUN),
        ("GET", "{base}/saves", None),
        ("GET", "{base}/snapshots", None),
        ("GET", "{base}/saves/{save_id}", None),
        ("POST", "{base}/snapshots", {"name": "theirs"}),
        ("DELETE", "{base}/snapshots/{save_id}", None),
        ("POST", "{base}/start", None),
        ("POST", "{base}/stop", None),
        ("DELETE", "{base}", None),
        ("GET", "{base}/events", None),
    ]
    for method, template, body in requests:
        answers = []
        for target in (base, f"/api/v1/sandboxes/{missing}"):
            path = template.format(base=target, command_id=command_id, save_id=save_id)
            response = await globex.request(method, path, json=body)
            answers.append(problem(response, 404, "sandbox_not_found"))
        theirs, nobodys = answers
        assert theirs["detail"].replace(sandbox_id, missing) == nobodys["detail"], (method, path)

    snapshots = (await acme.get(f"{base}/snapshots")).json()["items"]
    assert [(s["id"], s["name"]) for s in snapshots] == [(save_id, "mine")]
    # Its owner deletes it (decision 069): a save like the others from then on.
    gone = await acme.delete(f"{base}/snapshots/{save_id}", headers={"Idempotency-Key": "un"})
    assert gone.status_code == 200, gone.text
    assert (gone.json()["id"], gone.json()["kind"], gone.json()["name"]) == (
        save_id, "scheduled", None
    )  # fmt: skip
    assert (await acme.get(f"{base}/snapshots")).json()["items"] == []
    assert (await acme.get(f"{base}/saves/{save_id}")).json()["kind"] == "scheduled"
    again = await acme.delete(f"{base}/snapshots/{save_id}", headers={"Idempotency-Key": "un"})
    assert again.status_code == 200 and again.json()["id"] == save_id
    problem(await acme.delete(f"{base}/snapshots/{save_id}"), 404, "snapshot_not_found")

    listed = (await globex.get("/api/v1/sandboxes", params={"include_deleted": "true"})).json()
    assert sandbox_id not in [s["id"] for s in listed["items"]]
    assert sandbox_id in [s["id"] for s in (await acme.get("/api/v1/sandboxes")).json()["items"]]

    # ... and over NATS the tenant in the request is held to the same rule
    from tests.gateway.conftest import nats_client

    async with nats_client(gw, "globex") as intruder:
        from sandhold.domain.errors import Rejected

        for attempt in (
            intruder.show_sandbox(sandbox_id),
            intruder.stop_sandbox(sandbox_id),
            intruder.read_output(sandbox_id, command_id),
        ):
            try:
                await attempt
            except Rejected as err:
                assert err.code == "sandbox_not_found"
            else:
                raise AssertionError("another tenant's sandbox answered")

    # nothing the other tenant tried changed it
    shown = (await acme.get(base)).json()
    assert shown["phase"] == "running" and shown["commands"] == {"exited": 1}
    stopped = await acme.post(f"{base}/stop", params={"wait": 60})
    outcome = stopped.json()
    assert outcome["stopped"] and outcome["settled"], outcome
    assert outcome["final_save"]["state"] == "completed"


async def test_bad_input_is_a_problem_naming_the_field_and_changes_nothing(
    gw: Gw, acme: httpx.AsyncClient
):
    async def ids(path: str) -> list[str]:
        return [item["id"] for item in (await acme.get(path)).json()["items"]]

    before = await ids("/api/v1/sandboxes")

    problem(await acme.post("/api/v1/sandboxes", content=b"{not json"), 400, "malformed_body")
    # No body at all takes the defaults; whitespace alone is not a body (the fuzzer's case).
    problem(await acme.post("/api/v1/sandboxes", content=b"\n\n"), 400, "malformed_body")
    for body, field in (
        ({"memory_limit_bytes": "lots"}, "$.memory_limit_bytes"),
        ({"memory_limit_bytes": 1}, "$.memory_limit_bytes"),
        ({"tenant": "globex"}, "$.tenant"),  # the tenant comes from the token only
        ({"recovery": "sometimes"}, "$.recovery"),
        ({"idle_timeout_s": -5}, "$.idle_timeout_s"),
        ({"keep_stopped_s": -5}, "$.keep_stopped_s"),
        ({"keep_stopped_s": "7d"}, "$.keep_stopped_s"),
        ({"from_snapshot": "not-an-id"}, "$.from_snapshot"),
        ({"seed": "sv-0123456789abcdef"}, "$.seed"),  # the orchestrator's, not the API's
    ):
        got = problem(await acme.post("/api/v1/sandboxes", json=body), 422, "invalid_request")
        assert got["errors"][0]["field"] == field, got
    problem(
        await acme.post(
            "/api/v1/sandboxes", content=b"memory=1", headers={"Content-Type": "text/plain"}
        ),
        415,
        "unsupported_media_type",
    )
    problem(
        await acme.post("/api/v1/sandboxes", headers={"Idempotency-Key": "has space"}),
        400,
        "invalid_header",
    )
    assert await ids("/api/v1/sandboxes") == before

    sandbox_id = before[0] if before else (await acme.post("/api/v1/sandboxes")).json()["id"]
    base = f"/api/v1/sandboxes/{sandbox_id}"
    commands_before = await ids(f"{base}/commands")
    for body, field in (
        ({}, "$.argv"),
        ({"argv": []}, "$.argv"),
        ({"argv": ["true"], "timeout_s": -1}, "$.timeout_s"),
        ({"argv": ["true"], "env": {"A": 1}}, "$.env[...]"),
        ({"argv": ["true"], "sandbox_id": sandbox_id}, "$.sandbox_id"),
        ({"argv": ["true"], "secrets": {"1X": "v"}}, "$.secrets"),
        ({"argv": ["true"], "secrets": {"T": 1}}, "$.secrets[...]"),
        ({"argv": ["true"], "env": {"T": "a"}, "secrets": {"T": "b"}}, "$"),
    ):
        got = problem(await acme.post(f"{base}/commands", json=body), 422, "invalid_request")
        assert got["errors"][0]["field"] == field, got
    problem(await acme.post(f"{base}/commands", content=b"[1,"), 400, "malformed_body")
    assert await ids(f"{base}/commands") == commands_before
    for body, field in (({}, "$.name"), ({"name": "no spaces please"}, "$.name")):
        got = problem(await acme.post(f"{base}/snapshots", json=body), 422, "invalid_request")
        assert got["errors"][0]["field"] == field
    snapshots_before = await ids(f"{base}/saves")
    problem(await acme.delete(f"{base}/snapshots/not-an-id"), 404, "snapshot_not_found")
    problem(await acme.delete(f"{base}/snapshots/sv-0123456789abcdef"), 404, "snapshot_not_found")
    problem(
        await acme.delete(
            f"{base}/snapshots/sv-0123456789abcdef", headers={"Idempotency-Key": "has space"}
        ),
        400,
        "invalid_header",
    )
    problem(
        await acme.delete("/api/v1/sandboxes/not-an-id/snapshots/sv-0123456789abcdef"),
        404,
        "sandbox_not_found",
    )
    assert await ids(f"{base}/saves") == snapshots_before
    problem(await acme.get(f"{base}/commands", params={"state": "bogus"}), 400, "invalid_parameter")
    problem(await acme.get("/api/v1/sandboxes", params={"limit": "0"}), 400, "invalid_parameter")
    problem(await acme.get("/api/v1/sandboxes", params={"cursor": "%%"}), 400, "invalid_parameter")
    problem(await acme.post(f"{base}/stop", params={"wait": "soon"}), 400, "invalid_parameter")
    problem(await acme.post("/api/v1/sandboxes/not-an-id/touch"), 404, "sandbox_not_found")
    problem(
        await acme.post(f"{base}/touch", headers={"Idempotency-Key": "has space"}),
        400,
        "invalid_header",
    )
    problem(
        await acme.get(f"{base}/events", headers={"Last-Event-ID": "yesterday"}),
        400,
        "invalid_header",
    )
    problem(await acme.get("/api/v1/sandboxes/not-an-id"), 404, "sandbox_not_found")
    problem(await acme.get(f"{base}/commands/cmd-0000000000000000"), 404, "command_not_found")
    problem(await acme.get("/api/v1/nothing-here"), 404, "not_found")
    problem(await acme.put("/api/v1/sandboxes"), 405, "method_not_allowed")

    async with httpx.AsyncClient(base_url=gw.url) as anonymous:
        for headers in ({}, {"Authorization": "Bearer sht_not-a-token"}, {"Authorization": "x"}):
            response = await anonymous.get("/api/v1/sandboxes", headers=headers)
            problem(response, 401, "unauthorized")
            assert response.headers["www-authenticate"].startswith("Bearer")


async def test_lists_paginate_and_filter(acme: httpx.AsyncClient, globex: httpx.AsyncClient):
    # globex has a sandbox-free slate of its own to count on
    made = []
    for i in range(3):
        r = await globex.post("/api/v1/sandboxes", headers={"Idempotency-Key": f"page-{i}"})
        made.append(r.json()["id"])
    seen: list[str] = []
    cursor = None
    while True:
        params = {"limit": 2, **({"cursor": cursor} if cursor else {})}
        page = (await globex.get("/api/v1/sandboxes", params=params)).json()
        assert len(page["items"]) <= 2
        seen += [s["id"] for s in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert len(seen) == len(set(seen)) and set(made) <= set(seen)
    await globex.delete(f"/api/v1/sandboxes/{made[0]}")

    async def gone():
        listed = (await globex.get("/api/v1/sandboxes")).json()["items"]
        return made[0] not in [s["id"] for s in listed]

    await wait_until(gone, timeout=30, what="the deleted sandbox to leave the list")
    deleted = (await globex.get("/api/v1/sandboxes", params={"phase": "deleted"})).json()
    assert made[0] in [s["id"] for s in deleted["items"]]
    for sandbox_id in made[1:]:
        await globex.delete(f"/api/v1/sandboxes/{sandbox_id}")

    hosts = (await acme.get("/api/v1/hosts")).json()["items"]
    assert [h["host"] for h in hosts] == ["local"] and hosts[0]["status"] == "live"


async def test_events_of_a_new_sandbox_stream_in_order(acme: httpx.AsyncClient):
    created = (await acme.post("/api/v1/sandboxes")).json()
    types = []
    async for event in sse_events(acme, created["id"]):
        types.append(event["type"])
        assert event["aggregate_id"] == created["id"]
        if event["type"] == "sandbox.started":
            break
    assert types == ["sandbox.created", "sandbox.placed", "sandbox.starting", "sandbox.started"]
    await acme.delete(f"/api/v1/sandboxes/{created['id']}")


async def test_without_the_bus_requests_are_503_problems(tmp_path):
    from tests.gateway.conftest import start_gateway_up

    gw = start_gateway_up(tmp_path / "data", "--hosts", "0")
    try:
        async with gw.http() as http:
            assert (await http.get("/api/v1/sandboxes")).status_code == 200
            # `up` starts a dead server again: paused, it cannot, and the bus stays gone.
            assert gw.up.process is not None
            os.kill(gw.up.process.pid, signal.SIGSTOP)
            try:
                os.kill(gw.up.runtime["nats_pid"], signal.SIGKILL)
                for method, path in (("POST", "/api/v1/sandboxes"), ("GET", "/api/v1/sandboxes")):
                    answer = await http.request(method, path, timeout=60)
                    assert problem(answer, 503, "unavailable")["retryable"] is True
            finally:
                os.kill(gw.up.process.pid, signal.SIGCONT)
    finally:
        gw.up.stop()


async def test_tokens_made_and_revoked_with_the_cli_take_effect_at_once(gw: Gw):
    made = gw.up.cli("token", "create", "--tenant", "initech", "--name", "ci")
    assert made.returncode == 0, made.stderr
    token = made.stdout.strip()
    assert token.startswith("sht_") and "shown once" in made.stderr
    assert token not in (gw.up.data_dir / "tokens.json").read_text()  # only its hash is kept
    listed = msgspec.json.decode(gw.up.cli("token", "ls", "--json").stdout)
    assert {"name": "ci", "tenant": "initech"} in listed
    assert gw.up.cli("token", "create", "--tenant", "initech", "--name", "ci").returncode == 2
    assert gw.up.cli("token", "create", "--tenant", "no spaces").returncode == 2

    async with httpx.AsyncClient(base_url=gw.url) as http:
        auth = {"Authorization": f"Bearer {token}"}
        created = await http.post("/api/v1/sandboxes", headers=auth)
        assert created.status_code == 201 and created.json()["tenant"] == "initech"
        assert gw.up.cli("token", "revoke", "ci").returncode == 0
        problem(await http.get("/api/v1/sandboxes", headers=auth), 401, "unauthorized")
    assert gw.up.cli("token", "revoke", "ci").returncode == 2
