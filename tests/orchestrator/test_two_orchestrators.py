"""Two orchestrators against one server: tasks spread over both, and never does
one task have two drivers (decision 036) — with both running, with the driver
killed (kill -9), and with the driver paused past its lease (SIGSTOP) and woken.

Each task's log says who drove what: `task.driver_claimed` opens an epoch, and
every event the runners append carries its instance as the actor, so the check
is a walk over the log: each epoch's events are written by the instance whose
claim opened it. At-most-once tool steps call a local HTTP receiver, which
counts every call; agent commands count their runs in their sandbox.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from sandhold.bus import credentials
from sandhold.client import Client, connect
from sandhold.domain import events as ev
from sandhold.domain import task as tk
from sandhold.domain.envelope import Recorded
from sandhold.domain.task_manifest import load_manifest

from tests.e2e.harness import RunLog, Up
from tests.orchestrator.test_task_faults import Receiver
from tests.support.waiting import Readiness, wait_until

LEASE_TTL, FENCE_MARGIN = 3.0, 1.0
# `up` gives its orchestrators (and hosts, and recovery) these; the test's own
# twin gets the same flags.
LEASES = ("--lease-ttl", str(LEASE_TTL), "--fence-margin", str(FENCE_MARGIN))
# Request decisions are any instance's; everything else is its driver's.
REQUESTED = {"task.submitted", "task.cancel_requested"}


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with Receiver() as r:
        yield r


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    """`sandhold up --instances 2`: orchestrator-1 and orchestrator-2 (and two of
    every other service), restarted by `up` if they die."""
    data_dir = tmp_path_factory.mktemp("pair") / "data"
    running = Up(data_dir, "--instances", "2", "--http-egress", "any", *LEASES)
    running.start(timeout=120)
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture
async def client(pair: Up) -> AsyncIterator[Client]:
    c = await connect(pair.url)
    try:
        yield c
    finally:
        await c.close()


class Twin:
    """One more orchestrator instance beside `up`'s, a process of the test's own
    (so that nothing restarts it when the test kills it); stopped by its PID."""

    def __init__(self, up: Up, instance: str) -> None:
        self.up = up
        self.instance = instance
        self.log_path = up.data_dir.parent / f"{instance}.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def start(self) -> None:
        own = credentials.path_of(self.up.data_dir / "credentials", "orchestrator")
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [
                    sys.executable, "-m", "sandhold.orchestrator",
                    "--nats", self.up.nats_url,
                    "--prefix", self.up.runtime["prefix"],
                    "--credentials", str(own),
                    "--instance", self.instance,
                    "--work-dir", str(self.up.data_dir / self.instance),
                    "--http-egress", "any",
                    "--lease-ttl", str(LEASE_TTL),
                    "--fence-margin", str(FENCE_MARGIN),
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                process_group=0,
            )  # fmt: skip

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGCONT)  # a paused one could not end
            os.kill(self.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.kill(self.pid, signal.SIGKILL)
            self.process.wait()


@pytest.fixture
async def solo_and_twin(tmp_path: Path) -> AsyncIterator[tuple[Up, Twin, Client]]:
    """`up`'s one orchestrator (`orchestrator`) and a twin of the test's own
    (`orchestrator-2`), both serving."""
    up = Up(tmp_path / "data", "--http-egress", "any", *LEASES).start()
    twin = Twin(up, "orchestrator-2")
    try:
        c = await connect(up.url)
        try:
            readiness = await Readiness().listen(c.nc, c.names)
            twin.start()
            await readiness.wait_for("orchestrator", twin.pid)
            await readiness.close()
            yield up, twin, c
        finally:
            await c.close()
    finally:
        twin.stop()
        up.stop()


# --- what the tests submit, and what they read back -----------------------------------


def _manifest(receiver: Receiver, counter: RunLog, tag: str, *, seconds: float = 0.0):
    """An at-most-once call, an agent command that counts its runs, another call."""
    script = f"echo {tag} >> {counter.inside()}; sleep {seconds}; echo done"

    def call(name: str) -> dict:
        return {
            "name": name,
            "http": {"url": receiver.url, "body": tag},
            "delivery": "at_most_once",
        }

    return load_manifest(
        {
            "name": f"pair-{tag}",
            "pipeline": [
                call("before"),
                {"name": "work", "agent": {"command": ["sh", "-c", script]}},
                call("after"),
            ],
        }
    )


def _counter(up: Up) -> RunLog:
    return RunLog(up.data_dir, f".runs-{uuid.uuid4().hex[:12]}")


def _drivers(records: list[Recorded]) -> list[tuple[str, int, int]]:
    """(driver, epoch, sequence of its claim) in log order, after checking that
    every event of an epoch was written by the instance whose claim opened it."""
    drivers: list[tuple[str, int, int]] = []
    for record in records:
        envelope = record.envelope
        if isinstance(envelope.event, ev.TaskDriverClaimed):
            claim = envelope.event
            assert envelope.actor == claim.driver, f"{claim} appended by {envelope.actor}"
            assert claim.epoch == len(drivers) + 1, f"epochs skip: {drivers} then {claim}"
            drivers.append((claim.driver, claim.epoch, record.seq))
        elif envelope.type not in REQUESTED:
            assert drivers, f"{envelope.type} appended before any claim"
            driver, epoch, _ = drivers[-1]
            assert envelope.actor == driver, (
                f"{envelope.type} (seq {record.seq}) appended by {envelope.actor} "
                f"in epoch {epoch}, which {driver} drives"
            )
    return drivers


def _calls(receiver: Receiver) -> collections.Counter[str]:
    return collections.Counter(receiver.keys)


async def _ended(client: Client, task_id: str, timeout: float = 90.0) -> tk.Task:
    return await client.wait_for_task(
        task_id, lambda s: s if s.terminal else None, timeout=timeout, what="the task's end"
    )


async def _running_work(client: Client, task_id: str) -> tk.Task:
    """The task, driven, with its agent step's command dispatched."""
    return await client.wait_for_task(
        task_id,
        lambda s: s if s.driver and "work" in s.steps and s.steps["work"].status == "dispatched"
        else None,
        timeout=60,
        what="the command dispatched",
    )  # fmt: skip


