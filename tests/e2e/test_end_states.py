"""Each command end state, reproduced for real through `sandhold up`."""

from __future__ import annotations

import asyncio
import time

import msgspec
import nats
import pytest
from sandhold.client import Client

from tests.e2e.conftest import running_sandbox
from tests.e2e.harness import Up
from tests.support.forging import publish_refused
from tests.support.waiting import wait_until

# Every end state, on one node and on a three-node cluster with two of every service.
pytestmark = pytest.mark.cluster


def test_the_readme_flow_create_then_exec_prints_hello_and_exits_3(up: Up):
    created = up.cli_json("sandbox", "create", "--wait")
    assert created["phase"] == "running"
    assert created["host"] == "local" and created["generation"] == 1
    done = up.cli("exec", created["id"], "--", "sh", "-c", "echo hello; exit 3")
    assert done.stdout == "hello\n"
    assert done.returncode == 3


def test_exec_json_prints_the_command_record(up: Up):
    sandbox_id = up.cli_json("sandbox", "create", "--wait")["id"]
    done = up.cli("exec", sandbox_id, "--json", "--", "sh", "-c", "echo out; echo err >&2; exit 4")
    assert done.returncode == 4
    record = msgspec.json.decode(done.stdout)
    assert record["state"] == "exited" and record["exit_code"] == 4
    assert record["stdout"] == "out\n" and record["stderr"] == "err\n"
    assert record["output_kept"] == {"stdout": 4, "stderr": 4}
    assert record["output_complete"] is True
    assert {"id", "state", "exit_code", "reason", "output", "output_kept"} <= record.keys()


async def test_exited_keeps_all_output_in_order(client: Client):
    sandbox_id = await running_sandbox(client)
    seen: list[bytes] = []
    result = await client.exec(
        sandbox_id,
        ["sh", "-c", "for i in $(seq 1 2000); do echo line-$i; done"],
        on_output=lambda stream, data: seen.append(data),
    )
    assert result.command.state == "exited" and result.command.exit_code == 0
    expected = "".join(f"line-{i}\n" for i in range(1, 2001)).encode()
    assert b"".join(seen) == expected == result.stdout
    assert await client.read_output(sandbox_id, result.command.id) == {
        "stdout": expected,
        "stderr": b"",
    }


async def test_launch_failed_for_a_missing_executable_and_a_missing_cwd(client: Client):
    sandbox_id = await running_sandbox(client)
    missing = await client.exec(sandbox_id, ["no-such-program-here"])
    assert missing.command.state == "launch_failed"
    assert "no-such-program-here" in missing.command.reason
    bad_cwd = await client.exec(sandbox_id, ["true"], cwd="/does/not/exist")
    assert bad_cwd.command.state == "launch_failed"
    assert "/does/not/exist" in bad_cwd.command.reason


def test_launch_failed_exits_127_from_the_cli(up: Up):
    sandbox_id = up.cli_json("sandbox", "create", "--wait")["id"]
    done = up.cli("exec", sandbox_id, "--", "no-such-program-here")
    assert done.returncode == 127
    assert "launch_failed" in done.stderr


async def test_timed_out_terms_then_kills_after_the_grace(client: Client):
    sandbox_id = await running_sandbox(client)
    started = time.monotonic()
    result = await client.exec(
        sandbox_id,
        ["sh", "-c", "trap '' TERM; echo waiting; sleep 30"],
        timeout_s=0.5,
        kill_grace_s=0.5,
    )
    assert result.command.state == "timed_out"
    assert result.stdout == b"waiting\n"
    # ended by the KILL after the grace, long before the program's own 30 s
    assert time.monotonic() - started < 20


async def test_interrupted_by_an_explicit_cancel(client: Client):
    sandbox_id = await running_sandbox(client)
    key = "cancel-me"
    run = asyncio.create_task(client.exec(sandbox_id, ["sleep", "60"], key=key))
    from sandhold.domain.requests import command_id_for

    command_id = command_id_for(sandbox_id, key)
    await wait_until(lambda: _state(client, sandbox_id, command_id, "running"), what="running")
    await client.cancel_command(sandbox_id, command_id)
    result = await asyncio.wait_for(run, 30)
    assert result.command.state == "interrupted"


