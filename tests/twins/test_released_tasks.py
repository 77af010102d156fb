"""An ended task is released once nothing about it can change any more, and
the orchestrator then keeps nothing of it (decision 071): its sandbox is
stopped first; one whose create may still be decided is kept until the
sandbox shows, then stopped and released. A request to a released task is
decided on it read back from the log."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import pytest
from sandhold.bus.names import Names
from sandhold.bus.store import AggregateStore
from sandhold.client import connect
from sandhold.domain import events as ev
from sandhold.domain import requests as rq
from sandhold.domain import sandbox as sb
from sandhold.domain import task as tk
from sandhold.domain.errors import Rejected
from sandhold.domain.task_manifest import load_manifest
from sandhold.orchestrator import runner as runner_module
from sandhold.orchestrator import service as service_module
from sandhold.orchestrator.runner import sandbox_key, start_key, start_request
from sandhold.orchestrator.service import Orchestrator
from sandhold.scheduler.service import Scheduler

from tests.support.waiting import wait_until
from tests.twins.support import Running, append, readiness, running_sandbox


def _submitted(key: str) -> tuple[str, list[ev.AnyEvent]]:
    manifest = load_manifest({"name": key, "agent": {"command": ["true"]}})
    request = tk.SubmitTask(key=key, tenant="default", manifest=manifest)
    return tk.aggregate_of(request), tk.decide(None, request)


def _sandbox_of(task_id: str) -> str:
    return rq.sandbox_id_for("default", sandbox_key(task_id))


async def _task_in_log(nc: nats.NATS, names: Names, task_id: str) -> tk.Task | None:
    store: AggregateStore[tk.Task] = AggregateStore(
        nc.jetstream(), names, "task", tk.evolve, actor="test", follow=False
    )
    return (await store.read_whole(task_id))[0]


async def _sandbox_in_log(nc: nats.NATS, names: Names, sandbox_id: str) -> sb.Sandbox | None:
    store: AggregateStore[sb.Sandbox] = AggregateStore(
        nc.jetstream(), names, "sandbox", sb.evolve, actor="test", follow=False
    )
    return (await store.read_whole(sandbox_id))[0]


@contextlib.asynccontextmanager
async def _orchestrator(
    nc: nats.NATS, nats_url: str, names: Names, tmp_path: Path
) -> AsyncIterator[Orchestrator]:
    """An orchestrator and a scheduler, ready; both stopped however the test ends."""
    running = Running()
    try:
        announced = await readiness(nc, names)
        running.start(Scheduler(nats_url, names))
        orchestrator = running.start(Orchestrator(nats_url, names, work_dir=tmp_path / "work"))
        await wait_until(
            lambda: "orchestrator" in announced and "scheduler" in announced,
            timeout=30,
            what="the orchestrator and the scheduler ready",
        )
        yield orchestrator
    finally:
        await running.close()


async def _released(
    nc: nats.NATS, names: Names, orchestrator: Orchestrator, task_id: str
) -> tk.Task:
    async def released() -> tk.Task | None:
        state = await _task_in_log(nc, names, task_id)
        return state if state is not None and state.released else None

    task = await wait_until(released, timeout=30, what=f"{task_id} released")
    await wait_until(
        lambda: orchestrator.tasks.get(task_id) == (None, 0),
        timeout=10,
        what="the orchestrator to forget it",
    )
    assert task_id not in orchestrator.tasks.ids()
    assert task_id not in orchestrator._pending and task_id not in orchestrator._runners
    assert _sandbox_of(task_id) not in orchestrator._task_of_sandbox
    return task


async def _failed_while_running(
    nc: nats.NATS, names: Names, key: str, reason: str, *then: ev.AnyEvent
) -> tuple[str, str]:
    """A task failed in its running stage, its sandbox running on h1 (and
    then `then`). (task id, sandbox id)"""
    task_id, submitted = _submitted(key)
    sandbox_id = await running_sandbox(nc, names, sandbox_key(task_id), "h1")
    assert sandbox_id == _sandbox_of(task_id)
    if then:
        await append(nc, names, "sandbox", sandbox_id, list(then))
    await append(nc, names, "task", task_id, [
        *submitted,
        ev.TaskStageEntered(stage="staging"),
        ev.TaskStageEntered(stage="provisioning"),
        ev.TaskProvisioned(sandbox_id=sandbox_id),
        ev.TaskStageEntered(stage="running"),
        ev.TaskFailed(reason=reason, stage="running"),
    ])  # fmt: skip
    return task_id, sandbox_id


async def test_a_failed_tasks_sandbox_is_stopped_then_the_task_released_and_forgotten(
    nc: nats.NATS, nats_url: str, names: Names, tmp_path: Path
):
    task_id, sandbox_id = await _failed_while_running(nc, names, "failed-running", "agent_failed")
    async with _orchestrator(nc, nats_url, names, tmp_path) as orchestrator:
        await _released(nc, names, orchestrator, task_id)
        # Its stop was decided before the release was appended.
        sandbox = await _sandbox_in_log(nc, names, sandbox_id)
        assert sandbox is not None and sandbox.phase in ("stopping", "stopped"), sandbox
        assert orchestrator.tasks.forgotten == 1

        # A request to it is decided on it as the log has it.
        client = await connect(nats_url, prefix=names.prefix)
        try:
            with pytest.raises(Rejected) as refused:
                await client.cancel_task(task_id, key="cancel-after-release")
            assert refused.value.code == "task_finished"
        finally:
            await client.close()


async def test_a_task_that_ended_before_any_create_is_released_at_once(
    nc: nats.NATS, nats_url: str, names: Names, tmp_path: Path
):
    staging, submitted = _submitted("failed-staging")
    await append(nc, names, "task", staging, [
        *submitted,
        ev.TaskStageEntered(stage="staging"),
        ev.TaskFailed(reason="clone_failed", stage="staging"),
    ])  # fmt: skip
    refused, submitted_too = _submitted("create-refused")
    await append(nc, names, "task", refused, [
        *submitted_too,
        ev.TaskStageEntered(stage="staging"),
        ev.TaskStageEntered(stage="provisioning"),
        ev.TaskFailed(reason="provision_snapshot_not_found", stage="provisioning"),
    ])  # fmt: skip
    async with _orchestrator(nc, nats_url, names, tmp_path) as orchestrator:
        for task_id in (staging, refused):
            await _released(nc, names, orchestrator, task_id)
            assert await _sandbox_in_log(nc, names, _sandbox_of(task_id)) is None


@pytest.fixture
def short_release_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """A runner waits a minute for a provisioning request's decision; here less."""
    monkeypatch.setattr(runner_module, "RELEASE_WAIT_S", 0.5)