def _completed_once_each(state: tk.Task, receiver: Receiver, counter: RunLog, tag: str) -> None:
    assert state.state == "completed", (state.state, state.reason, state.detail)
    calls = _calls(receiver)
    for step in ("before", "after"):
        assert calls[tk.step_key(state.id, step, 1)] == 1, (step, calls)
    assert counter.lines().count(tag) == 1  # the command ran once


def _log_says(path: Path, *words: str) -> bool:
    text = path.read_text(errors="replace") if path.exists() else ""
    return any(all(w in line for w in words) for line in text.splitlines())


# --- both running ------------------------------------------------------------------------


async def test_two_orchestrators_share_tasks_and_each_is_driven_by_one(
    pair: Up, client: Client, receiver: Receiver
):
    counter = _counter(pair)
    tags = [f"t{i}-{uuid.uuid4().hex[:6]}" for i in range(4)]
    ids = [(await client.submit_task(_manifest(receiver, counter, tag))).id for tag in tags]
    states = await asyncio.gather(*(_ended(client, task_id) for task_id in ids))
    first_drivers = []
    for state, tag in zip(states, tags, strict=True):
        _completed_once_each(state, receiver, counter, tag)
        drivers = _drivers(await client.task_records(state.id))
        # Both lived throughout: one claim per task, never a takeover.
        assert len(drivers) == 1, drivers
        first_drivers.append(drivers[0][0])
    assert set(first_drivers) <= {"orchestrator-1", "orchestrator-2"}
    # Tasks go where their submits went: the work queue spreads those.
    print(f"drivers: {collections.Counter(first_drivers)}")
    assert len(set(first_drivers)) == 2, first_drivers


# --- the driver killed ---------------------------------------------------------------------


