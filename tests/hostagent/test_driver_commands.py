"""Commands through the real driver: real supervisors, processes and cgroups."""

from __future__ import annotations

import asyncio
import os
import uuid

import pytest
from sandhold.hostagent.driver import CommandExit, ProcessDriver
from sandhold.hostagent.driver.handle import CHUNK_BYTES

from .conftest import collect, proc_status

PY = "python3"  # the sandbox's own, from its base (the host's /usr)
SB = "sb1"


@pytest.fixture
async def sandbox(driver: ProcessDriver) -> ProcessDriver:
    await driver.create_sandbox(SB, None)
    return driver


async def test_exit_code_and_output(sandbox: ProcessDriver) -> None:
    handle = await sandbox.launch(
        SB, "c1", ["/bin/sh", "-c", "echo out; echo err >&2; echo more; exit 3"]
    )
    assert isinstance(await handle.started(), int)
    assert not handle.adopted  # woken by the doorbell, not by polling
    stdout, stderr, end = await collect(handle)
    assert (stdout, stderr) == (b"out\nmore\n", b"err\n")
    assert end.reason == "exited"
    assert (end.exit_code, end.signal) == (3, None)
    assert end.started_at is not None and end.ended_at is not None
    assert end.started_at <= end.ended_at


async def test_large_output_comes_in_bounded_chunks_and_resumes_from_offsets(
    sandbox: ProcessDriver,
) -> None:
    size = 300_000
    script = f"import sys; sys.stdout.buffer.write(bytes(i % 251 for i in range({size})))"
    handle = await sandbox.launch(SB, "big", [PY, "-c", script])
    expected = bytes(i % 251 for i in range(size))
    sizes = []
    async with asyncio.timeout(30):
        async for item in handle.watch():
            if isinstance(item, CommandExit):
                assert item.reason == "exited" and item.exit_code == 0
            else:
                sizes.append(len(item.data))
    assert sum(sizes) == size and max(sizes) <= CHUNK_BYTES
    stdout, _, _ = await collect(handle, offsets={"stdout": 100_000})
    assert stdout == expected[100_000:]


async def test_missing_executable_is_launch_failed(sandbox: ProcessDriver) -> None:
    handle = await sandbox.launch(SB, "c1", ["nosuchprog", "--flag"])
    started = await handle.started()
    assert isinstance(started, CommandExit)
    assert started.reason == "launch_failed"
    assert started.detail == "executable not found: nosuchprog"
    _, _, end = await collect(handle)
    assert end == started


async def test_file_that_is_not_executable_is_launch_failed(sandbox: ProcessDriver) -> None:
    (sandbox.workspace(SB) / "script.sh").write_text("echo hi\n")
    end = await (await sandbox.launch(SB, "c1", ["./script.sh"])).wait()
    assert end.reason == "launch_failed"
    assert end.detail == "not an executable file: ./script.sh"


async def test_missing_working_directory_is_launch_failed(sandbox: ProcessDriver) -> None:
    handle = await sandbox.launch(SB, "c1", ["/bin/true"], cwd="/x/does/not/exist")
    end = await handle.wait()
    assert end.reason == "launch_failed"
    assert end.detail == "working directory does not exist: /x/does/not/exist"


