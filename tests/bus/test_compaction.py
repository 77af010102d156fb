"""A compacting store (decision 057) on a real server: it keeps what deciding
needs, answers a retry from the whole state read back, and believes only a
checkpoint compacted as it compacts."""

from __future__ import annotations

from pathlib import Path

import nats
from sandhold.bus.names import Names
from sandhold.bus.store import AggregateStore, Executed
from sandhold.domain import events as ev
from sandhold.domain import requests as rq
from sandhold.domain import sandbox as sb

from tests.twins.support import append, running_sandbox

HOST = "h1"


def _store(
    nc: nats.NATS,
    names: Names,
    *,
    compact: bool = True,
    directory: Path | None = None,
    follow: bool = True,
    forget: bool = False,
) -> AggregateStore[sb.Sandbox]:
    return AggregateStore(
        nc.jetstream(),
        names,
        "sandbox",
        sb.evolve,
        actor="test",
        compact=sb.compact if compact else None,
        checkpoint_dir=directory,
        follow=follow,
        forget=sb.forgettable if forget else None,
    )


async def _run(
    store: AggregateStore[sb.Sandbox], sandbox_id: str, key: str
) -> Executed[sb.Sandbox]:
    """A run request decided as the scheduler decides one."""
    request = rq.RunCommand(key=key, tenant="default", sandbox_id=sandbox_id, argv=["true"])
    return await store.execute(
        sandbox_id,
        lambda s: sb.decide(s, request),
        id_base=f"req:{key}",
        causation_id=key,
        correlation_id=key,
        whole=lambda s: sb.whole_needed(s, request),
    )


async def _ended(nc: nats.NATS, names: Names, sandbox_id: str, key: str) -> None:
    command_id = rq.command_id_for(sandbox_id, key)
    await append(
        nc, names, "sandbox", sandbox_id,
        [
            ev.CommandDispatched(command_id=command_id, host=HOST, generation=1),
            ev.CommandEnded(command_id=command_id, state="exited", exit_code=0, host=HOST,
                            generation=1),
        ],
    )  # fmt: skip


async def test_an_ended_command_is_dropped_and_its_retry_answered_from_the_log(
    nc: nats.NATS, names: Names
):
    sandbox_id = await running_sandbox(nc, names, "long", HOST)
    store = _store(nc, names)
    await store.start()
    try:
        first = await _run(store, sandbox_id, "run-1")
        await _ended(nc, names, sandbox_id, "run-1")
        command_id = rq.command_id_for(sandbox_id, "run-1")
        state, _ = await store.sync(sandbox_id)
        assert state is not None and state.compacted
        assert command_id not in state.commands and "run-1" in state.requests

        retry = await _run(store, sandbox_id, "run-1")
        assert retry.appended == [], "a retry: nothing new in the log"
        assert retry.state is not None
        assert retry.state.commands[command_id].state == "exited", "its end, read back"
        assert sb.result_of(retry.state, rq.RunCommand(
            key="run-1", tenant="default", sandbox_id=sandbox_id, argv=["true"]
        )).id == first.appended[-1].event.command_id  # type: ignore[union-attr]  # fmt: skip
        cached, _ = store.get(sandbox_id)
        assert cached is not None and command_id not in cached.commands, "not kept again"

        new = await _run(store, sandbox_id, "run-2")
        assert [type(e.event) for e in new.appended] == [ev.CommandQueued]
        assert store._locks == {}, "no lock left behind once no one decides"
    finally:
        await store.stop()


async def test_a_checkpoint_compacted_otherwise_is_not_believed(
    nc: nats.NATS, names: Names, tmp_path: Path
):
    sandbox_id = await running_sandbox(nc, names, "kept", HOST)
    compacting = _store(nc, names, directory=tmp_path)
    await compacting.start()
    await _run(compacting, sandbox_id, "run-1")
    await _ended(nc, names, sandbox_id, "run-1")
    await compacting.catch_up()
    assert await compacting.checkpoint() > 0
    await compacting.stop()

    again = _store(nc, names, directory=tmp_path)
    await again.start()
    try:
        assert again.folded == 0, "compacted as it compacts: believed"
        state, _ = again.get(sandbox_id)
        assert state is not None and state.compacted and not state.commands
    finally:
        await again.stop()

    whole = _store(nc, names, compact=False, directory=tmp_path)
    await whole.start()
    try:
        assert whole.folded == 7, "folded from zero: the checkpoint dropped what it keeps"
        state, _ = whole.get(sandbox_id)
        assert state is not None and rq.command_id_for(sandbox_id, "run-1") in state.commands
    finally:
        await whole.stop()


async def test_a_decision_on_the_whole_state_leaves_the_cache_as_the_log_has_it(
    nc: nats.NATS, names: Names
):
    """A cancel of a command the cache has not read yet is decided on the whole
    state; what it appends is folded into a cache brought up to the same point."""
    sandbox_id = await running_sandbox(nc, names, "behind", HOST)
    store = _store(nc, names, follow=False)  # read on demand: behind until it reads
    await _run(store, sandbox_id, "run-1")
    await _ended(nc, names, sandbox_id, "run-1")
    await store.sync(sandbox_id)
    other = _store(nc, names, follow=False)  # another writer queues run-2
    await _run(other, sandbox_id, "run-2")
    run_2 = rq.command_id_for(sandbox_id, "run-2")
    cancel = rq.CancelCommand(
        key="cancel-2", tenant="default", sandbox_id=sandbox_id, command_id=run_2
    )
    done = await store.execute(
        sandbox_id,
        lambda s: sb.decide(s, cancel),
        id_base="req:cancel-2",
        causation_id="c",
        correlation_id="c",
        whole=lambda s: sb.whole_needed(s, cancel),
    )
    assert [type(e.event) for e in done.appended] == [ev.CommandCancelRequested]
    whole, last = await store.read_whole(sandbox_id)
    assert whole is not None
    assert store.get(sandbox_id) == (sb.compact(whole), last)
    assert store.get(sandbox_id)[0].commands[run_2].cancel_requested  # type: ignore[union-attr]