async def _given_up(nc: nats.NATS, names: Names, orchestrator: Orchestrator, task_id: str) -> None:
    """Its runner looked, waited and left it to its sandbox's next change: held,
    not released, no runner."""

    def idle() -> bool:
        drive = orchestrator._runners.get(task_id)
        return task_id not in orchestrator._pending and (drive is None or drive.done())

    await wait_until(idle, timeout=30, what=f"the runner of {task_id} to leave it")
    state, _ = orchestrator.tasks.get(task_id)
    assert state is not None and not state.released
    in_log = await _task_in_log(nc, names, task_id)
    assert in_log is not None and not in_log.released
    assert orchestrator._task_of_sandbox[_sandbox_of(task_id)] == task_id


async def test_a_task_whose_create_is_undecided_is_kept_until_its_sandbox_shows(
    nc: nats.NATS, nats_url: str, names: Names, tmp_path: Path, short_release_wait: None
):
    """Cancelled while provisioning, its create still waiting for a scheduler:
    released now, a create decided later would leave a sandbox running that
    nothing stops (a task's sandbox is never reaped for idleness)."""
    task_id, submitted = _submitted("cancelled-provisioning")
    await append(nc, names, "task", task_id, [
        *submitted,
        ev.TaskStageEntered(stage="staging"),
        ev.TaskStageEntered(stage="provisioning"),
        ev.TaskCancelRequested(request_key="cancel-1", request_digest="d"),
        ev.TaskCancelled(stage="provisioning"),
    ])  # fmt: skip
    async with _orchestrator(nc, nats_url, names, tmp_path) as orchestrator:
        await _given_up(nc, names, orchestrator, task_id)

        # The create is decided late: the sandbox waits for a host.
        created = sb.decide(None, rq.CreateSandbox(key=sandbox_key(task_id), tenant="default"))
        await append(nc, names, "sandbox", _sandbox_of(task_id), created)
        await _released(nc, names, orchestrator, task_id)
        sandbox = await _sandbox_in_log(nc, names, _sandbox_of(task_id))
        assert sandbox is not None and sandbox.phase == "stopped", sandbox


async def _provisioning_failed_once(
    nc: nats.NATS, names: Names, key: str, *, retry_in_s: float
) -> tuple[str, str]:
    """A task whose sandbox failed to start once, with a retry due `retry_in_s`
    from now, timed out now; its sandbox failed. (task id, sandbox id)"""
    task_id, submitted = _submitted(key)
    sandbox_id = _sandbox_of(task_id)
    created = sb.decide(None, rq.CreateSandbox(key=sandbox_key(task_id), tenant="default"))
    await append(nc, names, "sandbox", sandbox_id, [
        *created,
        ev.SandboxPlaced(host="h1", generation=1),
        ev.SandboxStarting(host="h1", generation=1),
        ev.SandboxStartFailed(host="h1", generation=1, reason="no room"),
    ])  # fmt: skip
    await append(nc, names, "task", task_id, [
        *submitted,
        ev.TaskStageEntered(stage="staging"),
        ev.TaskStageEntered(stage="provisioning"),
        ev.TaskOperationFailed(
            operation="provision", attempt=1, error_class="placement", reason="start_failed",
            retry_at=time.time() + retry_in_s,
        ),
        ev.TaskTimedOut(stage="provisioning", detail="the task's limit passed"),
    ])  # fmt: skip
    return task_id, sandbox_id