async def test_exec_answers_only_with_an_end_the_log_stored(up: Up, client: Client):
    """A `command.ended` the stream refused (a stale writer's, stopped by the
    expected-sequence fence) still reaches every core subscriber of the
    subject; exec must not take it for the command's end."""
    from sandhold.domain.events import CommandEnded
    from sandhold.domain.requests import command_id_for

    sandbox_id = await running_sandbox(client)
    run = asyncio.create_task(client.exec(sandbox_id, ["sleep", "60"], key="forged-end"))
    command_id = command_id_for(sandbox_id, "forged-end")
    await wait_until(lambda: _state(client, sandbox_id, command_id, "running"), what="running")
    admin = await nats.connect(up.admin_url.split(","))  # no service's user may even try
    try:
        await publish_refused(
            admin.jetstream(),
            client.names.events("sandbox", sandbox_id),
            sandbox_id,
            CommandEnded(command_id=command_id, state="exited", exit_code=0, host="local"),
        )
    finally:
        await admin.close()
    await client.cancel_command(sandbox_id, command_id)
    result = await asyncio.wait_for(run, 30)
    assert result.command.state == "interrupted"
    stored = await client.show_command(sandbox_id, command_id)
    assert stored.state == "interrupted"


async def test_interrupted_by_a_stop_and_the_stop_completes(client: Client):
    sandbox_id = await running_sandbox(client)
    run = asyncio.create_task(client.exec(sandbox_id, ["sleep", "60"], key="stop-me"))
    from sandhold.domain.requests import command_id_for

    command_id = command_id_for(sandbox_id, "stop-me")
    await wait_until(lambda: _state(client, sandbox_id, command_id, "running"), what="running")
    await client.stop_sandbox(sandbox_id)
    result = await asyncio.wait_for(run, 30)
    assert result.command.state == "interrupted"
    await client.wait_for_phase(sandbox_id, {"stopped"}, timeout=30)


async def test_resource_exhausted_when_the_memory_limit_is_hit(client: Client):
    sandbox_id = await running_sandbox(client, memory_limit_bytes=32 * 1024 * 1024)
    hog = "b = bytearray(200 * 1024 * 1024); print(len(b))"

    result = await client.exec(sandbox_id, ["python3", "-c", hog])
    assert result.command.state == "resource_exhausted", result.command
    assert result.stdout == b""


async def test_a_sandbox_can_be_stopped_started_and_removed(client: Client):
    sandbox_id = await running_sandbox(client)
    first = await client.exec(sandbox_id, ["sh", "-c", "echo kept > note"])
    assert first.command.state == "exited"
    await client.stop_sandbox(sandbox_id)
    await client.wait_for_phase(sandbox_id, {"stopped"})
    refused = await _rejection(client.exec(sandbox_id, ["true"]))
    assert refused == "sandbox_not_running"
    await client.start_sandbox(sandbox_id)
    view = await client.wait_for_phase(sandbox_id, {"running"})
    assert view.generation == 2
    again = await client.exec(sandbox_id, ["cat", "note"])
    assert again.stdout == b"kept\n"  # the workspace survived the stop
    await client.delete_sandbox(sandbox_id)
    await client.wait_for_phase(sandbox_id, {"deleted"})
    assert sandbox_id not in {v.id for v in await client.list_sandboxes()}


async def _state(client: Client, sandbox_id: str, command_id: str, state: str) -> bool:
    try:
        return (await client.show_command(sandbox_id, command_id)).state == state
    except Exception:
        return False


async def _rejection(coro) -> str:
    from sandhold.domain.errors import Rejected

    try:
        await coro
    except Rejected as err:
        return err.code
    raise AssertionError("expected a rejection")
