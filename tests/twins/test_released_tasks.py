"""An ended task is released once nothing about it can change any more, and
the orchestrator then keeps nothing of it (decision 071): its sandbox is
stopped first; one whose create may still be decided is kept until the
sandbox shows, then stopped and released. A request to a released task is
decided on it read back from the log."""

from __future__ import annotations

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
from sandhold.orchestrator.runner import sandbox_key
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


async def _started(
    nc: nats.NATS, nats_url: str, names: Names, running: Running, tmp_path: Path
) -> Orchestrator:
    announced = await readiness(nc, names)
    running.start(Scheduler(nats_url, names))
    orchestrator = running.start(Orchestrator(nats_url, names, work_dir=tmp_path / "work"))
    await wait_until(
        lambda: "orchestrator" in announced and "scheduler" in announced,
        timeout=30,
        what="the orchestrator and the scheduler ready",
    )
    return orchestrator


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
    assert task_id not in orchestrator._pending and task_id not in orchestrator._sandbox_up
    assert _sandbox_of(task_id) not in orchestrator._task_of_sandbox
    return task


async def test_a_failed_tasks_sandbox_is_stopped_then_the_task_released_and_forgotten(
    nc: nats.NATS, nats_url: str, names: Names, tmp_path: Path
):
    task_id, submitted = _submitted("failed-running")
    sandbox_id = await running_sandbox(nc, names, sandbox_key(task_id), "h1")
    assert sandbox_id == _sandbox_of(task_id)
    await append(nc, names, "task", task_id, [
        *submitted,
        ev.TaskStageEntered(stage="staging"),
        ev.TaskStageEntered(stage="provisioning"),
        ev.TaskProvisioned(sandbox_id=sandbox_id),
        ev.TaskStageEntered(stage="running"),
        ev.TaskFailed(reason="agent_failed", stage="running"),
    ])  # fmt: skip
    running = Running()
    try:
        orchestrator = await _started(nc, nats_url, names, running, tmp_path)
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
    finally:
        await running.close()


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
    running = Running()
    try:
        orchestrator = await _started(nc, nats_url, names, running, tmp_path)
        for task_id in (staging, refused):
            await _released(nc, names, orchestrator, task_id)
            assert await _sandbox_in_log(nc, names, _sandbox_of(task_id)) is None
    finally:
        await running.close()


async def test_a_task_whose_create_is_undecided_is_kept_until_its_sandbox_shows(
    nc: nats.NATS, nats_url: str, names: Names, tmp_path: Path
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
    running = Running()
    try:
        orchestrator = await _started(nc, nats_url, names, running, tmp_path)
        # Ready: it looked at every task it holds, and has nothing to do for it yet.
        state, _ = orchestrator.tasks.get(task_id)
        assert state is not None and not state.released
        assert task_id not in orchestrator._pending and task_id not in orchestrator._runners
        assert orchestrator._task_of_sandbox[_sandbox_of(task_id)] == task_id

        # The create is decided late: the sandbox waits for a host.
        created = sb.decide(None, rq.CreateSandbox(key=sandbox_key(task_id), tenant="default"))
        await append(nc, names, "sandbox", _sandbox_of(task_id), created)
        await _released(nc, names, orchestrator, task_id)
        sandbox = await _sandbox_in_log(nc, names, _sandbox_of(task_id))
        assert sandbox is not None and sandbox.phase in ("stopping", "stopped"), sandbox
    finally:
        await running.close()
