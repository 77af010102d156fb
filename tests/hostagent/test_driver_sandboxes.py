"""Sandbox-wide operations: stop, destroy, freeze/thaw; and a host without cgroups."""

from __future__ import annotations

import array
import asyncio
import fcntl
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from sandhold.hostagent.driver import NoCgroups, ProcessDriver, V1Cgroups, V2Cgroups
from sandhold.hostagent.driver import cgroups as cgroups_module
from sandhold.hostagent.driver import driver as driver_module
from sandhold.hostagent.driver import layout as layout_module
from sandhold.hostagent.driver.boxes import BOX_CGROUP
from sandhold.hostagent.driver.layout import FS_TOPDIR_FL, inode_flags
from sandhold.hostagent.driver.owners import others_of
from sandhold.hostagent.driver.pool import ZYGOTE_MODULE

from tests.support.waiting import wait_until

from .conftest import collect, open_files_limit, unified_mounts

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


async def test_a_box_starts_under_the_usual_limit_of_1024_open_files(
    make_driver: MakeDriver,
) -> None:
    # (The box's starter once moved descriptors to 4,096 and up: refused there.)
    with open_files_limit(1024):
        driver = await make_driver()  # it proves a box starts
        await driver.create_sandbox("sb-00000000000a0d03", None)
    handle = await driver.launch("sb-00000000000a0d03", "c1", ["true"])
    assert (await handle.wait()).reason == "exited"


async def test_a_sandboxs_command_directories_are_spread_over_the_disk(
    driver: ProcessDriver,
) -> None:
    # Decision 090: its commands directory is a top directory (`chattr +T`) on
    # ext2/3/4 (this machine's /tmp), set again by an agent's start for one made
    # before; elsewhere (tmpfs, xfs, btrfs refuse the flag) nothing is set and
    # commands run all the same.
    await driver.create_sandbox(SB, None)
    commands = driver.layout.commands_dir(SB)
    kind = subprocess.run(
        ["stat", "-f", "-c", "%T", str(commands)], capture_output=True, text=True, check=True
    ).stdout.strip()
    if kind.startswith("ext"):
        flags = inode_flags(commands)
        assert flags is not None and flags & FS_TOPDIR_FL
        # and every sandbox's directory apart from the others' (set at start)
        assert (inode_flags(commands.parent.parent) or 0) & FS_TOPDIR_FL
        fd = os.open(commands, os.O_RDONLY | os.O_DIRECTORY)
        try:
            cleared = array.array("i", [flags & ~FS_TOPDIR_FL])
            fcntl.ioctl(fd, layout_module._FS_IOC_SETFLAGS, cleared, True)
        finally:
            os.close(fd)
        assert not (inode_flags(commands) or 0) & FS_TOPDIR_FL
        await driver.adopt_all()
        assert (inode_flags(commands) or 0) & FS_TOPDIR_FL
    handle = await driver.launch(SB, "c1", ["true"])
    assert (await handle.wait()).reason == "exited"


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


async def test_a_sandbox_with_nothing_left_running_stops_without_waiting_out_its_grace(
    driver: ProcessDriver,
) -> None:
    """Only commands and what they left behind are asked to end; the box's own
    processes (its pid 1 ignores TERM) go with the cgroup kill at once."""
    await driver.create_sandbox(SB, None)
    _, _, end = await collect(await driver.launch(SB, "once", ["true"]))
    assert end.reason == "exited"
    async with asyncio.timeout(60):  # against a grace of 600 s
        assert await driver.stop_sandbox(SB, grace=600.0) == {}
    assert driver.cgroups.kind == "none" or driver.cgroups.pids(SB) == []


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
    _, _, end = await collect(await driver.launch(SB, "once", ["true"]))
    assert end.reason == "exited" and (mounts[0] / "sandhold" / host_id / SB / "once").is_dir()
    await driver.mark_reported(SB, "once")  # its cgroup goes with its report
    assert not (mounts[0] / "sandhold" / host_id / SB / "once").exists()
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


