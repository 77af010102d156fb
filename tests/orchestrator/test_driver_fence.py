"""The claim fence on a real nats-server, in one process: two instances racing
for a task, and a runner whose claim was superseded while its cache still says
otherwise (decision 036)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import nats
import pytest
from sandhold.bus.names import Names
from sandhold.bus.output import OutputLog
from sandhold.bus.read import read_subject
from sandhold.bus.store import AggregateStore
from sandhold.domain import events as ev
from sandhold.domain import sandbox as sb
from sandhold.domain import task as tk
from sandhold.domain.errors import Rejected
from sandhold.domain.task_driver import claim_driver
from sandhold.domain.task_manifest import load_manifest
from sandhold.orchestrator.http_tool import HttpTool
from sandhold.orchestrator.runner import DriverClaim, Runner, Superseded
from sandhold.orchestrator.sandboxes import Sandboxes
from sandhold.saves import SaveStore

ONE, TWO = "orchestrator-1", "orchestrator-2"
SUBMIT = tk.SubmitTask(
    key="fence-1", manifest=load_manifest({"name": "fenced", "agent": {"command": ["true"]}})
)
TASK = tk.aggregate_of(SUBMIT)


def _store(nc: nats.NATS, names: Names, actor: str) -> AggregateStore[tk.Task]:
    return AggregateStore(nc.jetstream(), names, "task", tk.evolve, actor=actor)


async def _submitted(store: AggregateStore[tk.Task]) -> None:
    await store.execute(
        TASK,
        lambda state: tk.decide(state, SUBMIT),
        id_base="req:fence-1",
        causation_id="fence-1",
        correlation_id="fence-1",
    )


async def _claim(store: AggregateStore[tk.Task], instance: str, *, live: bool) -> int:
    executed = await store.follow_up(
        TASK,
        lambda state: claim_driver(state, instance, holding=None, live=lambda _: live),
        why=f"driver:{instance}",
    )
    assert executed.state is not None
    return executed.state.driver_epoch


async def _types_and_actors(nc: nats.NATS, names: Names) -> list[tuple[str, str]]:
    records = await read_subject(nc.jetstream(), names.events_stream, names.events("task", TASK))
    return [(r.envelope.type, r.envelope.actor) for r in records]


async def test_two_instances_racing_for_a_task_one_claims_it_the_other_finds_it_driven(
    nc: nats.NATS, names: Names
):
    one, two = _store(nc, names, ONE), _store(nc, names, TWO)
    await one.start()
    await two.start()
    await _submitted(one)
    await two.sync(TASK)
    # Both decide on the same sequence; both see the other live.
    results = await asyncio.gather(
        _claim(one, ONE, live=True), _claim(two, TWO, live=True), return_exceptions=True
    )
    won = [r for r in results if isinstance(r, int)]
    lost = [r for r in results if isinstance(r, Rejected)]
    assert won == [1] and [r.code for r in lost] == ["driven_elsewhere"], results
    claims = [a for t, a in await _types_and_actors(nc, names) if t == "task.driver_claimed"]
    assert len(claims) == 1
    await one.stop()
    await two.stop()


async def test_a_superseded_runner_gets_a_conflict_re_reads_and_writes_nothing(
    nc: nats.NATS, names: Names, tmp_path: Path
):
    """A runner that slept through its twin's takeover decides on its stale cache,
    is refused by the fence, re-reads, and stops: the takeover stays the last word."""
    stale = _store(nc, names, ONE)
    await stale.start()
    await _submitted(stale)
    assert await _claim(stale, ONE, live=False) == 1
    await stale.stop()  # its fold stops here: what it knows is from before the takeover
    twin = AggregateStore(nc.jetstream(), names, "task", tk.evolve, actor=TWO, follow=False)
    assert await _claim(twin, TWO, live=False) == 2
    sandboxes = AggregateStore(nc.jetstream(), names, "sandbox", sb.evolve, actor=ONE)
    runner = Runner(
        TASK,
        tasks=stale,
        sandboxes=Sandboxes(nc, names, sandboxes),
        save_store=SaveStore(nc, names),
        work_dir=tmp_path,
        output=OutputLog(nc.jetstream(), names),
        proof_window_s=100.0,
        decision_wait_s=1.0,
        http=HttpTool(),
        driver=DriverClaim(ONE, 1, held=lambda: True),
    )
    assert runner.state.driver_epoch == 1  # the cache does not know yet
    before = await _types_and_actors(nc, names)
    with pytest.raises(Superseded, match="epoch 1 is over"):
        await runner.append(ev.TaskStageEntered(stage="staging"), why="stage")
    assert await _types_and_actors(nc, names) == before
    assert before[-1] == ("task.driver_claimed", TWO)
    # Re-read: it knows now, and would not act outside the log either.
    assert runner.state.driver == TWO
    with pytest.raises(Superseded):
        runner.ensure_driving()
    runner.http.close()


async def test_a_runner_whose_instance_lease_lapsed_does_not_act(nc: nats.NATS, names: Names):
    store = _store(nc, names, ONE)
    await store.start()
    await _submitted(store)
    await _claim(store, ONE, live=False)
    sandboxes = AggregateStore(nc.jetstream(), names, "sandbox", sb.evolve, actor=ONE)
    held = [True]
    runner = Runner(
        TASK,
        tasks=store,
        sandboxes=Sandboxes(nc, names, sandboxes),
        save_store=SaveStore(nc, names),
        work_dir=Path("/nonexistent"),
        output=OutputLog(nc.jetstream(), names),
        proof_window_s=100.0,
        decision_wait_s=1.0,
        http=HttpTool(),
        driver=DriverClaim(ONE, 1, held=lambda: held[0]),
    )
    runner.ensure_driving()  # its claim, its lease: it may act
    held[0] = False
    with pytest.raises(Superseded, match="lease lapsed"):
        runner.ensure_driving()
    runner.http.close()
    await store.stop()
