"""Fixtures for the process driver: a host root per test, and a reaper.

Supervisors are detached on purpose (they must outlive the agent), so nothing
kills them when a test fails. The reaper does, by pid: every supervisor whose
command line names this test's root, every command process group recorded
under it, and everything left in this host's cgroups.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import shutil
import signal
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import nats
import pytest
from sandhold.bus.names import Names
from sandhold.hostagent.driver import (
    CommandExit,
    CommandHandle,
    OutputChunk,
    ProcessDriver,
    V2Cgroups,
    detect_cgroups,
)
from sandhold.hostagent.driver.cgroups import parse_mounts
from sandhold.hostagent.driver.owners import REGISTER
from sandhold.hostagent.driver.pool import SUPERVISOR_MODULE
from sandhold.hostagent.driver.process_identity import ProcessIdentity

from tests.e2e.harness import forget_connections, unmount_under
from tests.hostagent.dispatching import Dispatched, dispatched


def supervisor_pids(root: Path) -> list[int]:
    """Pids of the supervisors started for ``root`` (from their command lines)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if SUPERVISOR_MODULE.encode() in argv and str(root).encode() in argv:
            found.append(int(entry))
    return found


def _kill_command_groups(root: Path) -> None:
    for pid_file in root.glob("sandboxes/*/commands/*/pid"):
        with contextlib.suppress(ValueError, OSError):
            pid = int(pid_file.read_text())
            # Only a session we created: the command is its session leader.
            if os.getsid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)


def _kill_boxes(root: Path) -> None:
    """Each sandbox's box, by its init's identity (killing pid 1 ends the box)."""
    for box in root.glob("sandboxes/*/box.json"):
        with contextlib.suppress(OSError, ValueError, KeyError):
            ProcessIdentity.from_json(json.loads(box.read_text())["init"]).send(signal.SIGKILL)


def reap(root: Path, host_id: str) -> None:
    _kill_boxes(root)
    for pid in supervisor_pids(root):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    _kill_command_groups(root)
    # Tests may use the unified hierarchy directly, besides the detected one.
    backends = [detect_cgroups(host_id)] + [V2Cgroups(m, host_id) for m in unified_mounts()]
    for cgroups in backends:
        for sandbox_dir in (root / "sandboxes").glob("*"):
            with contextlib.suppress(OSError):
                cgroups.kill_all(sandbox_dir.name)
                cgroups.remove(sandbox_dir.name)
        cgroups.remove_host()
    unmount_under(root)
    forget_connections(root)
    shutil.rmtree(REGISTER / host_id, ignore_errors=True)


def unified_mounts() -> list[Path]:
    """Writable cgroup v2 mounts of this machine."""
    return [
        mount.target
        for mount in parse_mounts(Path("/proc/self/mounts").read_text())
        if mount.fstype == "cgroup2" and "ro" not in mount.options
    ]


@pytest.fixture
def host_id() -> str:
    return f"test-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def root(tmp_path: Path, host_id: str) -> Iterator[Path]:
    root = tmp_path / "hosts" / host_id
    try:
        yield root
    finally:
        reap(root, host_id)


@pytest.fixture
async def make_driver(
    root: Path, host_id: str
) -> AsyncIterator[Callable[..., Awaitable[ProcessDriver]]]:
    """Start drivers on this test's root; all are closed at the end (close is idempotent)."""
    drivers: list[ProcessDriver] = []

    async def make(**options: object) -> ProcessDriver:
        driver = ProcessDriver(root, host_id, **options)  # type: ignore[arg-type]
        drivers.append(driver)
        await driver.start()
        return driver

    try:
        yield make
    finally:
        # close() only dismisses idle supervisors; the reaper (root) kills the rest.
        for driver in drivers:
            await driver.close()


@pytest.fixture
async def driver(make_driver: Callable[..., Awaitable[ProcessDriver]]) -> ProcessDriver:
    return await make_driver()


# Two sandboxes on one driver: tests that look across a sandbox's edge.
A, B = "sb-a", "sb-b"


@pytest.fixture
async def two(driver: ProcessDriver) -> ProcessDriver:
    await driver.create_sandbox(A, None)
    await driver.create_sandbox(B, None)
    return driver


async def collect(
    handle: CommandHandle, offsets: dict[str, int] | None = None, timeout: float = 30.0
) -> tuple[bytes, bytes, CommandExit]:
    """Everything ``watch`` yields: stdout, stderr, and the exit (within a deadline)."""
    out = {"stdout": b"", "stderr": b""}
    async with asyncio.timeout(timeout):
        async for item in handle.watch(offsets):
            if isinstance(item, OutputChunk):
                assert item.offset == (offsets or {}).get(item.stream, 0) + len(out[item.stream])
                out[item.stream] += item.data
            else:
                return out["stdout"], out["stderr"], item
    raise AssertionError("watch ended without an exit")


def proc_status(pid: int) -> dict[str, str]:
    """The fields of `/proc/<pid>/status` by name (raises OSError once it is gone)."""
    status = Path(f"/proc/{pid}/status").read_text()
    return dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)


def init_pid(driver: ProcessDriver, sandbox_id: str) -> int:
    """The host pid of the sandbox's box init."""
    assert driver.boxes is not None
    state = driver.boxes.state(sandbox_id)
    assert state is not None
    return state.init.pid


@contextlib.contextmanager
def open_files_limit(soft: int) -> Iterator[int]:
    """This process's soft limit of open files at `soft` (the usual default),
    the hard one kept; restored after. Yields the hard limit."""
    was, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= soft:
        pytest.fail(f"this test needs a hard limit of open files above {soft}, not {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        yield hard
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (was, hard))


@pytest.fixture
async def dispatch(
    nc: nats.NATS, nats_url: str, names: Names, driver: ProcessDriver, host_id: str, root: Path
) -> AsyncIterator[Callable[[list[str]], Awaitable[Dispatched]]]:
    """`await dispatch(argv)`: a command dispatched to this host (`dispatching`);
    the watchers of every agent made are cancelled at the end."""
    watched: list[Dispatched] = []

    async def dispatch(argv: list[str]) -> Dispatched:
        command = await dispatched(nc, nats_url, names, driver, host_id, root, argv)
        watched.append(command)
        return command

    try:
        yield dispatch
    finally:
        for command in watched:
            for watcher in list(command.agent._watchers.values()):
                watcher.cancel()
