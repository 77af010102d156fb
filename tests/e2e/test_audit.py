"""Replay, history, audit export and live tail through a real `sandhold up`."""

from __future__ import annotations

import subprocess

import httpx
import msgspec
from sandhold.client import Client

from tests.e2e.harness import SANDHOLD, Up
from tests.support.forging import publish_refused


def test_replay_shows_the_state_as_of_any_sequence(up: Up):
    sandbox_id = up.cli_json("sandbox", "create", "--wait")["id"]
    assert up.cli("exec", sandbox_id, "--key", "r1", "--", "sh", "-c", "exit 5").returncode == 5
    lines = up.cli("audit", "export", "--sandbox", sandbox_id).stdout.splitlines()
    exported = [msgspec.json.decode(line) for line in lines]
    assert exported[0]["type"] == "sandbox.created"
    for line in exported:
        assert {
            "seq",
            "id",
            "type",
            "aggregate_id",
            "time",
            "actor",
            "causation_id",
            "correlation_id",
            "event",
        } <= line.keys()
        assert line["aggregate_id"] == sandbox_id and line["event"]["type"] == line["type"]
    assert [e["seq"] for e in exported] == sorted(e["seq"] for e in exported)

    created = up.cli_json("replay", "sandbox", sandbox_id, "--at", str(exported[0]["seq"]))
    assert created["sandbox"]["phase"] == "pending" and created["commands"] == {}
    now = up.cli_json("replay", "sandbox", sandbox_id)
    assert now["sandbox"]["phase"] == "running"
    assert list(now["commands"].values()) == ["exited"]
    assert now["as_of"]["seq"] == exported[-1]["seq"]
    # the same fold the services use: matches `sandbox show`
    shown = up.cli_json("sandbox", "show", sandbox_id)
    assert (shown["phase"], shown["generation"]) == (
        now["sandbox"]["phase"],
        now["sandbox"]["generation"],
    )
    bad = up.cli("replay", "sandbox", sandbox_id, "--at", "yesterday-ish")
    assert bad.returncode != 0 and "--at" in bad.stderr


def test_history_reads_as_a_timeline(up: Up):
    sandbox_id = up.cli_json("sandbox", "create", "--wait", "--key", "who-asked")["id"]
    up.cli("exec", sandbox_id, "--key", "run-it", "--", "true")
    timeline = up.cli("history", "sandbox", sandbox_id).stdout
    # who asked (the request's key), what was decided, what happened on the host
    for what in (
        "cause=who-asked",
        "cause=run-it",
        "sandbox.created",
        "scheduler",
        "sandbox.placed",
        "host-agent:local",
        "command.ended",  # (a `true`'s start may go unreported: it ends at once, 095)
    ):
        assert what in timeline, what


async def test_events_tail_follows_stored_events_only(up: Up):
    import nats
    from sandhold.bus.names import Names
    from sandhold.domain.events import SandboxDeleted

    sandbox_id = up.cli_json("sandbox", "create", "--wait")["id"]
    nc = await nats.connect(up.admin_url)
    with subprocess.Popen(
        [
            SANDHOLD,
            "--data-dir",
            str(up.data_dir),
            "events",
            "tail",
            "--sandbox",
            sandbox_id,
            "--count",
            "3",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as tail:
        try:
            assert tail.stderr is not None
            assert "following" in tail.stderr.readline()  # subscribed before we act
            subject = Names(up.runtime["prefix"]).events("sandbox", sandbox_id)
            await publish_refused(
                nc.jetstream(), subject, sandbox_id, SandboxDeleted(host="local", generation=1)
            )
            # (Long enough for its start to be reported: a `true` has its end alone, 095.)
            up.cli("exec", sandbox_id, "--", "sleep", "0.5")
            out, _ = tail.communicate(timeout=30)
        finally:
            await nc.close()
            if tail.poll() is None:
                tail.kill()
    assert tail.returncode == 0
    assert [line.split()[-1] for line in out.splitlines()] == [
        "command.queued",  # (and dispatched by it: decision 098)
        "command.started",
        "command.ended",
    ]


async def test_audit_export_shows_events_of_types_it_does_not_know(up: Up):
    import nats
    from sandhold.bus.codec import FENCE_HEADER
    from sandhold.bus.names import Names

    names = Names(up.runtime["prefix"])
    sandbox_id = "sb-00000000000000ff"
    future = {
        "id": "future:0", "aggregate_id": sandbox_id, "time": 1.0, "actor": "a-newer-version",
        "causation_id": "c", "correlation_id": "c",
        "event": {"type": "sandbox.teleported", "to": "mars"},
    }  # fmt: skip
    nc = await nats.connect(up.admin_url)
    try:
        # Appended the one way (a newer version would): behind the fence.
        await nc.jetstream().publish(
            names.events("sandbox", sandbox_id),
            msgspec.json.encode(future),
            headers={FENCE_HEADER: "0"},
        )
    finally:
        await nc.close()
    done = up.cli("audit", "export", "--sandbox", sandbox_id)
    assert done.returncode == 0, done.stderr
    [line] = [msgspec.json.decode(x) for x in done.stdout.splitlines()]
    assert (line["type"], line["event"]["to"], line["actor"]) == (
        "sandbox.teleported", "mars", "a-newer-version",
    )  # fmt: skip


async def test_a_forged_event_without_the_fence_is_stored_but_never_believed(
    up: Up, client: Client
):
    """A host-agent's credential may append to sandbox subjects; one that skips
    the fence (a raw publish of a well-formed `sandbox.deleted`) gets its
    message stored, and no reader takes it for history: not the scheduler,
    not a client's fold, not the gateway, not `audit export`."""
    import nats
    from sandhold.bus.permissions import inbox_prefix

    sandbox_id = up.cli_json("sandbox", "create", "--wait")["id"]
    forged = {
        "id": "forged:0", "aggregate_id": sandbox_id, "time": 1.0, "actor": "host-agent:local",
        "causation_id": "c", "correlation_id": "c",
        "event": {"type": "sandbox.deleted", "host": "local", "generation": 1},
    }  # fmt: skip
    nc = await nats.connect(up.url_as("host-local"), inbox_prefix=inbox_prefix("host-local"))
    try:
        ack = await nc.jetstream().publish(
            client.names.events("sandbox", sandbox_id), msgspec.json.encode(forged)
        )
        assert ack.seq > 0  # the stream took it: permissions allow the subject
    finally:
        await nc.close()
    assert (await client.show_sandbox(sandbox_id)).phase == "running"
    ran = up.cli("exec", sandbox_id, "--", "true")  # the scheduler did not believe it either
    assert ran.returncode == 0, ran.stderr
    exported = up.cli("audit", "export", "--sandbox", sandbox_id)
    assert exported.returncode == 0 and "forged:0" not in exported.stdout
    assert "sandbox.created" in exported.stdout
    token = up.cli("token", "create", "--tenant", "default")
    assert token.returncode == 0, token.stderr
    shown = httpx.get(
        f"{up.gateway_url}/api/v1/sandboxes/{sandbox_id}",
        headers={"Authorization": f"Bearer {token.stdout.strip()}"},
        timeout=30,
    )
    assert shown.status_code == 200 and shown.json()["phase"] == "running", shown.text
