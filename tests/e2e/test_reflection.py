"""Bounced stored messages (decision 034): nats-server answers a direct get to
whatever reply subject the asker names, past the asker's publish permissions.
A host-agent — the credential a sandbox escape reaches — writes output of its
own choosing, so it could have the server publish those bytes as a request of
any tenant or as an event on any subject. Every receiver refuses what carries
the marks of such an answer (`Nats-Stream`, kept with the stored copy)."""

from __future__ import annotations

import json

import msgspec
import nats
from sandhold.bus.permissions import inbox_prefix
from sandhold.client import Client
from sandhold.domain.requests import command_id_for

from tests.e2e.conftest import running_sandbox
from tests.e2e.harness import Up
from tests.support.waiting import wait_until


async def _bounce(up: Up, body: bytes, onto: str, headers: dict[str, str] | None = None) -> None:
    """As the host-agent: store `body` as command output, then ask for it back
    with `onto` as the reply subject."""
    nc = await nats.connect(up.url_as("host-local"), inbox_prefix=inbox_prefix("host-local"))
    try:
        js = nc.jetstream()
        subject = "sh.out.sb-00000000000000aa.cmd-00000000000000aa.stdout"
        ack = await js.publish(subject, body, headers=headers)
        await nc.publish(
            "$JS.API.DIRECT.GET.SH_OUTPUT", json.dumps({"seq": ack.seq}).encode(), reply=onto
        )
        await nc.flush()
    finally:
        await nc.close()


async def test_a_request_bounced_onto_another_tenants_subject_is_never_run(up: Up, client: Client):
    sandbox_id = await running_sandbox(client)
    forged = {
        "type": "command.run", "key": "bounced", "tenant": "default",
        "sandbox_id": sandbox_id, "argv": ["sh", "-c", "echo owned > /workspace/owned"],
    }  # fmt: skip
    admin = await nats.connect(up.admin_url)
    try:
        ajs = admin.jetstream()
        before = (await ajs.stream_info("SH_REQUESTS")).state.last_seq
        await _bounce(up, msgspec.json.encode(forged), "sh.req.command.run.default",
                      headers={"Sh-Reply": "_INBOX.host-local.x"})  # fmt: skip
        # It was stored on the request subject (the server published it there,
        # after answering the direct get: asynchronously to the asker's flush)...
        await wait_until(
            lambda: _stored_after(ajs, before), timeout=10, interval=0.05, what="the bounce stored"
        )
        assert (await ajs.stream_info("SH_REQUESTS")).state.last_seq == before + 1
        # ...and the scheduler took it off the queue without running it.
        await wait_until(
            lambda: _drained(ajs), timeout=30, interval=0.1, what="the scheduler to drop it"
        )
    finally:
        await admin.close()
    state = await client.sandbox_state(sandbox_id)
    assert state is not None and command_id_for(sandbox_id, "bounced") not in state.commands
    check = await client.exec(sandbox_id, ["sh", "-c", "test ! -e /workspace/owned"])
    assert check.command.exit_code == 0


async def _stored_after(js, before: int) -> bool:
    return (await js.stream_info("SH_REQUESTS")).state.last_seq > before


async def _drained(js) -> bool:
    return (await js.stream_info("SH_REQUESTS")).state.messages == 0


async def test_an_event_bounced_onto_a_sandbox_subject_behind_the_fence_is_not_history(
    up: Up, client: Client
):
    sandbox_id = await running_sandbox(client)
    subject = client.names.events("sandbox", sandbox_id)
    last = (await client.js.get_last_msg("SH_EVENTS", subject, direct=True)).seq
    forged = {
        "id": "bounced:0", "aggregate_id": sandbox_id, "time": 1.0, "actor": "host-agent:local",
        "causation_id": "c", "correlation_id": "c",
        "event": {"type": "sandbox.deleted", "host": "local", "generation": 1},
    }  # fmt: skip
    # A host lines the bounce up with the fence by making its output's own
    # subject sequence match (racy, but possible); what gets stored is then this
    # copy, made here directly as the admin: the fence header and the marks of a
    # direct get's answer.
    admin = await nats.connect(up.admin_url)
    try:
        await admin.jetstream().publish(
            subject,
            msgspec.json.encode(forged),
            headers={
                "Nats-Expected-Last-Subject-Sequence": str(last),
                "Nats-Stream": "SH_OUTPUT",
                "Nats-Subject": "sh.out.sb-00000000000000aa.cmd-00000000000000aa.stdout",
                "Nats-Sequence": "7",
            },
        )
    finally:
        await admin.close()
    await wait_until(
        lambda: _moved_on(client, subject, last), timeout=10, what="the bounced copy stored"
    )
    assert (await client.show_sandbox(sandbox_id)).phase == "running"
    ran = await client.exec(sandbox_id, ["true"])  # the scheduler (its fold, then a sync)
    assert ran.command.state == "exited"
    exported = up.cli("audit", "export", "--sandbox", sandbox_id)
    assert exported.returncode == 0 and "bounced:0" not in exported.stdout


async def _moved_on(client: Client, subject: str, last: int) -> bool:
    return (await client.js.get_last_msg("SH_EVENTS", subject, direct=True)).seq > last
