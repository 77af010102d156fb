"""Tasks over HTTP: a YAML manifest end to end, bad manifests, tenancy."""

from __future__ import annotations

import httpx

from tests.gateway.conftest import problem, sse_events

YAML = b"""\
name: hello-http
agent:
  command: ["sh", "-c", "echo hello from a task"]
timeouts:
  task: 5m
"""


async def test_a_yaml_task_runs_to_completion(acme: httpx.AsyncClient, globex: httpx.AsyncClient):
    submitted = await acme.post(
        "/api/v1/tasks",
        content=YAML,
        headers={"Content-Type": "application/yaml", "Idempotency-Key": "task-1"},
    )
    assert submitted.status_code == 202, submitted.text
    task = submitted.json()
    assert task["name"] == "hello-http" and task["tenant"] == "acme"
    assert submitted.headers["location"] == f"/api/v1/tasks/{task['id']}"
    again = await acme.post(
        "/api/v1/tasks",
        content=YAML,
        headers={"Content-Type": "application/yaml", "Idempotency-Key": "task-1"},
    )
    assert again.json()["id"] == task["id"]

    types = []
    path = f"/api/v1/tasks/{task['id']}/events"
    async for event in sse_events(acme, task["id"], path=path, timeout=120):
        types.append(event["type"])
        if event["type"] in ("task.completed", "task.failed", "task.timed_out"):
            break
    assert types[0] == "task.submitted" and types[-1] == "task.completed", types
    shown = (await acme.get(f"/api/v1/tasks/{task['id']}")).json()
    assert shown["state"] == "completed"
    assert [s["status"] for s in shown["steps"]] == ["finished"]
    assert shown["steps"][0]["output"].strip() == "hello from a task"

    completed = (await acme.get("/api/v1/tasks", params={"state": "completed"})).json()["items"]
    assert task["id"] in [t["id"] for t in completed]
    running = (await acme.get("/api/v1/tasks", params={"state": "running"})).json()["items"]
    assert task["id"] not in [t["id"] for t in running]

    # another tenant: as if it did not exist
    for method, url in (
        ("GET", f"/api/v1/tasks/{task['id']}"),
        ("POST", f"/api/v1/tasks/{task['id']}/cancel"),
        ("GET", f"/api/v1/tasks/{task['id']}/events"),
        ("GET", "/api/v1/tasks/tk-0123456789abcdef"),
    ):
        problem(await globex.request(method, url), 404, "task_not_found")
    assert task["id"] not in [t["id"] for t in (await globex.get("/api/v1/tasks")).json()["items"]]


async def test_a_bad_manifest_is_a_problem_naming_the_field(acme: httpx.AsyncClient):
    before = (await acme.get("/api/v1/tasks")).json()["items"]

    async def submit(body: bytes, content_type: str = "application/yaml") -> httpx.Response:
        return await acme.post(
            "/api/v1/tasks", content=body, headers={"Content-Type": content_type}
        )

    problem(await submit(b"name: [unclosed\n"), 400, "malformed_body")
    problem(await submit(b"{not json", "application/json"), 400, "malformed_body")
    aliases = b"a: &x [1, 2]\nb: *x\n"
    assert "aliases" in problem(await submit(aliases), 400, "malformed_body")["detail"]
    problem(await submit(b"name: x", "text/csv"), 415, "unsupported_media_type")
    for body, field, words in (
        (b"- just\n- a list\n", "$", "object"),
        (b"agent:\n  command: [ls]\n", "$.name", "name"),
        (YAML + b"bogus: 1\n", "$.bogus", "bogus"),
        (YAML.replace(b"task: 5m", b"task: soon"), "$.timeouts", "task"),
        (YAML.replace(b"name: hello-http", b"name: Hello World"), "$.name", "name"),
        (b'{"name": "j", "agent": {"command": []}}', "$.agent.command", "length"),
    ):
        got = problem(await submit(body), 422, "invalid_request")
        assert got["errors"][0]["field"] == field, got
        assert words in got["detail"], got
    assert (await acme.get("/api/v1/tasks")).json()["items"] == before  # nothing submitted
