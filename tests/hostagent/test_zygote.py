"""Supervisors are forked by a pre-imported zygote, and outlive it."""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

from sandhold.hostagent.driver import ProcessDriver
from sandhold.hostagent.driver.pool import SupervisorPool

from tests.support.waiting import wait_until


def _zygotes(root: Path) -> list[int]:
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmdline = (d / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            # Supervisors it forked share its command line; the zygote is our child.
            if (
                b"sandhold.hostagent.driver.zygote" in cmdline
                and str(root).encode() in cmdline
                and _parent(int(d.name)) == os.getpid()
            ):
                found.append(int(d.name))
    return found


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


async def test_supervisors_come_from_the_zygote_and_outlive_it(tmp_path: Path) -> None:
    pool = SupervisorPool(tmp_path, 2)
    await pool.start()
    taken = []
    try:
        [zygote] = _zygotes(tmp_path)
        supervisor = await pool.take()
        taken.append(supervisor)
        # forked once, by the zygote (which reaps it), so not the agent's child
        assert _parent(supervisor.pid) == zygote
        assert os.getsid(supervisor.pid) != os.getsid(0)  # not in the agent's session
    finally:
        await pool.close()
    assert not _zygotes(tmp_path)  # the zygote exits with the pool
    assert Path(f"/proc/{supervisor.pid}").exists()  # the supervisor does not
    for s in taken:
        s.dismiss()  # EOF on its stdin: an idle supervisor exits


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None  # gone: reaped


async def test_the_zygote_reaps_the_supervisors_that_ended(tmp_path: Path) -> None:
    pool = SupervisorPool(tmp_path, 3)
    await pool.start()
    try:
        [zygote] = _zygotes(tmp_path)
        taken = [await pool.take() for _ in range(3)]
        assert {_parent(s.pid) for s in taken} == {zygote}
        for s in taken:
            s.dismiss()  # EOF on its stdin: an idle supervisor exits
        # Not left as zombies (state Z) of a zygote that lives on: gone from /proc.
        await wait_until(
            lambda: all(_state(s.pid) is None for s in taken),
            timeout=10,
            what="the ended supervisors reaped",
        )
        assert _zygotes(tmp_path) == [zygote]
    finally:
        await pool.close()


async def test_supervisors_that_ran_their_commands_are_reaped_too(
    make_driver: Callable[..., Awaitable[ProcessDriver]], root: Path
) -> None:
    driver = await make_driver()
    await driver.create_sandbox("sb-00000000000a0c02", None)
    [zygote] = _zygotes(root)
    supervisors = []
    for n in range(3):
        handle = await driver.launch("sb-00000000000a0c02", f"c{n}", ["true"])
        end = await handle.wait()
        assert (end.reason, end.exit_code) == ("exited", 0)
        paths = driver.layout.command("sb-00000000000a0c02", f"c{n}")
        supervisors.append(int(json.loads(paths.supervisor.read_text())["pid"]))
        # Not given back (decision 088): no command after this one, so it exits.
        handle.detach()
    assert len(set(supervisors)) == 3
    # None stays a zombie: the zygote, their parent, reaps each as it ends.
    await wait_until(
        lambda: all(_state(pid) is None for pid in supervisors),
        timeout=10,
        what="the supervisors of ended commands reaped",
    )
    assert _zygotes(root) == [zygote]