async def test_warm_supervisors_are_published_and_at_most_four_times_as_many_are_kept(
    make_driver: MakeDriver, root: Path
) -> None:
    driver = await make_driver(warm=2)
    assert driver.capabilities()["warm_supervisors"] == 2
    await driver.create_sandbox(SB, 32 * 1024 * 1024)
    assert "warm_supervisors" not in driver.sandbox_capabilities(SB)  # the host's figure
    # A burst of launches takes more supervisors than the pool holds; once their
    # ends are reported they are given back (decision 088), and beyond four
    # times the pool's size they are let go: they exit.
    handles = [await driver.launch(SB, f"c{i}", ["sleep", "0.5"]) for i in range(12)]
    for handle in handles:
        assert (await collect(handle))[2].reason == "exited"
    for i in range(12):
        await driver.mark_reported(SB, f"c{i}")
    await wait_until(
        lambda: driver._pool.idle == 8 and not driver._pool._spawning,
        what="eight given back kept idle, nothing more starting",
    )
    [zygote] = [
        int(d.name)
        for d in Path("/proc").iterdir()
        if d.name.isdigit()
        and _reads(d / "cmdline").startswith(
            b"%s\0-m\0%s" % (sys.executable.encode(), ZYGOTE_MODULE.encode())
        )
        and str(root).encode() in _reads(d / "cmdline")
        and _reads(d / "stat").rsplit(b")", 1)[1].split()[1] == str(os.getpid()).encode()
    ]
    await wait_until(
        lambda: len(_reads(Path(f"/proc/{zygote}/task/{zygote}/children")).split()) == 8,
        what="the supervisors let go gone, the eight kept still there",
    )


