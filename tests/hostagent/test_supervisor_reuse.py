"""A supervisor whose command ended serves the next one (decision 088).

Real supervisors from the zygote, real boxes: each test reads which process
supervised a command from the `supervisor.json` it wrote, and what the command
saw from its own output.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import resource
import signal
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from sandhold.hostagent.driver import ProcessDriver, pool
from sandhold.hostagent.driver import supervisor as supervisor_module
from sandhold.hostagent.driver.records import read_pid

from tests.support.waiting import wait_until

from .conftest import A, B, collect, init_pid, open_files_limit


def supervised_by(driver: ProcessDriver, sandbox_id: str, command_id: str) -> int:
    paths = driver.layout.command(sandbox_id, command_id)
    return int(json.loads(paths.supervisor.read_text())["pid"])


async def run(
    driver: ProcessDriver, sandbox_id: str, command_id: str, argv: list[str], **options: object
) -> bytes:
    """Run to its end, report it (which gives its supervisor back); its stdout."""
    handle = await driver.launch(sandbox_id, command_id, argv, **options)  # type: ignore[arg-type]
    stdout, stderr, end = await collect(handle)
    assert (end.reason, end.exit_code) == ("exited", 0), (end, stderr)
    await driver.mark_reported(sandbox_id, command_id)
    return stdout


async def test_the_next_command_is_run_by_the_supervisor_given_back_with_only_its_own_spec(
    two: ProcessDriver,
) -> None:
    first = await run(two, A, "c1", ["/bin/sh", "-c", "echo $TOKEN"], secrets={"TOKEN": "s3"})
    assert first == b"s3\n"
    second = await run(two, A, "c2", ["/bin/sh", "-c", "echo ${TOKEN:-none}; echo $MINE"],
                       env={"MINE": "m"})  # fmt: skip
    # The same process, and nothing of the first command's spec: not its secret.
    assert supervised_by(two, A, "c2") == supervised_by(two, A, "c1")
    assert second == b"none\nm\n"


async def test_a_supervisor_given_back_runs_a_command_of_another_sandbox_in_that_sandbox(
    two: ProcessDriver,
) -> None:
    await run(two, A, "c1", ["/bin/sh", "-c", "echo a > only-in-a"])
    handle = await two.launch(B, "c2", ["/bin/sh", "-c", "ls; exec sleep 30"])
    pid = await handle.started()
    assert isinstance(pid, int)
    assert supervised_by(two, B, "c2") == supervised_by(two, A, "c1")
    # Born in B's pid namespace (the supervisor joins it anew for each command),
    # and seeing B's workspace, not A's.
    assert os.readlink(f"/proc/{pid}/ns/pid") == os.readlink(f"/proc/{init_pid(two, B)}/ns/pid")
    assert os.readlink(f"/proc/{pid}/ns/mnt") == os.readlink(f"/proc/{init_pid(two, B)}/ns/mnt")
    assert await two.interrupt(B, "c2", grace_s=0.0)
    stdout, _, end = await collect(handle)
    assert end.reason == "interrupted"
    assert b"only-in-a" not in stdout


async def test_a_signal_that_reaches_a_supervisor_between_commands_is_not_the_next_ones(
    two: ProcessDriver,
) -> None:
    await run(two, A, "c1", ["true"])
    supervisor = supervised_by(two, A, "c1")
    # What an interrupt of c1 sent as c1 ended would leave: a wake-up, pending.
    os.kill(supervisor, signal.SIGUSR1)
    os.kill(supervisor, signal.SIGTERM)
    handle = await two.launch(A, "c2", ["/bin/sh", "-c", "sleep 0.3; echo done"])
    stdout, _, end = await collect(handle)
    assert supervised_by(two, A, "c2") == supervisor
    assert (end.reason, end.exit_code, stdout) == ("exited", 0, b"done\n")


async def test_an_ended_commands_supervisor_is_not_signalled_for_it(two: ProcessDriver) -> None:
    await run(two, A, "c1", ["true"])
    handle = await two.launch(A, "c2", ["sleep", "30"])
    assert isinstance(await handle.started(), int)
    assert supervised_by(two, A, "c2") == supervised_by(two, A, "c1")
    # c1's handle, read from its files: its supervisor now runs c2.
    assert not two.handle(A, "c1").signal_supervisor(signal.SIGKILL)
    assert not await two.interrupt(A, "c1")
    assert read_pid(two.layout.command(A, "c2").pid) is not None
    assert handle.exit_record() is None
    assert await two.interrupt(A, "c2", grace_s=0.0)
    assert (await handle.wait()).reason == "interrupted"


async def test_a_supervisor_is_let_go_after_its_share_of_commands(
    two: ProcessDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pool, "COMMANDS_PER_SUPERVISOR", 2)
    for n in range(3):
        await run(two, A, f"c{n}", ["true"])
    first, second, third = (supervised_by(two, A, f"c{n}") for n in range(3))
    assert first == second != third
    # Let go, it exits (and the zygote reaps it).
    await wait_until(
        lambda: not Path(f"/proc/{first}").exists(), timeout=10, what="the supervisor let go gone"
    )


async def test_a_command_not_reported_keeps_its_supervisor_to_itself(two: ProcessDriver) -> None:
    handle = await two.launch(A, "c1", ["true"])
    assert (await handle.wait()).reason == "exited"
    # Not reported yet: the next command gets another supervisor.
    await run(two, A, "c2", ["true"])
    assert supervised_by(two, A, "c2") != supervised_by(two, A, "c1")


async def test_the_agent_may_hold_more_open_files_than_the_commands_it_starts(
    make_driver: Callable[..., Awaitable[ProcessDriver]],
) -> None:
    with open_files_limit(1024) as hard:
        driver = await make_driver()
        raised, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        # Two descriptors per running command: the agent's limit is the hard one...
        assert raised == (1 << 20 if hard == resource.RLIM_INFINITY else hard)
        await driver.create_sandbox(A, None)
        out = await run(driver, A, "c1", ["/bin/sh", "-c", "ulimit -n"])
        # ...while commands keep the limit they had (the zygote started before).
        assert out == b"1024\n"


async def test_the_next_command_runs_when_the_supervisor_of_the_one_before_died(
    two: ProcessDriver,
) -> None:
    # (Its doorbell hung up, so it is not given back; were it, the hand-over
    # would fail on its closed stdin and the next supervisor be taken.)
    handle = await two.launch(A, "c1", ["true"])
    assert (await handle.wait()).reason == "exited"
    supervisor = supervised_by(two, A, "c1")
    os.kill(supervisor, signal.SIGKILL)
    await wait_until(lambda: not handle.supervisor_alive(), what="its doorbell hung up")
    await two.mark_reported(A, "c1")
    assert await run(two, A, "c2", ["/bin/sh", "-c", "echo ran"]) == b"ran\n"
    assert supervised_by(two, A, "c2") != supervisor


async def test_a_reported_command_whose_directory_is_going_is_not_interrupted_in_the_next(
    two: ProcessDriver,
) -> None:
    await run(two, A, "c1", ["true"])
    handle = await two.launch(B, "c2", ["sleep", "30"])
    assert isinstance(await handle.started(), int)
    assert supervised_by(two, B, "c2") == supervised_by(two, A, "c1")
    # c1's directory half removed (as its removal goes, exit record first):
    # it looks unended, and its supervisor.json names the process running c2.
    c1 = two.layout.command(A, "c1")
    c1.exit.unlink()
    c1.reported.unlink()
    assert not await two.interrupt(A, "c1", grace_s=0.0)
    assert await two.stop_sandbox(A, grace=0.0) == {}
    assert handle.exit_record() is None
    assert await two.interrupt(B, "c2", grace_s=0.0)
    assert (await handle.wait()).reason == "interrupted"


async def test_a_reported_command_whose_directory_is_going_is_not_its_idle_supervisors(
    two: ProcessDriver,
) -> None:
    await run(two, A, "c1", ["true"])
    supervisor = supervised_by(two, A, "c1")
    c1 = two.layout.command(A, "c1")
    # The exit record's fsyncs come after the ring (decision 094): the
    # supervisor is idle once its stderr is no command's log again.
    await wait_until(
        lambda: os.readlink(f"/proc/{supervisor}/fd/2") == os.devnull,
        timeout=10,
        what="the supervisor given back to finish with c1",
    )
    c1.exit.unlink()
    c1.reported.unlink()
    # Given back and idle, its supervisor runs nothing: not c1's any more.
    assert Path(f"/proc/{supervisor}").exists()
    assert not two.handle(A, "c1").supervisor_alive()
    assert not await two.interrupt(A, "c1", grace_s=0.0)
    assert await run(two, A, "c2", ["/bin/sh", "-c", "echo fine"]) == b"fine\n"
    assert supervised_by(two, A, "c2") == supervisor


async def test_supervisors_started_without_the_zygote_keep_the_commands_limit_of_open_files(
    make_driver: Callable[..., Awaitable[ProcessDriver]], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_zygote(*_: object) -> None:
        raise OSError("no zygote in this test")

    monkeypatch.setattr(pool.Zygote, "__init__", no_zygote)
    with open_files_limit(1024):
        # No pool started ahead: the command's supervisor starts after the agent
        # raised its own limit, as a new interpreter.
        driver = await make_driver(isolation="process", warm=0)
        await driver.create_sandbox(A, None)
        assert await run(driver, A, "c1", ["/bin/sh", "-c", "ulimit -n"]) == b"1024\n"


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"


def _resume(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


BIG = "x" * (100 << 10)  # over the pipe's buffer (64 KiB): its line goes in parts
SAYS_SIZE = ["/bin/sh", "-c", "echo ${#BIG}"]


async def test_a_supervisor_slow_to_read_its_command_holds_up_that_command_alone(
    two: ProcessDriver,
) -> None:
    await run(two, A, "c1", ["true"])
    slow = supervised_by(two, A, "c1")  # given back: the next command's
    os.kill(slow, signal.SIGSTOP)
    # So that an agent whose loop blocks in the write is not stuck for ever here.
    rescued = threading.Event()
    rescue = threading.Timer(30, lambda: (rescued.set(), _resume(slow)))
    rescue.start()
    cleanup: list[asyncio.Task[object]] = []
    try:
        launching = asyncio.create_task(two.launch(A, "c2", SAYS_SIZE, secrets={"BIG": BIG}))
        cleanup.append(launching)
        paths = two.layout.command(A, "c2")
        # The loop goes on while the stopped supervisor holds the line's rest: the
        # launch is seen waiting in its hand-over (begun, its spec not written).
        await wait_until(
            lambda: paths.directory.is_dir() and not paths.spec.exists() and _state(slow) == "T",
            timeout=10,
        )
        assert not rescued.is_set() and not launching.done()
        os.kill(slow, signal.SIGCONT)
        stdout, _, end = await collect(await launching)
    finally:
        rescue.cancel()
        _resume(slow)
        for task in cleanup:  # (a failure above leaves the launch to end here)
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
    assert (end.reason, stdout) == ("exited", f"{len(BIG)}\n".encode())
    assert supervised_by(two, A, "c2") == slow


async def test_a_supervisor_that_does_not_take_its_command_is_let_go_for_another(
    two: ProcessDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pool, "HAND_OVER_S", 2.0)  # (the one that reads has time enough)
    await run(two, A, "c1", ["true"])
    stuck = supervised_by(two, A, "c1")
    os.kill(stuck, signal.SIGSTOP)
    rescue = threading.Timer(30, _resume, (stuck,))  # (as above)
    rescue.start()
    try:
        handle = await two.launch(A, "c2", SAYS_SIZE, secrets={"BIG": BIG})
        stdout, _, end = await collect(handle)
    finally:
        rescue.cancel()
        _resume(stuck)
    assert (end.reason, stdout) == ("exited", f"{len(BIG)}\n".encode())
    assert supervised_by(two, A, "c2") != stuck
    # Let go with a part of a line: once it runs again it takes no command and exits.
    await wait_until(lambda: _state(stuck) in ("Z", "gone"), timeout=20)


def test_a_part_of_a_line_before_its_end_is_no_command() -> None:
    # What a supervisor let go midway through its hand-over reads: even a part
    # that is a whole JSON object is not run (the command went to another).
    lines = supervisor_module.command_lines(io.BytesIO(b'{"a": 1}\n{"command_dir": "/x"}'))
    assert list(lines) == [b'{"a": 1}\n']


async def test_a_hand_over_waiting_on_a_supervisor_let_go_ends_at_once() -> None:
    # The driver closing (every handle detached) lets go of a supervisor whose
    # hand-over waits for its pipe to drain: the wait ends then, not after
    # HAND_OVER_S, and the loop no longer watches the closed descriptor.
    stdin_r, stdin_w = os.pipe()
    os.set_blocking(stdin_w, False)  # (as `pool._announced` leaves it)
    waiting = pool.WarmSupervisor(pid=0, stdin_fd=stdin_w, doorbell_fd=-1)
    try:
        handing = asyncio.create_task(waiting.hand_over(Path("/nowhere"), {}, {"BIG": BIG}))
        await wait_until(lambda: waiting._drained is not None, timeout=10)
        waiting.let_go()
        with pytest.raises(BrokenPipeError):
            async with asyncio.timeout(5):  # (well short of HAND_OVER_S)
                await handing
        assert waiting._drained is None and waiting.stdin_fd == -1
        assert waiting.handed == 0
        with pytest.raises(BrokenPipeError):  # and it is handed nothing more
            await waiting.hand_over(Path("/nowhere"), {})
    finally:
        os.close(stdin_r)
