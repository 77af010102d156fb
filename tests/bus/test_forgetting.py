"""A store that forgets (decision 061) on a real server: a sandbox deleted with
nothing left of it is dropped from memory and checkpoints, its later events
fold onto nothing, and a request to it is still decided on what the log has."""

from __future__ import annotations

from pathlib import Path

import nats
import pytest
from sandhold.bus.names import Names
from sandhold.bus.store import AggregateStore, Executed
from sandhold.domain import events as ev
from sandhold.domain import requests as rq
from sandhold.domain import sandbox as sb
from sandhold.domain.errors import Rejected

from tests.bus.test_compaction import _store as compaction_store
from tests.twins.support import append, running_sandbox

HOST = "h1"


def _store(
    nc: nats.NATS, names: Names, *, forget: bool = True, directory: Path | None = None
) -> AggregateStore[sb.Sandbox]:
    return compaction_store(nc, names, forget=forget, directory=directory)


async def _decide(
    store: AggregateStore[sb.Sandbox], request: rq.AnyRequest, sandbox_id: str
) -> Executed[sb.Sandbox]:
    """A request decided as the scheduler decides one."""
    return await store.execute(
        sandbox_id,
        lambda s: sb.decide(s, request),
        id_base=f"req:{request.key}",
        causation_id=request.key,
        correlation_id=request.key,
        whole=lambda s: sb.whole_needed(s, request),
    )


async def _deleted_sandbox(nc: nats.NATS, names: Names, key: str) -> str:
    """A sandbox that ran and was deleted, with no save: nothing left of it."""
    sandbox_id = await running_sandbox(nc, names, key, HOST)
    await append(
        nc, names, "sandbox", sandbox_id,
        [
            ev.SandboxDeleteRequested(request_key=f"{key}-delete", request_digest="d"),
            ev.SandboxDeleted(host=HOST, generation=1),
        ],
    )  # fmt: skip
    return sandbox_id


async def test_a_deleted_sandbox_with_nothing_left_is_forgotten_and_still_answered(
    nc: nats.NATS, names: Names
):
    kept = await running_sandbox(nc, names, "alive", HOST)
    gone = await _deleted_sandbox(nc, names, "gone")
    store = _store(nc, names)
    await store.start()
    try:
        assert store.ids() == [kept], "only what is alive is held"
        assert store.get(gone) == (None, 0) and store.forgotten == 1
        # A later event on its subject folds onto nothing, and keeps nothing.
        await append(
            nc, names, "sandbox", gone, [ev.RequestNoted(request_key="k", request_digest="d")]
        )
        await store.catch_up()
        assert store.get(gone) == (None, 0) and gone not in store._seqs

        # Requests are decided on what the log has, not on "no such sandbox":
        retry = await _decide(store, rq.CreateSandbox(key="gone", tenant="default"), gone)
        assert retry.appended == [], "a retried create is a retry, not a new sandbox"
        assert retry.state is not None and retry.state.phase == "deleted"
        with pytest.raises(Rejected) as refused:
            await _decide(store, rq.StartSandbox(key="s", tenant="default", sandbox_id=gone), gone)
        assert refused.value.code == "sandbox_deleted"
        # ... and reading it does not keep it again (a read must end, too).
        assert await store.sync(gone) == (None, 0)
        assert store.ids() == [kept]

        # A new sandbox is created as ever (nothing in the log: one read, nothing folded).
        create = rq.CreateSandbox(key="new", tenant="default")
        new = await _decide(store, create, rq.sandbox_id_for("default", "new"))
        assert [type(e.event) for e in new.appended] == [ev.SandboxCreated]
    finally:
        await store.stop()


async def test_a_forgotten_sandbox_is_in_no_checkpoint(nc: nats.NATS, names: Names, tmp_path: Path):
    kept = await running_sandbox(nc, names, "alive", HOST)
    gone = await _deleted_sandbox(nc, names, "gone")
    # A checkpoint written by a store that did not forget holds it ...
    keeping = _store(nc, names, forget=False, directory=tmp_path)
    await keeping.start()
    assert sorted(keeping.ids()) == sorted([kept, gone])
    await keeping.stop()
    # ... and one that forgets leaves it out when it loads it, and writes it out.
    forgetting = _store(nc, names, directory=tmp_path)
    await forgetting.start()
    try:
        assert forgetting.folded == 0, "the checkpoint was believed"
        assert forgetting.ids() == [kept] and forgetting.get(gone) == (None, 0)
        await append(
            nc, names, "sandbox", kept, [ev.RequestNoted(request_key="k", request_digest="d")]
        )
        await forgetting.catch_up()
        assert await forgetting.checkpoint() > 0
    finally:
        await forgetting.stop()
    read = forgetting._checkpoints.read()  # type: ignore[union-attr]
    assert read is not None and set(read.states) == {kept} and gone not in read.seqs


async def test_a_decision_on_a_sandbox_read_back_never_folds_onto_part_of_it(
    nc: nats.NATS, names: Names
):
    """Decided on the sandbox read back (not held), while the follower folded
    only the first of its events meanwhile: what is appended is left to the
    follower, not folded onto that first state (which the sequence would then
    pass off as the whole)."""
    sandbox_id = await running_sandbox(nc, names, "behind", HOST)
    store = _store(nc, names)  # (not started: nothing folds but what the test does)
    read_whole = store.read_whole

    async def read_while_the_follower_folds_one(aggregate_id: str):
        found = await read_whole(aggregate_id)
        first = await nc.jetstream().get_msg(
            names.events_stream, seq=1, subject=store.subject(aggregate_id), next=True
        )
        store._apply_raw(aggregate_id, first)  # the follower, a moment behind
        return found

    store.read_whole = read_while_the_follower_folds_one  # type: ignore[method-assign]
    run = rq.RunCommand(key="run-1", tenant="default", sandbox_id=sandbox_id, argv=["true"])
    done = await _decide(store, run, sandbox_id)
    assert [type(e.event) for e in done.appended] == [ev.CommandQueued]
    assert done.state is not None and done.state.phase == "running", "decided on the whole"
    held, seq = store.get(sandbox_id)
    whole, last = await read_whole(sandbox_id)
    assert whole is not None and held is not None
    assert seq < last and held.phase == "pending", "left behind, for the follower to fold"
    assert rq.command_id_for(sandbox_id, "run-1") not in held.commands
