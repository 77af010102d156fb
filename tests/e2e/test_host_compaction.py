"""A host-agent keeps no ended command (decision 057): a run instruction that
comes again after its command ended is taken and dropped, and runs nothing."""

from __future__ import annotations

import shutil

import msgspec
import nats
import pytest
from sandhold.bus.names import Names
from sandhold.domain import requests as rq
from sandhold.domain import work as wk

from tests.e2e.harness import Up
from tests.support.waiting import wait_until

NAMES = Names("sh")


@pytest.mark.parametrize("directory", ["kept", "gone"])
async def test_a_run_instruction_repeated_after_the_end_runs_nothing(up: Up, directory: str):
    """Also once the host no longer keeps the command's directory (decision 077):
    the log, not the directory, keeps a reported command from running again."""
    sandbox_id = up.cli_json("sandbox", "create", "--wait")["id"]
    first = up.cli("exec", sandbox_id, "--key", "once", "--", "sh", "-c", "echo x >> count")
    assert first.returncode == 0, first.stderr
    command_id = rq.command_id_for(sandbox_id, "once")
    commands = up.data_dir / "hosts" / "local" / "sandboxes" / sandbox_id / "commands"
    assert (commands / command_id).is_dir()
    if directory == "gone":
        shutil.rmtree(commands / command_id)
    again = wk.RunCommandWork(
        sandbox_id=sandbox_id,
        generation=1,
        command_id=command_id,
        argv=["sh", "-c", "echo x >> count"],
        request_key="once",
    )
    nc = await nats.connect(up.admin_url)
    try:
        js = nc.jetstream()
        # Not the scheduler's message id: stored again, so the host takes it again.
        await js.publish(
            NAMES.work("local"), msgspec.json.encode(again), stream=NAMES.hostwork_stream,
            headers={"Nats-Msg-Id": "repeated-by-the-test"},
        )  # fmt: skip

        async def taken() -> bool:
            info = await js.consumer_info(NAMES.hostwork_stream, "host-local")
            return info.num_pending == 0 and info.num_ack_pending == 0

        await wait_until(taken, timeout=30, what="the repeated instruction taken and acked")
        info = await js.consumer_info(NAMES.hostwork_stream, "host-local")
        assert info.num_redelivered == 0, "taken at once: not 'not read yet', again and again"
    finally:
        await nc.close()
    assert up.cli("exec", sandbox_id, "--", "cat", "count").stdout == "x\n", "ran once"
    assert not (commands / command_id).exists() or directory == "kept"


async def test_the_queue_of_saves_takes_saves_and_nothing_else(up: Up):
    """Only the saver may write there, and it sends saves alone (decision 064): a
    stop put on that subject is dropped, and the sandbox runs on."""
    sandbox_id = up.cli_json("sandbox", "create", "--wait")["id"]
    await put_on_the_queue(up, wk.StopSandboxWork(sandbox_id=sandbox_id, generation=1), saves=True)
    _runs_on(up, sandbox_id)


async def test_a_destroy_nobody_asked_for_destroys_nothing(up: Up):
    """A destroy is sent after a delete request; on any other word the host
    keeps the files (and would not be believed if it said it deleted them)."""
    sandbox_id = up.cli_json("sandbox", "create", "--wait")["id"]
    await put_on_the_queue(up, wk.DestroySandboxWork(sandbox_id=sandbox_id, generation=1))
    _runs_on(up, sandbox_id)


async def put_on_the_queue(up: Up, work: wk.AnyWork, *, saves: bool = False) -> None:
    """Put `work` on the host's queue (or its queue of saves) as no service would,
    and wait until the host took it off."""
    nc = await nats.connect(up.admin_url)
    try:
        js = nc.jetstream()
        await js.publish(
            NAMES.work("local", saves=saves), msgspec.json.encode(work),
            stream=NAMES.hostwork_stream, headers={"Nats-Msg-Id": f"misplaced:{work.msg_id}"},
        )  # fmt: skip

        async def taken() -> bool:
            consumer = NAMES.work_consumer("local", saves=saves)
            info = await js.consumer_info(NAMES.hostwork_stream, consumer)
            return info.num_pending == 0 and info.num_ack_pending == 0

        await wait_until(taken, timeout=30, what="the instruction taken off the queue")
    finally:
        await nc.close()


def _runs_on(up: Up, sandbox_id: str) -> None:
    ran = up.cli("exec", sandbox_id, "--", "echo", "still here")
    assert ran.returncode == 0 and ran.stdout == "still here\n", ran.stderr
    assert up.cli_json("sandbox", "show", sandbox_id)["phase"] == "running"