async def test_cwd_defaults_to_workspace_and_env_is_not_the_agents(
    sandbox: ProcessDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGENT_SECRET", "do-not-leak")
    workspace = sandbox.workspace(SB)
    (workspace / "sub").mkdir()
    script = 'printf "%s|%s|%s|%s" "$PWD" "$HOME" "$GREETING" "${AGENT_SECRET:-unset}"'
    handle = await sandbox.launch(SB, "c1", ["sh", "-c", script], env={"GREETING": "hello"})
    stdout, _, end = await collect(handle)
    assert end.reason == "exited"
    # Inside its root, the workspace is /workspace and HOME the sandbox user's.
    assert stdout.decode() == "/workspace|/home/sandbox|hello|unset"
    stdout, _, _ = await collect(await sandbox.launch(SB, "c2", ["pwd"], cwd="sub"))
    assert stdout.decode().strip() == "/workspace/sub"


async def test_timeout_sends_term_then_kill_when_term_is_ignored(sandbox: ProcessDriver) -> None:
    script = (
        "import signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "print('ignoring TERM', flush=True)\n"
        "time.sleep(100)\n"
    )
    handle = await sandbox.launch(SB, "c1", [PY, "-c", script], timeout_s=0.5, kill_grace_s=0.5)
    stdout, _, end = await collect(handle)
    assert stdout == b"ignoring TERM\n"
    assert end.reason == "timed_out"
    assert end.signal == 9 and end.exit_code is None
    assert end.ended_at is not None and end.started_at is not None
    assert end.ended_at - end.started_at >= 1.0  # timeout + grace, not earlier


async def test_timeout_reaches_grandchildren_through_the_process_group(
    sandbox: ProcessDriver,
) -> None:
    # The shell waits on a background sleep; TERM must reach the sleep too,
    # or the output pipe it holds would keep the command open.
    handle = await sandbox.launch(
        SB, "c1", ["sh", "-c", "sleep 100 & echo $! > bg.pid; wait"], timeout_s=0.3
    )
    end = await handle.wait()
    assert end.reason == "timed_out" and end.signal == 15
    bg_pid = int((sandbox.workspace(SB) / "bg.pid").read_text())  # its pid inside
    assert inside_pids(sandbox, SB).get(bg_pid) in (None, "Z")


def inside_pids(driver: ProcessDriver, sandbox_id: str) -> dict[int, str]:
    """The sandbox's processes by their pid inside it, with their state letter."""
    found = {}
    for pid in driver.cgroups.pids(sandbox_id):
        try:
            fields = proc_status(pid)
        except OSError:
            continue
        found[int(fields["NSpid"].split()[-1])] = fields["State"][0]
    return found


async def test_interrupt_ends_the_command_as_interrupted(sandbox: ProcessDriver) -> None:
    handle = await sandbox.launch(SB, "c1", ["sleep", "100"], kill_grace_s=5)
    assert isinstance(await handle.started(), int)
    assert await sandbox.interrupt(SB, "c1")
    end = await handle.wait()
    assert end.reason == "interrupted"
    assert end.signal == 15
    assert not await sandbox.interrupt(SB, "c1")  # already over


async def test_same_command_id_launches_once(sandbox: ProcessDriver) -> None:
    argv = ["sh", "-c", "echo ran >> runs.txt"]
    first, second = await asyncio.gather(
        sandbox.launch(SB, "dup", argv), sandbox.launch(SB, "dup", argv)
    )
    third = await sandbox.launch(SB, "dup", argv)
    for handle in (first, second, third):
        assert (await handle.wait()).reason == "exited"
    assert (sandbox.workspace(SB) / "runs.txt").read_text() == "ran\n"


async def test_tmp_is_the_sandboxes_own_never_the_hosts(sandbox: ProcessDriver) -> None:
    name = f"/tmp/sandhold-private-{uuid.uuid4().hex}"
    (sandbox.workspace(SB) / "marker").write_text("visible")
    script = f"echo secret > {name} && cat {name} && cat /workspace/marker"
    stdout, stderr, end = await collect(await sandbox.launch(SB, "c1", ["sh", "-c", script]))
    assert end.reason == "exited", stderr
    assert end.tmp_isolated
    assert stdout == b"secret\nvisible"
    assert not os.path.exists(name)  # the host's /tmp never saw it
    # The sandbox's commands share its /tmp (a tmpfs of the sandbox, never saved).
    stdout, _, end = await collect(await sandbox.launch(SB, "c2", ["cat", name]))
    assert stdout == b"secret\n"


async def test_memory_limit_ends_as_resource_exhausted(driver: ProcessDriver) -> None:
    if not driver.cgroups.enforces_memory_limit:
        pytest.skip(f"no memory limit on this host: {driver.cgroups.message}")
    await driver.create_sandbox("small", 32 * 1024 * 1024)
    hog = "x = b'a' * (200 * 1024 * 1024); print('survived')"
    handle = await driver.launch("small", "hog", [PY, "-c", hog])
    stdout, _, end = await collect(handle)
    assert end.reason == "resource_exhausted", end
    assert end.oom_kills >= 1
    assert end.signal == 9
    assert stdout == b""
    assert driver.cgroups.oom_kills("small", "hog") >= 1
    # The limit is the sandbox's, not the host's: a modest command still runs.
    # Its end is its own, also in the cgroup the hog had: v1 gives an ended
    # command's cgroup to the sandbox's next command (decision 079).
    await driver.mark_reported("small", "hog")
    end = await (await driver.launch("small", "ok", [PY, "-c", "x = b'a' * 1024"])).wait()
    assert (end.reason, end.exit_code, end.oom_kills) == ("exited", 0, 0), end


async def test_launch_in_unknown_sandbox_is_refused(driver: ProcessDriver) -> None:
    from sandhold.hostagent.driver import SandboxNotFound

    with pytest.raises(SandboxNotFound):
        await driver.launch("nope", "c1", ["true"])
    with pytest.raises(ValueError, match="invalid command id"):
        await driver.launch("nope", "../escape", ["true"])