def _reads(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


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


def _command_cgroups(host_id: str, command_id: str) -> list[Path]:
    """The command's own cgroup in every hierarchy mounted here."""
    return sorted(Path("/sys/fs/cgroup").glob(f"**/sandhold/{host_id}/{SB}/{command_id}"))


async def test_a_commands_cgroups_go_once_its_end_is_reported(
    driver: ProcessDriver, host_id: str
) -> None:
    """A long-lived sandbox must not keep a cgroup per command it ever ran (the
    kernel allows 65,535 memory cgroups; a freeze's look walks them all). One a
    left-behind process still holds goes at a later end, once it is empty."""
    if driver.cgroups.kind == "none":
        pytest.skip(f"no cgroups on this host: {driver.cgroups.message}")
    await driver.create_sandbox(SB, None)
    for n in range(3):
        _, _, end = await collect(await driver.launch(SB, f"c{n}", ["true"]))
        assert end.reason == "exited"
        assert _command_cgroups(host_id, f"c{n}")  # until its end is in the log
        await driver.mark_reported(SB, f"c{n}")
        assert _command_cgroups(host_id, f"c{n}") == []
    # A command that leaves a process behind: its cgroup stays while it runs.
    handle = await driver.launch(SB, "bg", ["sh", "-c", "sleep 300 >/dev/null 2>&1 &"])
    _, _, end = await collect(handle)
    assert end.reason == "exited"
    await driver.mark_reported(SB, "bg")
    assert _command_cgroups(host_id, "bg")
    left = driver.cgroups.pids(SB, "bg")
    assert left  # the sleep
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    await wait_until(lambda: driver.cgroups.pids(SB, "bg") == [], what="the left process gone")
    await driver.mark_reported(SB, (await _ended(driver, "next")))
    assert _command_cgroups(host_id, "bg") == [] and _command_cgroups(host_id, "next") == []


async def test_an_ended_commands_cgroups_serve_the_sandboxs_next_commands(
    driver: ProcessDriver, host_id: str
) -> None:
    """On v1 an ended command's empty cgroups are renamed for the sandbox's next
    command, not removed and made anew: removing a memory cgroup costs the
    kernel a walk of every mount's object lists under the global cgroup lock
    (decision 079). A sandbox keeps at most SPARES of them."""
    if driver.cgroups.kind != "v1":
        pytest.skip(f"renaming a cgroup is v1's ({driver.cgroups.message})")
    await driver.create_sandbox(SB, None)
    await driver.mark_reported(SB, await _ended(driver, "c0"))
    assert _command_cgroups(host_id, "c0") == []
    spares = _command_cgroups(host_id, f"{cgroups_module._SPARE}0")
    assert len(spares) == 1 + driver.cgroups.can_freeze  # memory (and freezer)
    nodes = sorted(spare.stat().st_ino for spare in spares)
    await _ended(driver, "c1")
    assert sorted(d.stat().st_ino for d in _command_cgroups(host_id, "c1")) == nodes
    assert _command_cgroups(host_id, f"{cgroups_module._SPARE}0") == []
    # Several at once: those beyond the spares kept go.
    ids = [f"p{n}" for n in range(cgroups_module.SPARES + 2)]
    handles = [await driver.launch(SB, cid, ["sleep", "0.2"]) for cid in ids]
    for handle in handles:
        assert (await handle.wait()).reason == "exited"
    for cid in ["c1", *ids]:
        await driver.mark_reported(SB, cid)
    assert driver.cgroups.command_cgroups(SB) == []
    kept = [d.name for d in _command_cgroups(host_id, "*") if d.is_dir()]
    spare_names = [f"{cgroups_module._SPARE}{n}" for n in range(cgroups_module.SPARES)]
    assert sorted(n for n in kept if n != BOX_CGROUP) == sorted(spare_names * len(spares))


async def _ended(driver: ProcessDriver, command_id: str) -> str:
    _, _, end = await collect(await driver.launch(SB, command_id, ["true"]))
    assert end.reason == "exited"
    return command_id


async def test_a_new_driver_removes_the_cgroups_of_commands_reported_before(
    make_driver: MakeDriver, host_id: str
) -> None:
    """An agent that died between a command's report and the removal of its
    cgroups (or ran before they were removed) leaves them to the next one."""
    first = await make_driver()
    if first.cgroups.kind == "none":
        pytest.skip(f"no cgroups on this host: {first.cgroups.message}")
    await first.create_sandbox(SB, None)
    await _ended(first, "old")
    first.layout.command(SB, "old").reported.touch()  # reported, cgroups left
    assert _command_cgroups(host_id, "old")
    await first.close()
    second = await make_driver()
    await second.claim_cgroups()
    assert _command_cgroups(host_id, "old") == []


async def test_a_sandbox_keeps_the_directories_of_its_last_reported_commands_only(
    driver: ProcessDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each command's directory (spec, output copies, exit record) is kept for
    a while after its end is in the log, not for as long as the sandbox lives;
    one whose end is not reported yet is never touched."""
    monkeypatch.setattr(driver_module, "KEEP_REPORTED", 3)
    monkeypatch.setattr(driver_module, "KEEP_REPORTED_FOR_S", 0.0)
    await driver.create_sandbox(SB, None)
    running = await driver.launch(SB, "running", ["sleep", "100"])
    assert isinstance(await running.started(), int)
    for n in range(5):
        await driver.mark_reported(SB, await _ended(driver, f"c{n}"))
    assert driver.layout.command_ids(SB) == ["c2", "c3", "c4", "running"]
    assert await driver.interrupt(SB, "running", grace_s=0.0)
    assert (await running.wait()).reason == "interrupted"
    await driver.mark_reported(SB, "running")
    assert driver.layout.command_ids(SB) == ["c3", "c4", "running"]


async def test_a_reported_commands_directory_is_kept_a_while_whatever_the_count(
    driver: ProcessDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run instruction read from the log just before its command's end may
    still be acted on: its directory (the launch's own guard) outlives the count
    for KEEP_REPORTED_FOR_S."""
    monkeypatch.setattr(driver_module, "KEEP_REPORTED", 0)
    await driver.create_sandbox(SB, None)
    for n in range(3):
        await driver.mark_reported(SB, await _ended(driver, f"c{n}"))
    assert driver.layout.command_ids(SB) == ["c0", "c1", "c2"]
    assert driver.handle(SB, "c0").exit_record() is not None
    monkeypatch.setattr(driver_module, "KEEP_REPORTED_FOR_S", 0.0)
    await driver.mark_reported(SB, await _ended(driver, "c3"))
    assert driver.layout.command_ids(SB) == []


async def test_a_new_driver_keeps_only_the_last_reported_command_directories(
    make_driver: MakeDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Directories left by an earlier agent (or before there was a limit) are
    cut to the newest reported ones at start, and counted on from there."""
    first = await make_driver()
    await first.create_sandbox(SB, None)
    for n in range(5):
        await _ended(first, f"c{n}")
        marker = first.layout.command(SB, f"c{n}").reported
        marker.touch()
        os.utime(marker, (1_000_000 - n, 1_000_000 - n))  # reported c4 first, c0 last
    await _ended(first, "unreported")  # ended, its end not in the log yet
    await first.close()
    monkeypatch.setattr(driver_module, "KEEP_REPORTED", 2)
    second = await make_driver()
    adopted = await second.adopt_all()
    assert second.layout.command_ids(SB) == ["c0", "c1", "unreported"]
    assert [h.command_id for h in adopted] == ["unreported"]
    await second.mark_reported(SB, "unreported")
    await second.mark_reported(SB, "unreported")  # followed twice: counted once
    assert second.layout.command_ids(SB) == ["c0", "unreported"]


async def test_a_new_driver_removes_a_cgroup_whose_commands_directory_went(
    make_driver: MakeDriver, host_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reported command's cgroup a left-behind process held outlives its
    directory; a new agent knows it as reported by that directory's absence."""
    monkeypatch.setattr(driver_module, "KEEP_REPORTED", 0)
    monkeypatch.setattr(driver_module, "KEEP_REPORTED_FOR_S", 0.0)
    first = await make_driver()
    if first.cgroups.kind == "none":
        pytest.skip(f"no cgroups on this host: {first.cgroups.message}")
    await first.create_sandbox(SB, None)
    _, _, end = await collect(await first.launch(SB, "bg", ["sh", "-c", "sleep 300 >&- 2>&- &"]))
    assert end.reason == "exited"
    await first.mark_reported(SB, "bg")
    assert first.layout.command_ids(SB) == [] and _command_cgroups(host_id, "bg")
    for pid in first.cgroups.pids(SB, "bg"):
        os.kill(pid, signal.SIGKILL)
    await wait_until(lambda: first.cgroups.pids(SB, "bg") == [], what="the left process gone")
    await first.close()
    second = await make_driver()
    await second.claim_cgroups()
    assert _command_cgroups(host_id, "bg") == []


# Another agent of the same host id, on the same machine: it claims the host's
# cgroups (holding every sandbox named) and keeps running.
OTHER_AGENT = """
import sys, time
from pathlib import Path
from sandhold.hostagent.driver import V2Cgroups, detect_cgroups
host, mount, *holds = sys.argv[1:]
cgroups = V2Cgroups(Path(mount), host) if mount else detect_cgroups(host)
print(cgroups.claim_host(set(holds)), flush=True)
time.sleep(600)
"""


def _cgroup_dirs(host_id: str, sandbox_id: str) -> list[Path]:
    """The sandbox's cgroup in every hierarchy mounted here."""
    return sorted(Path("/sys/fs/cgroup").glob(f"*/sandhold/{host_id}/{sandbox_id}"))


@pytest.mark.parametrize("hierarchy", ["detected", "unified"])
async def test_a_host_claiming_its_cgroups_removes_the_empty_ones_of_sandboxes_it_does_not_hold(
    make_driver: MakeDriver, host_id: str, hierarchy: str
) -> None:
    """A data dir thrown away leaves its sandboxes' cgroups behind (they belong to
    the machine); the next agent of that host removes those that are empty. One
    with processes in it stays, and none goes while another agent holds the host."""
    cgroups, mount = None, ""
    if hierarchy == "unified":
        mounts = unified_mounts()
        if not mounts:
            pytest.skip("no writable cgroup v2 hierarchy on this machine")
        cgroups, mount = V2Cgroups(mounts[0], host_id), str(mounts[0])
    driver = await make_driver(cgroups=cgroups)
    if isinstance(driver.cgroups, NoCgroups):
        pytest.skip(f"no cgroups here: {driver.cgroups.message}")
    await driver.create_sandbox("sb-kept", None)  # in the layout: kept, running or not
    await driver.stop_sandbox("sb-kept")
    left = ("sb-gone", "sb-busy")  # no layout holds these
    for sandbox_id in left:
        driver.cgroups.create_sandbox(sandbox_id, 64 * 1024 * 1024)
        driver.cgroups.create_command(sandbox_id, "cmd-1")
    busy = subprocess.Popen(["sleep", "600"])
    other = subprocess.Popen(
        [sys.executable, "-c", OTHER_AGENT, host_id, mount, "sb-kept", *left],
        stdout=subprocess.PIPE,
    )
    try:
        for procs in driver.cgroups.create_command("sb-busy", "cmd-2").procs:
            Path(procs).write_text(str(busy.pid))
        assert other.stdout is not None
        assert await asyncio.to_thread(other.stdout.readline) == b"[]\n"  # it holds them all
        assert await driver.claim_cgroups() == []  # the other agent has the host
        assert len(_cgroup_dirs(host_id, "sb-gone")) == len(_cgroup_dirs(host_id, "sb-kept"))

        other.kill()
        other.wait()
        assert await driver.claim_cgroups() == ["sb-gone"]
        assert _cgroup_dirs(host_id, "sb-gone") == []
        assert _cgroup_dirs(host_id, "sb-kept") and _cgroup_dirs(host_id, "sb-busy")
        assert busy.pid in driver.cgroups.pids("sb-busy")
    finally:
        for process in (busy, other):
            process.kill()
            process.wait()
        if other.stdout is not None:
            other.stdout.close()
        driver.cgroups.remove("sb-busy")


async def test_the_cgroups_of_another_data_dir_of_the_host_id_stay_until_that_dir_is_gone(
    make_driver: MakeDriver, host_id: str, tmp_path: Path
) -> None:
    """Two installations may share a host id on one machine (`sandhold up`'s
    `local`): a stopped one's sandboxes have empty cgroups, and they are its,
    not leftovers, until its data dir is thrown away."""
    driver = await make_driver()
    if isinstance(driver.cgroups, NoCgroups):
        pytest.skip(f"no cgroups here: {driver.cgroups.message}")
    theirs = tmp_path / "another-installation"
    (theirs / "sandboxes" / "sb-theirs").mkdir(parents=True)
    others_of(host_id, theirs)  # as its agent did when it started
    driver.cgroups.create_sandbox("sb-theirs", None)  # stopped: nothing in it
    assert await driver.claim_cgroups() == []
    assert _cgroup_dirs(host_id, "sb-theirs")
    shutil.rmtree(theirs)  # that data dir thrown away
    assert await driver.claim_cgroups() == ["sb-theirs"]
    assert _cgroup_dirs(host_id, "sb-theirs") == []
