"""Tenants on the bus (decision 028): a tenant's NATS credential reaches its own
sandboxes through the gateway's API subject and nothing else, against a real
`sandhold up`. The permission denials themselves are in tests/bus/test_permissions.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import nats
import pytest
from sandhold.bus import credentials

from tests.e2e.harness import Up
from tests.support.bus import hello
from tests.support.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "docs" / "examples" / "tenant_nats.py"


class Tenant:
    """A plain nats-py connection with a tenant's credential, calling its API."""

    def __init__(self, nc: nats.NATS, me: credentials.Credentials) -> None:
        self.nc = nc
        self.me = me
        self.subject = f"sh.api.{str(me.tenant).replace('.', '~')}"

    async def raw(self, data: bytes, subject: str | None = None) -> dict[str, Any]:
        msg = await self.nc.request(subject or self.subject, data, timeout=60)
        return msgspec.json.decode(msg.data)

    async def call(self, method: str, path: str, body: Any = None, **headers: str) -> dict:
        call: dict[str, Any] = {"method": method, "path": path, "headers": headers}
        if body is not None:
            call["body"] = body
        return await self.raw(json.dumps(call).encode())


def issue(up: Up, tenant: str, out: Path) -> credentials.Credentials:
    done = up.cli("credentials", "create", "--tenant", tenant, "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert (out.stat().st_mode & 0o777) == 0o600
    return credentials.load(out)


@contextlib.asynccontextmanager
async def as_tenant(up: Up, me: credentials.Credentials) -> AsyncIterator[Tenant]:
    nc = await nats.connect(
        up.nats_url,
        user=me.user,
        password=me.password,
        inbox_prefix=f"_INBOX.{me.user}",
        allow_reconnect=False,
    )
    try:
        yield Tenant(nc, me)
    finally:
        await nc.close()


@pytest.fixture(scope="module")
def creds(up: Up, tmp_path_factory: pytest.TempPathFactory) -> dict[str, credentials.Credentials]:
    where = tmp_path_factory.mktemp("tenants")
    return {t: issue(up, t, where / f"{t}.creds") for t in ("acme", "globex", "acme.corp")}


async def running_sandbox(tenant: Tenant) -> str:
    made = await tenant.call("POST", "/api/v1/sandboxes", **{"Idempotency-Key": uuid.uuid4().hex})
    assert made["status"] == 201, made
    sandbox_id = made["body"]["id"]

    async def running() -> bool:
        shown = await tenant.call("GET", f"/api/v1/sandboxes/{sandbox_id}")
        return shown["body"]["phase"] == "running"

    await wait_until(running, timeout=60, what="the sandbox running")
    return sandbox_id


async def test_a_tenant_runs_a_command_and_follows_its_events_over_nats(up: Up, creds):
    async with as_tenant(up, creds["acme"]) as acme:
        sandbox_id = await running_sandbox(acme)
        ran = await acme.call(
            "POST",
            f"/api/v1/sandboxes/{sandbox_id}/commands",
            {"argv": ["sh", "-c", "echo from-acme"]},
            **{"Idempotency-Key": "run-1"},
        )
        assert ran["status"] == 202, ran
        command_id = ran["body"]["id"]
        again = await acme.call(  # the same key: the same command, not a second one
            "POST",
            f"/api/v1/sandboxes/{sandbox_id}/commands",
            {"argv": ["sh", "-c", "echo from-acme"]},
            **{"Idempotency-Key": "run-1"},
        )
        assert again["body"]["id"] == command_id

        # Long polling: each page starts after the last one's last event.
        after, seen, ended = 0, [], None
        while ended is None:
            page = await acme.call(
                "GET", f"/api/v1/sandboxes/{sandbox_id}/events?after={after}&wait=10"
            )
            assert page["status"] == 200, page
            ids = [e["seq"] for e in page["body"]["events"]]
            assert all(i > after for i in ids) and ids == sorted(ids)
            seen += page["body"]["events"]
            after = page["body"]["last_event_id"]
            ended = next(
                (e for e in seen if e["type"] == "command.ended" and e["aggregate_id"]),
                None,
            )
        assert seen[0]["type"] == "sandbox.created"
        assert ended["event"]["state"] == "exited"
        output = await acme.call(
            "GET", f"/api/v1/sandboxes/{sandbox_id}/commands/{command_id}/output"
        )
        assert output["body"]["stdout"] == "from-acme\n"
        # A page after the end, with nothing new: empty, and the same point back.
        quiet = await acme.call("GET", f"/api/v1/sandboxes/{sandbox_id}/events?after={after}")
        assert quiet["body"] == {"events": [], "last_event_id": after}


async def test_another_tenant_sees_none_of_it(up: Up, creds):
    async with as_tenant(up, creds["acme"]) as acme:
        sandbox_id = await running_sandbox(acme)
    async with as_tenant(up, creds["globex"]) as globex:
        for path in (
            f"/api/v1/sandboxes/{sandbox_id}",
            f"/api/v1/sandboxes/{sandbox_id}/events",
            f"/api/v1/sandboxes/{sandbox_id}/commands",
        ):
            answer = await globex.call("GET", path)
            assert answer["status"] == 404 and answer["body"]["code"] == "sandbox_not_found"
        stop = await globex.call("POST", f"/api/v1/sandboxes/{sandbox_id}/stop")
        assert stop["status"] == 404
        listed = await globex.call("GET", "/api/v1/sandboxes")
        assert sandbox_id not in [s["id"] for s in listed["body"]["items"]]
        # The tenant is the subject's, never the caller's to say: even acme's
        # own HTTP token in the call's headers does not make globex acme.
        made = up.cli("token", "create", "--tenant", "acme")
        assert made.returncode == 0, made.stderr
        spoofed = await globex.call(
            "GET",
            f"/api/v1/sandboxes/{sandbox_id}",
            Authorization=f"Bearer {made.stdout.strip()}",
        )
        assert spoofed["status"] == 404
    async with as_tenant(up, creds["acme"]) as acme:
        listed = await acme.call("GET", "/api/v1/sandboxes")
        assert sandbox_id in [s["id"] for s in listed["body"]["items"]]


async def test_a_tenant_name_with_a_dot_is_its_own_tenant(up: Up, creds):
    async with as_tenant(up, creds["acme.corp"]) as corp:
        assert corp.subject == "sh.api.acme~corp"
        sandbox_id = await running_sandbox(corp)
        shown = await corp.call("GET", f"/api/v1/sandboxes/{sandbox_id}")
        assert shown["body"]["tenant"] == "acme.corp"
    async with as_tenant(up, creds["acme"]) as acme:
        assert (await acme.call("GET", f"/api/v1/sandboxes/{sandbox_id}"))["status"] == 404


SANDBOXES = "/api/v1/sandboxes"
EVENTS = "/api/v1/sandboxes/sb-0123456789abcdef/events"


@pytest.mark.parametrize(
    ("call", "status", "code", "says"),
    [
        (b"not json", 400, "malformed_body", "JSON"),
        ({"path": SANDBOXES}, 400, "malformed_body", "method"),
        ({"method": "PUT", "path": SANDBOXES}, 400, "malformed_body", "method"),
        ({"method": "GET", "path": "/openapi.json"}, 400, "malformed_body", "path"),
        ({"method": "GET", "path": SANDBOXES, "colour": 1}, 400, "malformed_body", "colour"),
        ({"method": "GET", "path": SANDBOXES, "headers": []}, 400, "malformed_body", "headers"),
        ({"method": "GET", "path": "/api/v1/nothing"}, 404, "not_found", ""),
        ({"method": "POST", "path": SANDBOXES, "body": {"x": 1}}, 422, "invalid_request", "`x`"),
        ({"method": "GET", "path": EVENTS + "?wait=99"}, 400, "invalid_parameter", "wait"),
        ({"method": "GET", "path": SANDBOXES + "?limit=x"}, 400, "invalid_parameter", "limit"),
    ],
)  # fmt: skip
async def test_a_malformed_call_gets_a_clear_error_and_changes_nothing(
    up: Up, creds, call: bytes | dict, status: int, code: str, says: str
):
    async with as_tenant(up, creds["globex"]) as globex:
        before = (await globex.call("GET", "/api/v1/sandboxes"))["body"]["items"]
        answer = await globex.raw(call if isinstance(call, bytes) else json.dumps(call).encode())
        assert answer["status"] == status, answer
        assert answer["body"]["code"] == code
        assert says in json.dumps(answer["body"])
        after = (await globex.call("GET", "/api/v1/sandboxes"))["body"]["items"]
        assert [s["id"] for s in after] == [s["id"] for s in before]


async def test_revoking_a_tenant_closes_its_connection_and_refuses_the_next(up: Up, tmp_path: Path):
    me = issue(up, "initech", tmp_path / "initech.creds")
    closed = asyncio.Event()

    async def on_closed() -> None:
        closed.set()

    async def on_error(err: Exception) -> None:
        pass

    nc = await nats.connect(
        up.nats_url, user=me.user, password=me.password, inbox_prefix=f"_INBOX.{me.user}",
        allow_reconnect=False, closed_cb=on_closed, error_cb=on_error,
    )  # fmt: skip
    try:
        answer = msgspec.json.decode(
            (
                await nc.request(
                    "sh.api.initech", b'{"method":"GET","path":"/api/v1/sandboxes"}', timeout=30
                )
            ).data  # fmt: skip
        )
        assert answer["status"] == 200
        done = up.cli("credentials", "revoke", me.user)
        assert done.returncode == 0, done.stderr
        await asyncio.wait_for(closed.wait(), 30)  # the server ends it, no restart
    finally:
        await nc.close()
    assert b"Authorization Violation" in await hello(
        up.nats_url, {"user": me.user, "pass": me.password}
    )
    listed = up.cli_json("credentials", "ls")
    assert me.user not in [c["user"] for c in listed]


def test_the_operators_client_refuses_a_tenant_credential_with_a_pointer(up: Up, creds, tmp_path):
    path = tmp_path / "acme.creds"
    path.write_bytes(msgspec.json.encode(creds["acme"]))
    done = up.cli("--credentials", str(path), "sandbox", "ls")
    assert done.returncode != 0
    assert "tenant" in done.stderr and "sh.api.acme" in done.stderr, done.stderr


def test_credentials_ls_names_each_tenant(up: Up, creds):
    listed = up.cli_json("credentials", "ls")
    tenants = {c["user"]: c["tenant"] for c in listed if c["role"] == "tenant"}
    assert tenants["tenant-acme"] == "acme" and tenants["tenant-acme~corp"] == "acme.corp"
    shown = up.cli("credentials", "ls").stdout
    assert re.search(r"tenant-globex\s+role=tenant\s+tenant=globex", shown)


def test_docs_api_embeds_the_tenant_example_verbatim() -> None:
    blocks = re.findall(
        r"^```python\n(.*?)^```$", (ROOT / "docs" / "api.md").read_text(), re.S | re.M
    )
    assert EXAMPLE.read_text() in blocks


def test_the_tenant_example_runs_a_command(up: Up, creds, tmp_path: Path) -> None:
    path = tmp_path / "acme.creds"
    path.write_bytes(msgspec.json.encode(creds["acme"]))
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), up.nats_url, str(path)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "stdout: 'hello from a tenant\\n'" in done.stdout, done.stdout
    assert "command ended: state=exited exit_code=3" in done.stdout, done.stdout
