"""Connections (issue 13 part 5, decision 031): named credentials delivered as
files at /run/connections/<name> in a namespaced sandbox — never part of a
save or a Snapshot, delivered anew after a stop and start, removable, and
nowhere under the data dir (the JetStream store included) or in the log.
Against a real `sandhold up`. (After a host failure: test_host_failure.py.)"""

from __future__ import annotations

import hashlib
import secrets
import uuid
from pathlib import Path

import msgspec
import pytest
from sandhold.client import Client
from sandhold.domain import work as wk
from sandhold.domain.errors import Rejected

from tests.e2e.conftest import running_sandbox
from tests.e2e.harness import Up
from tests.e2e.test_host_compaction import put_on_the_queue
from tests.e2e.test_secrets import files_holding
from tests.support.bus import assert_refused_as_malformed


async def _read(client: Client, sandbox_id: str, name: str, **kwargs) -> bytes:
    result = await client.exec(sandbox_id, ["cat", f"/run/connections/{name}"], **kwargs)
    assert result.command.exit_code == 0, result
    return result.stdout


async def _digest(client: Client, sandbox_id: str, name: str, **kwargs) -> str:
    """The file's SHA-256 read inside (so its value is in no command's output)."""
    result = await client.exec(sandbox_id, ["sha256sum", f"/run/connections/{name}"], **kwargs)
    assert result.command.exit_code == 0, result
    return result.stdout.decode().split()[0]


async def _names(client: Client, sandbox_id: str) -> list[str]:
    listed = await client.exec(sandbox_id, ["ls", "-A", "/run/connections"])
    assert listed.command.exit_code == 0, listed
    return listed.stdout.decode().split()


async def test_a_connection_is_readable_inside_and_leaves_no_trace(
    up: Up, client: Client, tmp_path
):
    value = f"ghp_{secrets.token_hex(20)}\nsecond line\n"
    sandbox_id = await running_sandbox(client)
    token = tmp_path / "token.txt"
    token.write_text(value)
    done = up.cli("connection", "set", sandbox_id, "github", "--from-file", str(token))
    assert done.returncode == 0, done.stderr
    assert "/run/connections/github" in done.stdout

    # The very next command sees it (commands wait for the delivery), as the
    # sandbox's user and as its root, whole and unchanged; nobody may change it.
    digest = hashlib.sha256(value.encode()).hexdigest()
    assert await _digest(client, sandbox_id, "github") == digest
    assert await _digest(client, sandbox_id, "github", user="root") == digest
    write = await client.exec(
        sandbox_id, ["sh", "-c", "echo x > /run/connections/github"], user="root"
    )
    assert write.command.exit_code != 0
    assert await _digest(client, sandbox_id, "github") == digest
    env = await client.exec(sandbox_id, ["sh", "-c", 'echo "$SANDHOLD_CONNECTIONS"'])
    assert env.stdout == b"/run/connections\n"

    view = await client.show_sandbox(sandbox_id)
    assert view.connections == ["github"] and view.connections_pending is False
    listed = up.cli_json("connection", "ls", sandbox_id, "--json")
    assert listed == {"sandbox_id": sandbox_id, "connections": ["github"], "pending": False}

    set_events = [
        r.envelope.event
        for r in await client.sandbox_records(sandbox_id)
        if r.envelope.type == "connection.set"
    ]
    assert [(e.name, e.size, e.revision) for e in set_events] == [("github", len(value), 1)]
    exported = up.cli("audit", "export", "--sandbox", sandbox_id)
    assert exported.returncode == 0 and "connection.set" in exported.stdout
    secret_part = value.split("\n")[0]
    assert secret_part not in exported.stdout
    shown = up.cli("history", "sandbox", sandbox_id)
    assert shown.returncode == 0 and secret_part not in shown.stdout
    assert files_holding(up.data_dir, secret_part.encode()) == []


async def test_a_snapshot_holds_no_connection_and_a_sandbox_made_from_it_has_none(
    up: Up, client: Client
):
    value = secrets.token_hex(24)
    sandbox_id = await running_sandbox(client)
    await client.set_connection(sandbox_id, "db", value)
    await client.exec(sandbox_id, ["sh", "-c", "cp /run/connections/db /tmp/x; echo kept > mine"])
    snapshot = await client.snapshot(sandbox_id, "with-connection")
    assert (await client.wait_for_save(sandbox_id, snapshot.id, timeout=60)).state == "completed"

    copy = await running_sandbox(client, from_snapshot=snapshot.id)
    assert (await client.exec(copy, ["cat", "mine"])).stdout == b"kept\n"  # the files came
    assert await _names(client, copy) == []  # ...the Connection did not
    assert (await client.show_sandbox(copy)).connections == []
    assert await _read(client, sandbox_id, "db") == value.encode()  # still the original's


async def test_a_connection_is_delivered_again_after_a_stop_and_a_start(up: Up, client: Client):
    value = secrets.token_hex(24)
    sandbox_id = await running_sandbox(client)
    await client.set_connection(sandbox_id, "api", value)
    assert await _read(client, sandbox_id, "api") == value.encode()
    done = up.cli("sandbox", "stop", sandbox_id)
    assert done.returncode == 0, done.stderr
    # Stopped: not even its host's tmpfs copy is kept for it.
    assert files_holding(Path("/dev/shm"), value.encode()) == []

    await client.start_sandbox(sandbox_id)
    await client.wait_for_phase(sandbox_id, {"running"}, timeout=60)
    assert await _read(client, sandbox_id, "api") == value.encode()


