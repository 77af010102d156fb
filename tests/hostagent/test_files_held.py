"""`HostSaves.files_held`: what a command's end looks at before it says the
sandbox's files are still its last save's (decision 078). A real driver, real
cgroups and processes, and a real manifest on the host; no services."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import nats
import pytest
from sandhold.bus.names import Names
from sandhold.domain import sandbox as sb
from sandhold.hostagent.driver import ProcessDriver
from sandhold.hostagent.driver.boxes import BOX_CGROUP
from sandhold.hostagent.saving import LOOK_MAX_NAMES, HostSaves
from sandhold.hostagent.service import Look, files_at_end
from sandhold.saves import Manifest, SaveStore, capture
from sandhold.saves.capture import RACY_WINDOW_S

from tests.domain.history import (
    RUNNING,
    T0,
    apply,
    cmd,
    command_ended,
    command_started,
    dispatched,
    given_sandbox,
    run,
)
from tests.domain.test_saves import _saved
from tests.support.waiting import wait_until

SB = "sb1"
SAVE = "sv-held"


def _saves(nc: nats.NATS, names: Names, driver: ProcessDriver, root: Path) -> HostSaves:
    return HostSaves(nc, names, driver, SaveStore(nc, names), root, "local")


def _remember_save(saves: HostSaves, driver: ProcessDriver) -> Manifest:
    """The host's manifest of a save of the sandbox's files as they are now, as
    a save leaves it (captured well after the files were written)."""
    captured = capture(
        driver.save_root(SB),
        save_id=SAVE,
        sandbox_id=SB,
        previous=None,
        spool=saves._spool(SB) / "capture",
        now=time.time() + RACY_WINDOW_S + 1,
        layout=driver.save_layout,
        id_offset=driver.id_offset(SB),
    )
    saves._remember(SB, captured.manifest)
    return captured.manifest


@pytest.fixture
async def held(nc: nats.NATS, names: Names, driver: ProcessDriver, root: Path) -> HostSaves:
    if driver.cgroups.kind == "none":
        pytest.skip(f"no cgroups on this host: {driver.cgroups.message}")
    await driver.create_sandbox(SB, None)
    # Written from inside, as a sandbox's files are: the first command also
    # marks the box's layers (overlayfs sets attributes on its first lookups).
    wrote = await driver.launch(SB, "c0", ["sh", "-c", "echo kept > notes.txt"])
    assert (await wrote.wait()).reason == "exited"
    await wait_until(lambda: driver.quiet(SB), what="the command is gone")
    saves = _saves(nc, names, driver, root)
    _remember_save(saves, driver)
    return saves


async def test_untouched_files_with_nothing_running_are_held(
    held: HostSaves, driver: ProcessDriver
) -> None:
    assert held.files_held(SB, SAVE)
    ran = await driver.launch(SB, "c1", ["true"])
    assert (await ran.wait()).reason == "exited"
    await wait_until(lambda: driver.quiet(SB), what="the command is gone")
    assert held.files_held(SB, SAVE)


async def test_a_written_file_is_not_held(held: HostSaves, driver: ProcessDriver) -> None:
    ran = await driver.launch(SB, "c1", ["sh", "-c", "echo more >> notes.txt"])
    assert (await ran.wait()).reason == "exited"
    await wait_until(lambda: driver.quiet(SB), what="the command is gone")
    assert not held.files_held(SB, SAVE)


async def test_nothing_is_held_while_a_process_a_command_left_runs(
    held: HostSaves, driver: ProcessDriver
) -> None:
    leaver = await driver.launch(
        SB, "leaver", ["sh", "-c", "setsid sleep 100 > /dev/null 2>&1 < /dev/null &"]
    )
    assert (await leaver.wait()).reason == "exited"
    assert not held.files_held(SB, SAVE)  # it writes nothing, but it could
    left = set(driver.cgroups.pids(SB)) - set(driver.cgroups.pids(SB, BOX_CGROUP))
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    await wait_until(lambda: driver.quiet(SB), what="the job is gone")
    assert held.files_held(SB, SAVE)


async def test_without_a_readable_manifest_here_nothing_is_held(
    held: HostSaves, driver: ProcessDriver
) -> None:
    assert not held.files_held(SB, "sv-never-here")
    manifest = held._spool(SB) / "manifests" / SAVE
    manifest.write_bytes(manifest.read_bytes()[:10])  # torn (a crash mid-write)
    assert not held.files_held(SB, SAVE)  # and no error: the end is reported all the same


async def test_a_tree_over_the_cap_is_not_looked_at(held: HostSaves, driver: ProcessDriver) -> None:
    many = driver.save_root(SB) / "many"
    many.mkdir()
    names = len(_remember_save(held, driver).entries)
    for i in range(LOOK_MAX_NAMES - names):
        (many / f"f{i}").touch()
    assert len(_remember_save(held, driver).entries) == LOOK_MAX_NAMES
    assert held.files_held(SB, SAVE)
    (many / "one-more").touch()
    assert len(_remember_save(held, driver).entries) == LOOK_MAX_NAMES + 1
    assert not held.files_held(SB, SAVE)


async def test_a_fresh_box_saved_before_any_command_holds_through_a_first_look_around(
    nc: nats.NATS, names: Names, driver: ProcessDriver, root: Path
) -> None:
    """overlayfs marks a directory its two layers hold on its first lookup; the
    box's start makes those lookups, so the first save already holds the marks
    and a first command that only looks around changes nothing (decision 078)."""
    if driver.boxes is None or driver.cgroups.kind == "none":
        pytest.skip("no box on this host, or no cgroups")
    await driver.create_sandbox(SB, None)
    saves = _saves(nc, names, driver, root)
    _remember_save(saves, driver)
    looked = await driver.launch(SB, "c1", ["sh", "-c", "ls -a / /home/sandbox . > /dev/null"])
    assert (await looked.wait()).reason == "exited"
    await wait_until(lambda: driver.quiet(SB), what="the command is gone")
    assert saves.files_held(SB, SAVE)


# --- what the end says, decided on the state once its start is recorded ---


def _looked(state: sb.Sandbox, key: str) -> tuple[sb.Sandbox, Look]:
    """A quiet save, then the command `key` queued and dispatched, and the look
    at its end, taken before its start was recorded."""
    state, save_id = _saved(state, T0 + 100, quiet=True)
    [queued] = sb.decide(state, run(key))
    state = apply(state, [queued, dispatched(key)], time=T0 + 200)
    return state, Look(save_id, state.activity, running=False)


def test_the_end_says_the_look_s_save_at_the_count_of_its_own_state() -> None:
    state, look = _looked(given_sandbox(*RUNNING), "run-true")
    started = apply(state, [command_started("run-true")], time=T0 + 201)
    assert files_at_end(started, cmd("run-true"), look) == (look.save_id, started.activity)
    # Looked once the start was recorded: the same.
    after = Look(look.save_id, started.activity, running=True)
    assert files_at_end(started, cmd("run-true"), after) == (look.save_id, started.activity)
    assert files_at_end(started, cmd("run-true"), None) == (None, -1)


def test_a_command_run_or_a_save_completed_since_the_look_leaves_the_end_silent() -> None:
    state, look = _looked(given_sandbox(*RUNNING), "run-true")
    state = apply(state, [command_started("run-true")], time=T0 + 201)
    [other] = sb.decide(state, run("other"))
    queued = apply(state, [other, dispatched("other")], time=T0 + 202)
    assert files_at_end(queued, cmd("run-true"), look) == (None, -1)  # another unended
    # Launched, run and ended while the end waited for its start: only the count says so.
    ran = apply(queued, [command_started("other"), command_ended("other")], time=T0 + 203)
    assert ran.unended_ids == (cmd("run-true"),)
    assert files_at_end(ran, cmd("run-true"), look) == (None, -1)
    newer, _ = _saved(state, T0 + 300, quiet=True)
    assert files_at_end(newer, cmd("run-true"), look) == (None, -1)
