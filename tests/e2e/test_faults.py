"""Idempotency, malformed input and process faults, through a real `sandhold up`."""

from __future__ import annotations

import asyncio
import os
import signal

import msgspec
import nats
import pytest
from sandhold.bus.permissions import inbox_prefix
from sandhold.client import Client, connect
from sandhold.domain.errors import Rejected
from sandhold.domain.requests import command_id_for, sandbox_id_for

from tests.e2e.conftest import running_sandbox
from tests.e2e.harness import Up
from tests.support.waiting import wait_until


def _lines(path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


async def test_same_key_twice_launches_once_and_a_different_body_is_refused(up: Up, client: Client):
    sandbox_id = await running_sandbox(client)
    count = up.workspace(sandbox_id) / "count"
    argv = ["sh", "-c", "echo launched >> count"]
    first = await client.exec(sandbox_id, argv, key="only-once")
    second = await client.exec(sandbox_id, argv, key="only-once")
    assert first.command.id == second.command.id
    assert second.command.state == "exited"
    assert _lines(count) == ["launched"]
    with pytest.raises(Rejected) as refused:
        await client.exec(sandbox_id, ["sh", "-c", "echo other >> count"], key="only-once")
    assert refused.value.code == "idempotency_conflict"
    assert _lines(count) == ["launched"]


def test_a_conflicting_key_is_a_clear_error_from_the_cli(up: Up):
    sandbox_id = up.cli_json("sandbox", "create", "--wait")["id"]
    assert up.cli("exec", sandbox_id, "--key", "k1", "--", "true").returncode == 0
    done = up.cli("exec", sandbox_id, "--key", "k1", "--", "false")
    assert done.returncode == 2
    assert "idempotency_conflict" in done.stderr and "k1" in done.stderr


@pytest.mark.parametrize(
    ("subject", "payload", "code", "names_the_problem"),
    [
        ("sh.req.command.run.default", b"this is not json", "malformed_request", "malformed"),
        (
            "sh.req.command.run.default",
            b'{"type": "command.run", "key": "k"}',
            "malformed_request",
            "sandbox_id",
        ),
        (
            "sh.req.command.run.default",
            b'{"type": "command.run", "key": "k", "sandbox_id": "sb-0123456789abcdef", "argv": []}',
            "malformed_request",
            "argv",
        ),
        (
            "sh.req.sandbox.create.default",
            b'{"type": "sandbox.create", "key": "k", "colour": "red"}',
            "malformed_request",
            "colour",
        ),
        (
            "sh.req.sandbox.create.default",
            b'{"type": "sandbox.explode", "key": "k"}',
            "malformed_request",
            "sandbox.explode",
        ),
        (
            "sh.req.command.run.default",
            b'{"type": "command.run", "key": "k", "sandbox_id": "sb-0123456789abcdef", '
            b'"argv": ["true"], "timeout_s": -1}',
            "malformed_request",
            "timeout_s",
        ),
        (
            "sh.req.sandbox.delete_snapshot.default",
            b'{"type": "sandbox.delete_snapshot", "key": "k", '
            b'"sandbox_id": "sb-0123456789abcdef", "save_id": "snap-1"}',
            "malformed_request",
            "save_id",
        ),
        # A subject without the tenant (or of another type) is named back.
        (
            "sh.req.sandbox.create",
            b'{"type": "sandbox.create", "key": "k"}',
            "malformed_request",
            "sh.req.sandbox.create.default",
        ),
        (
            "sh.req.sandbox.start.default",
            b'{"type": "sandbox.create", "key": "k"}',
            "malformed_request",
            "sh.req.sandbox.create.default",
        ),
        # The subject says whose request it is; a body naming another is refused.
        (
            "sh.req.sandbox.create.acme",
            b'{"type": "sandbox.create", "key": "k", "tenant": "globex"}',
            "wrong_tenant",
            "'acme' names tenant 'globex'",
        ),
        (
            "sh.req.command.run.acme~corp",
            b'{"type": "command.run", "key": "k", "sandbox_id": "sb-0123456789abcdef", '
            b'"argv": ["true"]}',
            "wrong_tenant",
            "'acme.corp' names tenant 'default'",
        ),
    ],
)
async def test_a_malformed_request_gets_a_clear_error_and_the_scheduler_serves_on(
    up: Up, client: Client, subject: str, payload: bytes, code: str, names_the_problem: str
):
    nc = await nats.connect(up.url, inbox_prefix=inbox_prefix("operator"))
    try:
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox, max_msgs=1)
        await nc.jetstream().publish(subject, payload, headers={"Sh-Reply": inbox})
        reply = msgspec.json.decode((await sub.next_msg(timeout=20)).data)
    finally:
        await nc.close()
    assert reply["ok"] is False
    assert reply["error"]["code"] == code
    assert names_the_problem in reply["error"]["message"]
    # nothing was half-applied, and the next request is served
    sandbox_id = await running_sandbox(client)
    assert (await client.exec(sandbox_id, ["true"])).command.state == "exited"