async def test_a_connection_changes_and_goes_while_the_sandbox_runs(up: Up, client: Client):
    sandbox_id = await running_sandbox(client)
    await client.set_connection(sandbox_id, "one", "first")
    await client.set_connection(sandbox_id, "two", "other")
    assert await _names(client, sandbox_id) == ["one", "two"]
    # A program that holds the directory open (as a bind mount does) sees the change.
    await client.set_connection(sandbox_id, "one", "second")
    assert await _read(client, sandbox_id, "one") == b"second"

    done = up.cli("connection", "rm", sandbox_id, "one")
    assert done.returncode == 0, done.stderr
    assert await _names(client, sandbox_id) == ["two"]
    view = await client.show_sandbox(sandbox_id)
    assert view.connections == ["two"]

    with pytest.raises(Rejected) as missing:
        await client.remove_connection(sandbox_id, "one")
    assert missing.value.code == "connection_not_found"


async def test_an_older_delivery_taken_again_brings_back_nothing(up: Up, client: Client):
    """A host takes an instruction at least once (one handled as its agent died
    is delivered again): a delivery of revision 1 taken after revision 2 was
    written must not put revision 1's value back, nor a removed name."""
    sandbox_id = await running_sandbox(client)
    await client.set_connection(sandbox_id, "one", "first")
    assert await _read(client, sandbox_id, "one") == b"first"
    await client.set_connection(sandbox_id, "one", "second")
    assert await _read(client, sandbox_id, "one") == b"second"
    generation = (await client.sandbox_state(sandbox_id)).generation
    older = wk.DeliverConnectionsWork(
        sandbox_id=sandbox_id, generation=generation, revision=1, connections={"one": "first"}
    )
    await put_on_the_queue(up, older)
    assert await _read(client, sandbox_id, "one") == b"second"


async def test_a_retry_with_the_same_key_sets_the_connection_once(up: Up, client: Client):
    sandbox_id = await running_sandbox(client)
    key = f"set-{uuid.uuid4().hex}"
    await client.set_connection(sandbox_id, "k", "v1", key=key)
    again = await client.set_connection(sandbox_id, "k", "v1", key=key)
    assert again.connections == ["k"]
    sets = [
        r for r in await client.sandbox_records(sandbox_id) if r.envelope.type == "connection.set"
    ]
    assert len(sets) == 1
    assert await _read(client, sandbox_id, "k") == b"v1"


async def test_malformed_connection_requests_get_a_clear_error_and_change_nothing(
    up: Up, client: Client
):
    sandbox_id = await running_sandbox(client)
    base = {"type": "connection.set", "sandbox_id": sandbox_id, "name": "ok", "value": "v"}
    cases = [
        ({"name": "../etc"}, "name"),
        ({"name": ".hidden"}, "name"),
        ({"name": "a/b"}, "name"),
        ({"value": 7}, "value"),
        ({"value": "x" * 65537}, "value"),
        ({"extra": 1}, "extra"),
        ({"sandbox_id": "sb-nope"}, "sandbox_id"),
    ]
    await assert_refused_as_malformed(up.url, "sh.req.connection.set.default", base, cases)
    state = await client.sandbox_state(sandbox_id)
    assert state is not None and state.connections == {} and state.connections_revision == 0

    too_many = [client.set_connection(sandbox_id, f"c{i}", "v") for i in range(16)]
    for call in too_many:
        await call
    with pytest.raises(Rejected) as refused:
        await client.set_connection(sandbox_id, "c16", "v")
    assert refused.value.code == "too_many_connections"
    await client.set_connection(sandbox_id, "c0", "x" * 65536)  # replaces c0's value
    with pytest.raises(Rejected) as big:
        await client.set_connection(sandbox_id, "c1", "y" * 65536)
    assert big.value.code == "connections_too_large"


def test_the_cli_refuses_a_file_it_cannot_read(up: Up, tmp_path):
    missing = tmp_path / "absent"
    done = up.cli("connection", "set", "sb-0123456789abcdef", "x", "--from-file", str(missing))
    assert done.returncode != 0 and "--from-file" in done.stderr


async def test_a_connection_is_delivered_again_after_sandhold_up_restarts(tmp_path):
    """A full stop of `sandhold up` removes every Connection file (nothing it
    gave out outlives it); the sandbox keeps running in the log, and its next
    command finds them again: the host says they are gone, the scheduler resends."""
    first = Up(tmp_path / "data").start()
    try:
        sandbox_id = first.cli_json("sandbox", "create", "--wait")["id"]
        token = tmp_path / "token"
        token.write_text("value-1")
        assert (
            first.cli("connection", "set", sandbox_id, "t", "--from-file", str(token)).returncode
            == 0
        )
        assert first.cli("exec", sandbox_id, "--", "cat", "/run/connections/t").stdout == "value-1"
    finally:
        first.stop()
    assert files_holding(Path("/dev/shm"), b"value-1") == []
    second = Up(tmp_path / "data").start()
    try:
        shown = second.cli("exec", sandbox_id, "--", "cat", "/run/connections/t")
        assert shown.returncode == 0, shown.stderr
        assert shown.stdout == "value-1"
        # Delivered again after the restart, one of two ways: the host found the
        # placement's files gone and said so; or the sandbox had been declared lost
        # meanwhile (the restart outlasted the lease) and its new placement's start
        # carried them.
        events = [
            msgspec.json.decode(x)
            for x in second.cli("audit", "export", "--sandbox", sandbox_id).stdout.splitlines()
        ]
        kinds = [e["type"] for e in events]
        redelivered = [
            e
            for e in events
            if e["type"] == "sandbox.connections_dropped"
            or (e["type"] == "sandbox.started" and e["event"]["generation"] > 1)
        ]
        assert redelivered, kinds
        if redelivered[0]["type"] == "sandbox.started":
            assert redelivered[0]["event"]["connections_revision"] == 1
        else:
            assert kinds.count("sandbox.connections_delivered") == 2, kinds
    finally:
        second.stop()