async def test_a_later_attempts_start_still_undecided_keeps_the_task_until_it_is(
    nc: nats.NATS, nats_url: str, names: Names, tmp_path: Path, short_release_wait: None
):
    """Its second attempt's start was sent before the end (its retry was due):
    decided after a release, it would start a sandbox nothing stops."""
    task_id, sandbox_id = await _provisioning_failed_once(
        nc, names, "start-undecided", retry_in_s=-30
    )
    async with _orchestrator(nc, nats_url, names, tmp_path) as orchestrator:
        await _given_up(nc, names, orchestrator, task_id)

        # The start is decided late: the sandbox waits for a host again.
        start = rq.StartSandbox(key=start_key(task_id, 2), tenant="default", sandbox_id=sandbox_id)
        failed = await _sandbox_in_log(nc, names, sandbox_id)
        await append(nc, names, "sandbox", sandbox_id, sb.decide(failed, start))
        await _released(nc, names, orchestrator, task_id)
        sandbox = await _sandbox_in_log(nc, names, sandbox_id)
        assert sandbox is not None and sandbox.phase == "stopped", sandbox


async def test_a_later_attempts_start_delivered_after_the_release_starts_nothing(
    nc: nats.NATS, nats_url: str, names: Names, tmp_path: Path
):
    """Decision 082: a start the runner sent before the task ended reaches a
    scheduler only after the release stopped the sandbox (the scheduler that
    took it died deciding it; redelivered, it overtook nothing). Started now,
    the sandbox would run with nothing left to stop it."""
    task_id, sandbox_id = await _failed_while_running(nc, names, "late-start", "agent_failed")
    async with _orchestrator(nc, nats_url, names, tmp_path) as orchestrator:
        await _released(nc, names, orchestrator, task_id)
        stopping = await _sandbox_in_log(nc, names, sandbox_id)
        assert stopping is not None and stopping.phase == "stopping", stopping
        await append(nc, names, "sandbox", sandbox_id, [ev.SandboxStopped(host="h1", generation=1)])

        client = await connect(nats_url, prefix=names.prefix)
        try:
            reply = await client.send(start_request(task_id, 2, "default", sandbox_id))
        finally:
            await client.close()
        assert reply.ok, reply
        sandbox = await _sandbox_in_log(nc, names, sandbox_id)
        assert sandbox is not None and sandbox.phase == "stopped", sandbox
        assert start_key(task_id, 2) in sandbox.requests  # decided: noted, not started


async def test_a_retry_due_after_the_end_was_never_sent_and_the_task_is_released(
    nc: nats.NATS, nats_url: str, names: Names, tmp_path: Path
):
    task_id, sandbox_id = await _provisioning_failed_once(nc, names, "never-sent", retry_in_s=600)
    async with _orchestrator(nc, nats_url, names, tmp_path) as orchestrator:
        await _released(nc, names, orchestrator, task_id)
        sandbox = await _sandbox_in_log(nc, names, sandbox_id)
        assert sandbox is not None and sandbox.phase == "failed", "nothing to stop"


async def test_a_lost_sandbox_of_an_ended_task_is_stopped_before_the_release(
    nc: nats.NATS, nats_url: str, names: Names, tmp_path: Path
):
    """Left lost, a sandbox comes back by itself (a start, a command, eager
    recovery): it is stopped, which a lost one is at once."""
    now = time.time()
    lost = ev.SandboxLost(host="h1", generation=1, last_renewal_at=now - 10, fence_at=now - 3)
    task_id, sandbox_id = await _failed_while_running(
        nc, names, "lost-at-the-end", "infrastructure_lost", lost
    )
    async with _orchestrator(nc, nats_url, names, tmp_path) as orchestrator:
        await _released(nc, names, orchestrator, task_id)
        sandbox = await _sandbox_in_log(nc, names, sandbox_id)
        assert sandbox is not None and sandbox.phase == "stopped", sandbox


async def test_tasks_that_ended_before_the_start_are_released_a_few_at_a_time(
    nc: nats.NATS,
    nats_url: str,
    names: Names,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
):
    """After an upgrade every task ever ended is released at the first start:
    not all at once (a runner each, a read and an append each), or the
    instance's lease renewal waits behind them."""
    ended = []
    for n in range(24):
        task_id, submitted = _submitted(f"ended-before-{n}")
        await append(nc, names, "task", task_id, [
            *submitted,
            ev.TaskStageEntered(stage="staging"),
            ev.TaskFailed(reason="clone_failed", stage="staging"),
        ])  # fmt: skip
        ended.append(task_id)
    monkeypatch.setattr(service_module, "RELEASES_AT_ONCE", 4)
    in_flight, most = 0, 0
    release = runner_module.Runner._release

    async def counted(self: runner_module.Runner, state: tk.Task) -> bool:
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        try:
            await asyncio.sleep(0.05)  # long enough for the others to pile up
            return await release(self, state)
        finally:
            in_flight -= 1

    monkeypatch.setattr(runner_module.Runner, "_release", counted)
    async with _orchestrator(nc, nats_url, names, tmp_path) as orchestrator:
        for task_id in ended:
            await _released(nc, names, orchestrator, task_id)
        assert 1 < most <= 4, most
