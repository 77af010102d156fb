"""Sandbox-wide operations: stop, destroy, freeze/thaw; and a host without cgroups."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from sandhold.hostagent.driver import NoCgroups, ProcessDriver, V1Cgroups, V2Cgroups
from sandhold.hostagent.driver.boxes import BOX_CGROUP

from tests.support.waiting import wait_until

from .conftest import collect, unified_mounts

PY = "python3"  # the sandbox's own, from its base (the host's /usr)
SB = "sb1"
MakeDriver = Callable[..., Awaitable[ProcessDriver]]

COUNTER = (
    "import itertools, os\n"
    "for n in itertools.count():\n"
    "    with open('counter.tmp', 'w') as f:\n"
    "        f.write(str(n))\n"
    "    os.replace('counter.tmp', 'counter')\n"
)


def _counter(workspace: Path) -> int:
    try:
        return int((workspace / "counter").read_text())
    except (FileNotFoundError, ValueError):
        return -1


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


async def test_stop_interrupts_commands_and_ends_background_jobs(driver: ProcessDriver) -> None:
    await driver.create_sandbox(SB, None)
    # A finished command that left a background job behind, in its own session.
    leaver = await driver.launch(
        SB, "leaver", ["sh", "-c", "setsid sleep 100 > /dev/null 2>&1 < /dev/null &"]
    )
    assert (await leaver.wait()).reason == "exited"
    running = [await driver.launch(SB, f"c{i}", ["sleep", "100"]) for i in range(2)]
    for handle in running:
        assert isinstance(await handle.started(), int)
    exits = await driver.stop_sandbox(SB, grace=2.0)
    assert {cid: end.reason for cid, end in exits.items()} == {
        "c0": "interrupted",
        "c1": "interrupted",
    }
    if driver.cgroups.kind != "none":
        assert driver.cgroups.pids(SB) == []


async def test_destroy_kills_everything_and_removes_the_sandbox(driver: ProcessDriver) -> None:
    await driver.create_sandbox(SB, 64 * 1024 * 1024)
    handle = await driver.launch(SB, "c1", ["sleep", "100"])
    assert isinstance(await handle.started(), int)
    await driver.destroy_sandbox(SB)
    assert not driver.layout.sandbox_dir(SB).exists()
    assert driver.cgroups.pids(SB) == []
    if isinstance(driver.cgroups, V1Cgroups):
        assert not (Path("/sys/fs/cgroup/memory/sandhold") / driver.host_id / SB).exists()
    await driver.destroy_sandbox(SB)  # idempotent


async def test_freeze_stops_the_sandbox_and_thaw_resumes_it(driver: ProcessDriver) -> None:
    if not driver.cgroups.can_freeze:
        pytest.skip(f"no cgroup freezer on this host: {driver.cgroups.message}")
    await driver.create_sandbox(SB, None)
    workspace = driver.workspace(SB)
    handle = await driver.launch(SB, "counter", [PY, "-c", COUNTER])
    await wait_until(lambda: _counter(workspace) > 10, what="the counter runs")
    await driver.freeze(SB)
    try:
        frozen_at = _counter(workspace)
        # Proving that nothing happens takes a span of time, not a state change.
        await asyncio.sleep(0.3)
        assert _counter(workspace) == frozen_at
    finally:
        await driver.thaw(SB)
    await wait_until(lambda: _counter(workspace) > frozen_at + 10, what="the counter resumes")
    assert await driver.interrupt(SB, "counter", grace_s=1.0)
    assert (await handle.wait()).reason == "interrupted"


async def test_freeze_falls_back_to_sigstop_without_cgroups(make_driver: MakeDriver) -> None:
    driver = await make_driver(cgroups=NoCgroups("no cgroups in this test"))
    await driver.create_sandbox(SB, None)
    workspace = driver.workspace(SB)
    handle = await driver.launch(SB, "counter", [PY, "-c", COUNTER])
    await wait_until(lambda: _counter(workspace) > 10, what="the counter runs")
    child = await handle.started()
    assert isinstance(child, int)
    await driver.freeze(SB)
    try:
        await wait_until(lambda: _state(child) == "T", what="the command is stopped")
        stopped_at = _counter(workspace)
        await asyncio.sleep(0.3)
        assert _counter(workspace) == stopped_at
    finally:
        await driver.thaw(SB)
    await wait_until(lambda: _counter(workspace) > stopped_at + 10, what="the counter resumes")
    await driver.stop_sandbox(SB, grace=1.0)
    assert (await handle.wait()).reason == "interrupted"


async def test_without_cgroups_commands_run_and_capabilities_say_what_is_missing(
    make_driver: MakeDriver,
) -> None:
    driver = await make_driver(cgroups=NoCgroups("no cgroups in this test"))
    capabilities = driver.capabilities()
    assert capabilities["cgroup"] == "none"
    assert capabilities["memory_limit"] is False
    assert "no cgroups in this test" in capabilities["message"]
    await driver.create_sandbox(SB, 32 * 1024 * 1024)
    stdout, _, end = await collect(await driver.launch(SB, "c1", ["echo", "hi"]))
    assert (stdout, end.reason, end.oom_kills) == (b"hi\n", "exited", 0)


async def test_capabilities_on_this_host(driver: ProcessDriver) -> None:
    capabilities = driver.capabilities()
    assert capabilities["cgroup"] == driver.cgroups.kind
    assert capabilities["driver"] == "namespaces"
    assert capabilities["user"] == "mapped"
    assert capabilities["network"] == "none"
    assert capabilities["seccomp"] is True  # libseccomp is on this machine
    assert capabilities["tmp_isolation"] is True
    assert "namespaces" in capabilities["message"]
    assert "full isolation" not in capabilities["message"]


async def test_the_process_driver_says_it_is_unisolated(make_driver: MakeDriver) -> None:
    driver = await make_driver(isolation="process")
    capabilities = driver.capabilities()
    assert (capabilities["driver"], capabilities["user"]) == ("process", "host-root")
    assert capabilities["seccomp"] is False
    assert "UNISOLATED" in capabilities["message"]


async def test_tmp_isolation_can_be_switched_off(make_driver: MakeDriver) -> None:
    driver = await make_driver(isolation="process", isolate_tmp=False)
    assert driver.capabilities()["tmp_isolation"] is False
    await driver.create_sandbox(SB, None)
    end = await (await driver.launch(SB, "c1", ["true"])).wait()
    assert end.reason == "exited"
    assert not end.tmp_isolated and end.tmp_detail == "private /tmp disabled"


async def test_cgroup_v2_freeze_kill_and_remove_on_the_unified_hierarchy(
    make_driver: MakeDriver, host_id: str
) -> None:
    """Real cgroup v2 operations, even where v2 lacks the memory controller."""
    mounts = unified_mounts()
    if not mounts:
        pytest.skip("no writable cgroup v2 hierarchy on this machine")
    cgroups = V2Cgroups(mounts[0], host_id)
    driver = await make_driver(cgroups=cgroups)
    await driver.create_sandbox(SB, None)
    workspace = driver.workspace(SB)
    handle = await driver.launch(SB, "counter", [PY, "-c", COUNTER])
    child = await handle.started()
    assert isinstance(child, int)
    assert child in cgroups.pids(SB)  # with the sandbox's init beside it
    await wait_until(lambda: _counter(workspace) > 10, what="the counter runs")
    await driver.freeze(SB)
    try:
        frozen_at = _counter(workspace)
        await asyncio.sleep(0.3)
        assert _counter(workspace) == frozen_at
    finally:
        await driver.thaw(SB)
    await wait_until(lambda: _counter(workspace) > frozen_at + 10, what="the counter resumes")
    await driver.destroy_sandbox(SB)
    assert not (mounts[0] / "sandhold" / host_id / SB).exists()
    assert not Path(f"/proc/{child}").exists()


async def test_stopping_a_frozen_sandbox_thaws_it_first(driver: ProcessDriver) -> None:
    if not driver.cgroups.can_freeze:
        pytest.skip(f"no cgroup freezer on this host: {driver.cgroups.message}")
    await driver.create_sandbox(SB, None)
    handle = await driver.launch(SB, "c1", ["sleep", "100"])
    assert isinstance(await handle.started(), int)
    await driver.freeze(SB)
    exits = await driver.stop_sandbox(SB, grace=2.0)
    assert exits["c1"].reason == "interrupted"


async def test_warm_supervisors_are_published_and_never_more_are_kept(
    make_driver: MakeDriver,
) -> None:
    driver = await make_driver(warm=2)
    assert driver.capabilities()["warm_supervisors"] == 2
    await driver.create_sandbox(SB, 32 * 1024 * 1024)
    assert "warm_supervisors" not in driver.sandbox_capabilities(SB)  # the host's figure
    # A burst of launches takes more supervisors than the pool holds; once they
    # end and the pool refilled, only the pool's size wait idle.
    handles = [await driver.launch(SB, f"c{i}", ["true"]) for i in range(6)]
    for handle in handles:
        assert (await collect(handle))[2].reason == "exited"
    # Refilled, and nothing more on its way (a refill leaves the spawning set in
    # a done callback, a moment after it joined the idle ones: both are waited for).
    await wait_until(
        lambda: driver._pool.idle == 2 and not driver._pool._spawning,
        what="the pool refilled to its size, nothing more starting",
    )


async def test_a_sandbox_is_quiet_only_while_nothing_but_its_box_runs(
    driver: ProcessDriver,
) -> None:
    """What a save records as `quiet` (decision 051): a command, or a job a
    finished command left behind, is something that can still change files."""
    if driver.cgroups.kind == "none":
        pytest.skip(f"no cgroups on this host: {driver.cgroups.message}")
    await driver.create_sandbox(SB, None)
    assert driver.quiet(SB)
    leaver = await driver.launch(
        SB, "leaver", ["sh", "-c", "setsid sleep 100 > /dev/null 2>&1 < /dev/null &"]
    )
    assert (await leaver.wait()).reason == "exited"
    assert not driver.quiet(SB)  # its job still runs
    left = set(driver.cgroups.pids(SB)) - set(driver.cgroups.pids(SB, BOX_CGROUP))
    assert left
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    await wait_until(lambda: driver.quiet(SB), what="the job is gone")
    running = await driver.launch(SB, "c1", ["sleep", "100"])
    assert isinstance(await running.started(), int)
    assert not driver.quiet(SB)
    assert await driver.interrupt(SB, "c1", grace_s=1.0)
    assert (await running.wait()).reason == "interrupted"
    await wait_until(lambda: driver.quiet(SB), what="the command is gone")


async def test_without_cgroups_a_sandbox_is_never_known_to_be_quiet(
    make_driver: MakeDriver,
) -> None:
    driver = await make_driver(cgroups=NoCgroups("no cgroups in this test"))
    await driver.create_sandbox(SB, None)
    assert not driver.quiet(SB)  # it cannot tell, so every scheduled save is taken


async def test_a_command_is_born_in_its_own_cgroup_on_every_hierarchy(
    driver: ProcessDriver,
) -> None:
    """The child joins them between fork and exec (`join_self`), so nothing it
    forks is ever outside them."""
    if driver.cgroups.kind == "none":
        pytest.skip(f"no cgroups on this host: {driver.cgroups.message}")
    await driver.create_sandbox(SB, None)
    handle = await driver.launch(SB, "c1", ["sh", "-c", "sleep 100 & sleep 100"])
    assert isinstance(await handle.started(), int)
    await wait_until(lambda: len(driver.cgroups.pids(SB, "c1")) == 3, what="sh and two sleeps")
    for pid in driver.cgroups.pids(SB, "c1"):
        ours = [
            line for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines()
            if "/sandhold/" in line
        ]  # fmt: skip
        assert len(ours) >= (2 if driver.cgroups.kind == "v1" else 1)  # memory, freezer, …
        # Its own cgroup where it has one (memory: OOM kills counted per command),
        # the sandbox's where only the sandbox's limit is (v1 pids, cpu).
        assert all(line.endswith((f"/{SB}/c1", f"/{SB}")) for line in ours), ours
        assert any(line.endswith(f"/{SB}/c1") for line in ours), ours
    assert await driver.interrupt(SB, "c1", grace_s=1.0)
    assert (await handle.wait()).reason == "interrupted"
