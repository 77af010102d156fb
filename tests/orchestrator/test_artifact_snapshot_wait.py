"""What a task's runner waits for when it asked for its artifacts' Snapshot:
the Snapshot's end, also once its record is gone from the orchestrator's
compacted store (deleted by someone and expired since, decisions 068, 069)."""

from __future__ import annotations

from sandhold.domain import requests as rq
from sandhold.domain import saver as policy
from sandhold.domain.sandbox import compact, decide
from sandhold.orchestrator.runner import _DROPPED, _ended_save

from tests.domain.history import RUNNING, SID, apply, given_sandbox
from tests.domain.test_saves import captured, completed, snap_id, snapshot, uploaded


def test_the_wait_ends_with_the_snapshot_or_with_its_record_dropped() -> None:
    state = given_sandbox(*RUNNING)
    assert _ended_save(state, snap_id(), "snap-1") is None, "not asked for (or not read) yet"
    state = given_sandbox(*RUNNING, snapshot())
    assert _ended_save(compact(state), snap_id(), "snap-1") is None, "under way"
    state = apply(state, [captured(snap_id()), uploaded(snap_id()), completed(snap_id())])
    ended = _ended_save(compact(state), snap_id(), "snap-1")
    assert ended is not None and (ended.state, ended.kind) == ("completed", "snapshot")
    # Someone deletes it; newer saves make retention drop it; the store keeps no record.
    state = apply(
        state,
        decide(state, rq.DeleteSnapshot(key="unsnap", sandbox_id=SID, save_id=snap_id())),
    )
    for n in range(2):
        [due] = policy.due_save(state, now=1e10 + n, cause=f"later-{n}")
        state = apply(state, [due, captured(due.save_id), uploaded(due.save_id)])
        state = apply(state, [completed(due.save_id)], time=1e10 + n)
    state = apply(state, policy.expired(state, keep_last=1))
    assert state.saves[snap_id()].state == "expired" and snap_id() not in compact(state).saves
    assert _ended_save(compact(state), snap_id(), "snap-1") is _DROPPED
