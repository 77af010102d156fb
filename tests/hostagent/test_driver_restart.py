"""Supervisors outlive the driver; a new driver adopts what they did meanwhile."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Awaitable, Callable

from sandhold.hostagent.driver import ProcessDriver
from sandhold.hostagent.driver.handle import LAUNCH_CONFIRM_S
from sandhold.hostagent.driver.process_identity import ProcessIdentity, parse_stat
from sandhold.hostagent.driver.records import CommandSpec, write_json

from tests.support.waiting import wait_until

from .conftest import collect

PY = "python3"  # the sandbox's own, from its base (the host's /usr)
SB = "sb1"
MakeDriver = Callable[..., Awaitable[ProcessDriver]]

# Prints, then waits for the test to create "go" in the workspace, prints again.
TWO_PHASE = (
    "import os, sys, time\n"
    "print('first', flush=True)\n"
    "while not os.path.exists('go'):\n"
    "    time.sleep(0.01)\n"
    "print('second', flush=True)\n"
    "sys.exit(7)\n"
)


async def _go(driver: ProcessDriver, command_id: str = "go") -> None:
    # Made inside the sandbox: a file written into a mounted overlay's upper
    # layer from outside may stay unseen (overlayfs caches the lookup).
    end = await (await driver.launch(SB, command_id, ["touch", "go"])).wait()
    assert end.reason == "exited"
    await driver.mark_reported(SB, command_id)


def _supervisor_pid(driver: ProcessDriver, command_id: str) -> int:
    raw = json.loads(driver.layout.command(SB, command_id).supervisor.read_text())
    return int(raw["pid"])


async def test_command_outlives_the_driver_and_is_adopted(make_driver: MakeDriver) -> None:
    first = await make_driver()
    await first.create_sandbox(SB, None)
    handle = await first.launch(SB, "c1", [PY, "-c", TWO_PHASE])
    seen = b""
    async for item in handle.watch():
        seen += getattr(item, "data", b"")
        if seen == b"first\n":
            break
    supervisor = ProcessIdentity.of(_supervisor_pid(first, "c1"))
    assert supervisor is not None
    await first.close()
    assert supervisor.is_alive()

    second = await make_driver()
    adopted = {h.command_id: h for h in await second.adopt_all()}
    assert set(adopted) == {"c1"}
    assert adopted["c1"].adopted
    await _go(second)
    stdout, _, end = await collect(adopted["c1"], offsets={"stdout": len(seen)})
    assert stdout == b"second\n"
    assert (end.reason, end.exit_code) == ("exited", 7)
    await wait_until(lambda: not supervisor.is_alive(), what="supervisor exits after the exit")


async def test_exit_written_while_no_driver_runs_is_read_after_restart(
    make_driver: MakeDriver,
) -> None:
    first = await make_driver()
    await first.create_sandbox(SB, None)
    handle = await first.launch(SB, "c1", [PY, "-c", TWO_PHASE])
    assert isinstance(await handle.started(), int)
    await first.close()
    helper = await make_driver()  # only to make "go" inside; it adopts nothing
    await _go(helper, "go-while-closed")
    await helper.close()
    exit_file = first.layout.command(SB, "c1").exit
    await wait_until(exit_file.exists, what="the supervisor records the exit on its own")

    second = await make_driver()
    [adopted] = await second.adopt_all()
    stdout, _, end = await collect(adopted)
    assert stdout == b"first\nsecond\n"
    assert end.exit_code == 7
    await second.mark_reported(SB, "c1")
    assert await second.adopt_all() == []


async def test_killed_supervisor_with_its_child_gone_is_unknown(driver: ProcessDriver) -> None:
    await driver.create_sandbox(SB, None)
    handle = await driver.launch(SB, "c1", ["sleep", "100"])
    child = await handle.started()
    assert isinstance(child, int)
    os.kill(_supervisor_pid(driver, "c1"), signal.SIGKILL)
    os.killpg(child, signal.SIGKILL)
    end = await handle.wait()
    assert end.reason == "unknown"
    assert end.detail == "supervisor vanished without an exit record"


async def test_vanished_supervisor_is_unknown_for_an_adopting_driver(
    make_driver: MakeDriver,
) -> None:
    first = await make_driver()
    await first.create_sandbox(SB, None)
    handle = await first.launch(SB, "c1", ["sleep", "100"])
    child = await handle.started()
    assert isinstance(child, int)
    await first.close()
    os.kill(_supervisor_pid(first, "c1"), signal.SIGKILL)
    os.killpg(child, signal.SIGKILL)
    second = await make_driver()
    [adopted] = await second.adopt_all()
    _, _, end = await collect(adopted)
    assert (end.reason, end.detail) == ("unknown", "supervisor vanished without an exit record")


async def test_command_never_handed_to_a_supervisor_is_unknown(driver: ProcessDriver) -> None:
    # What an agent crash between mkdir and hand-over leaves behind.
    await driver.create_sandbox(SB, None)
    paths = driver.layout.command(SB, "orphan")
    paths.directory.mkdir()
    spec = CommandSpec(sandbox_id=SB, command_id="orphan", argv=["true"], cwd="/", env={})
    write_json(paths.spec, spec.to_json())
    old = time.time() - LAUNCH_CONFIRM_S - 1
    os.utime(paths.spec, (old, old))
    [handle] = await driver.adopt_all()
    end = await handle.wait()
    assert end.reason == "unknown"
    assert "never confirmed" in end.detail
    # Launching it again adopts the record instead of running it now.
    again = await driver.launch(SB, "orphan", ["true"])
    assert (await again.wait()).reason == "unknown"


def test_process_identity_parses_odd_command_names() -> None:
    line = "42 (a) b (c) S 1 42 42 0 -1 4194560 1 0 0 0 0 0 0 0 20 0 1 0 987654 1 1"
    assert parse_stat(line) == ("S", 987654)
    me = ProcessIdentity.of(os.getpid())
    assert me is not None and me.is_alive()
    assert not ProcessIdentity(me.pid, me.start_ticks + 1, me.boot_id).is_alive()
    assert not ProcessIdentity(me.pid, me.start_ticks, "another-boot").is_alive()