async def test_the_twin_takes_over_a_task_whose_driver_was_killed(
    solo_and_twin: tuple[Up, Twin, Client], receiver: Receiver
):
    up, twin, client = solo_and_twin
    counter = _counter(up)
    # Submits alternate between the two; the one to kill is the twin (`up` would
    # restart its own at once, under its own name).
    task = None
    for i in range(8):
        tag = f"k{i}-{uuid.uuid4().hex[:6]}"
        view = await client.submit_task(_manifest(receiver, counter, tag, seconds=6))
        state = await client.wait_for_task(
            view.id, lambda s: s if s.driver else None, timeout=30, what="a driver"
        )
        if state.driver == twin.instance:
            task = (view.id, tag)
            break
    assert task is not None, "no submit went to the twin"
    task_id, tag = task
    await _running_work(client, task_id)
    await wait_until(lambda: tag in counter.lines(), timeout=30, what="the command started")
    os.kill(twin.pid, signal.SIGKILL)
    killed_at = time.time()
    taken = await client.wait_for_task(
        task_id,
        lambda s: s if s.driver == "orchestrator" else None,
        timeout=LEASE_TTL + FENCE_MARGIN + 30,
        what="the takeover",
    )
    assert taken.driver_epoch == 2
    state = await _ended(client, task_id)
    _completed_once_each(state, receiver, counter, tag)
    records = await client.task_records(task_id)
    drivers = _drivers(records)
    assert [(d, e) for d, e, _ in drivers] == [(twin.instance, 1), ("orchestrator", 2)]
    claim = next(r for r in records if r.seq == drivers[1][2])
    # Not before the killed one's lease had lapsed, as its twin saw it.
    waited = claim.envelope.time - killed_at
    print(f"taken over {waited:.1f}s after the kill")
    assert waited >= LEASE_TTL, waited


# --- the driver paused past its lease, then woken ----------------------------------------------


async def test_a_driver_paused_past_its_lease_is_taken_over_and_writes_nothing_when_it_wakes(
    pair: Up, client: Client, receiver: Receiver
):
    counter = _counter(pair)
    tag = f"p-{uuid.uuid4().hex[:6]}"
    view = await client.submit_task(_manifest(receiver, counter, tag, seconds=4))
    running = await _running_work(client, view.id)
    await wait_until(lambda: tag in counter.lines(), timeout=30, what="the command started")
    paused = running.driver
    assert paused in ("orchestrator-1", "orchestrator-2")
    twin = "orchestrator-2" if paused == "orchestrator-1" else "orchestrator-1"
    pid = pair.service_pid(paused)
    record = running.steps["work"]
    os.kill(pid, signal.SIGSTOP)
    try:
        await client.wait_for_task(
            view.id,
            lambda s: s if s.driver == twin else None,
            timeout=LEASE_TTL + FENCE_MARGIN + 30,
            what="the takeover",
        )
        # The command ends while the paused one sleeps: when it wakes, its runner
        # has a result to record, a call to make — and must do neither.
        assert record.sandbox_id and record.command_id
        await client.wait_for(
            record.sandbox_id,
            lambda s: s if s.commands[record.command_id or ""].ended else None,
            timeout=60,
            what="the command's end",
        )
    finally:
        os.kill(pid, signal.SIGCONT)
    state = await _ended(client, view.id)
    log = pair.data_dir / "logs" / f"{paused}.log"
    await wait_until(
        lambda: _log_says(log, view.id, "runner stops"),
        timeout=30,
        what=f"{paused} saying its runner of {view.id} stops",
    )
    _completed_once_each(state, receiver, counter, tag)
    records = await client.task_records(view.id)
    drivers = _drivers(records)
    assert [(d, e) for d, e, _ in drivers] == [(paused, 1), (twin, 2)]
    takeover = drivers[1][2]
    assert not [r.envelope.type for r in records if r.seq > takeover and r.envelope.actor == paused]
    assert pair.service_pid(paused) == pid  # woken, not restarted: it serves on