async def test_scheduler_killed_between_requests_loses_none_and_launches_none_twice(own_up: Up):
    client = await connect(own_up.url)
    try:
        sandbox_id = await running_sandbox(client)
        count = own_up.workspace(sandbox_id) / "count"
        first = await client.exec(sandbox_id, ["sh", "-c", "echo a >> count"], key="req-a")
        assert first.command.state == "exited"

        old_pid = own_up.service_pid("scheduler")
        os.kill(old_pid, signal.SIGKILL)
        await wait_until(lambda: not _alive(old_pid), what="scheduler dead")
        # Sent while no scheduler runs: JetStream keeps it until the restarted one takes it.
        second = await client.exec(sandbox_id, ["sh", "-c", "echo b >> count"], key="req-b")
        assert second.command.state == "exited"
        assert own_up.service_pid("scheduler") != old_pid

        # The first request again, after the restart: the original result, no second launch.
        again = await client.exec(sandbox_id, ["sh", "-c", "echo a >> count"], key="req-a")
        assert again.command.id == first.command.id and again.command.state == "exited"
        assert sorted(_lines(count)) == ["a", "b"]
    finally:
        await client.close()


async def test_a_request_taken_by_a_scheduler_that_dies_is_answered_to_the_same_call(
    own_up: Up,
):
    # The scheduler is paused with a fetch outstanding: the request is delivered to
    # it and never acked. Killed, it is redelivered to its successor after the ack
    # wait, which must come well within the caller's 30 s wait for the answer.
    client = await connect(own_up.url)
    try:
        pid = own_up.service_pid("scheduler")
        os.kill(pid, signal.SIGSTOP)
        try:
            info = await client.js.stream_info(client.names.requests_stream)
            create = asyncio.ensure_future(client.create_sandbox(key="taken-then-dead"))

            admin = await connect(own_up.admin_url)  # the scheduler's consumer is its own

            async def delivered() -> bool:
                # This request, not one handled before whose ack is still held
                # (decision 092): delivered past the stream's end before it.
                state = await admin.js.consumer_info(client.names.requests_stream, "scheduler")
                return state.delivered.stream_seq > info.state.last_seq

            try:
                await wait_until(
                    delivered, timeout=15, what="the request delivered to the paused one"
                )
            finally:
                await admin.close()
            os.kill(pid, signal.SIGKILL)
        finally:
            os.kill(pid, signal.SIGCONT)
        view = await create  # the same call, answered by the restarted scheduler
        assert view.id == sandbox_id_for("default", "taken-then-dead")
        assert own_up.service_pid("scheduler") != pid
    finally:
        await client.close()


async def test_commands_queued_when_the_sandbox_stops_end_not_launched(own_up: Up):
    client = await connect(own_up.url)
    agent = own_up.service_pid("host-agent:local")
    os.kill(agent, signal.SIGSTOP)  # the host takes no work: the sandbox never runs
    try:
        view = await client.create_sandbox()
        await client.wait_for_phase(view.id, {"placed"})
        run = asyncio.create_task(client.exec(view.id, ["sh", "-c", "echo ran > ran"], key="q"))
        command_id = command_id_for(view.id, "q")
        await wait_until(
            lambda: _command_state(client, view.id, command_id, "queued"), what="queued"
        )
        await client.stop_sandbox(view.id)
        result = await asyncio.wait_for(run, 30)
        assert result.command.state == "not_launched"
        assert "before it started" in result.command.reason
    finally:
        os.kill(agent, signal.SIGCONT)
    await client.wait_for_phase(view.id, {"stopped"}, timeout=30)
    assert not (own_up.workspace(view.id) / "ran").exists()
    await client.close()


async def _command_state(client: Client, sandbox_id: str, command_id: str, state: str) -> bool:
    try:
        return (await client.show_command(sandbox_id, command_id)).state == state
    except Rejected:
        return False


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


async def test_host_agent_killed_mid_command_readopts_it_and_keeps_all_output(own_up: Up):
    client = await connect(own_up.url)
    try:
        sandbox_id = await running_sandbox(client)
        script = "echo before; while [ ! -e go ]; do sleep 0.05; done; echo after; exit 7"
        run = asyncio.create_task(client.exec(sandbox_id, ["sh", "-c", script], key="survivor"))
        command_id = command_id_for(sandbox_id, "survivor")
        await wait_until(
            lambda: _command_state(client, sandbox_id, command_id, "running"), what="running"
        )
        old_agent = own_up.service_pid("host-agent:local")
        os.kill(old_agent, signal.SIGKILL)
        await wait_until(lambda: not _alive(old_agent), what="agent dead")
        # The command's supervisor outlives the agent; it finishes while no agent runs.
        own_up.touch_inside(sandbox_id, "go")
        result = await asyncio.wait_for(run, 60)
        assert own_up.service_pid("host-agent:local") != old_agent
        assert result.command.state == "exited" and result.command.exit_code == 7
        assert result.stdout == b"before\nafter\n"
        assert result.command.output_kept == {"stdout": 13, "stderr": 0}
    finally:
        await client.close()
