"""A sandbox with many saves behind it costs no more per event than a new one:
`evolve` keeps the saves under way, the completed ones, the Snapshots, the
failure streak and the latest request as indexes (decision 055), and the
saver, recovery, the views and the Snapshot decision read those instead of
going through every save the sandbox ever took."""

from __future__ import annotations

import msgspec
from sandhold.domain import events as ev
from sandhold.domain import requests as rq
from sandhold.domain import saver as policy
from sandhold.domain import saves as sv
from sandhold.domain.recovery import after_loss
from sandhold.domain.sandbox import LostInfo, Sandbox, decide
from sandhold.domain.views import sandbox_view

from .history import (
    HOST_A,
    RUNNING,
    SID,
    T0,
    Step,
    apply,
    command_ended,
    command_started,
    dispatched,
    envelopes_for,
    evolve,
    given_sandbox,
    run,
    stop,
    when,
)
from .history import then_rejected as refused
from .test_long_lived import _guarded
from .test_saves import captured, completed, failed, snap_id, snapshot, uploaded


def _save(n: int) -> str:
    return rq.save_id_for(SID, f"scheduled@{n}")


def requested(n: int, generation: int = 1) -> ev.SaveRequested:
    return ev.SaveRequested(save_id=_save(n), kind="scheduled", host=HOST_A, generation=generation)


def _saved(n: int, *, first: int = 0) -> list[Step]:
    """`n` scheduled saves that completed, each but the last five then expired
    by retention (the saver's default keeps five)."""
    steps: list[Step] = []
    for i in range(first, first + n):
        steps += [requested(i), captured(_save(i)), uploaded(_save(i)), completed(_save(i))]
        if i - first >= 5:
            steps.append(ev.SavesExpired(save_ids=[_save(i - 5)]))
    return steps


def _reference(state: Sandbox) -> dict[str, object]:
    """The indexes as a pass over every save computes them."""
    records = list(state.saves.values())
    streak: list[str] = []
    for record in sorted(records, key=lambda r: r.requested_at):
        if record.state in ("completed", "expired"):
            streak = []
        elif record.state == "failed":
            streak.append(record.id)
    done = [r for r in records if r.state == "completed"]
    return {
        "in_flight": tuple(r.id for r in records if r.state in sv.IN_FLIGHT),
        "completed": tuple(r.id for r in done),
        "snapshots": tuple(r.id for r in records if r.kind == "snapshot"),
        "failures": tuple(streak),
        "last_request": max(((r.generation, r.requested_at) for r in records), default=None),
        "latest": max(done, key=lambda r: r.completed_at or 0.0, default=None),
    }


def _indexes(state: Sandbox) -> dict[str, object]:
    return {
        "in_flight": state.saves_in_flight,
        "completed": state.saves_completed,
        "snapshots": state.snapshot_ids,
        "failures": state.save_failures,
        "last_request": state.last_save_request,
        "latest": state.last_completed_save,
    }


def test_the_save_indexes_agree_with_the_saves_after_every_event():
    steps: list[Step] = [
        *RUNNING,
        *_saved(7),
        requested(100),
        captured(_save(100)),
        failed(_save(100)),
        snapshot(),
        captured(snap_id()),
        uploaded(snap_id()),
        completed(snap_id()),
        requested(101),
        failed(_save(101), stage="timeout"),
        run("touch"),  # stamps the saves requested since the count last moved
        dispatched("touch"),
        command_started("touch"),
        command_ended("touch"),
        requested(102),
        failed(_save(102)),
        requested(103),
        captured(_save(103)),
        uploaded(_save(103)),
        completed(_save(103)),  # the streak ends
        ev.SavesExpired(save_ids=[_save(2), _save(3)]),
        requested(104),
        failed(_save(104)),
        requested(105),
        captured(_save(105)),  # left under way
        stop(),  # a final save too
    ]
    state = None
    seen_failures = set()
    for envelope in envelopes_for(steps):
        state = evolve(state, envelope)
        assert state is not None
        assert _indexes(state) == _reference(state), envelope.event
        seen_failures.add(state.save_failures)
    assert state is not None
    # The history went through each kind of streak change: one grown, ended by
    # a completed Snapshot, grown again, ended by a scheduled save.
    assert {(_save(100),), (), (_save(101),), (_save(101), _save(102))} <= seen_failures
    assert state.save_failures == (_save(104),)
    assert state.saves_in_flight == (_save(105), state.final_save_id)
    assert state.snapshot_ids == (snap_id(),)


def test_a_failed_or_expired_save_does_not_change_again():
    state = given_sandbox(*RUNNING, *_saved(6), requested(50), failed(_save(50)))
    late = apply(state, [captured(_save(50)), uploaded(_save(50)), completed(_save(50))])
    assert late.saves[_save(50)] == state.saves[_save(50)]
    assert late.saves[_save(50)].state == "failed"
    assert late.save_failures == (_save(50),) and late.saves_in_flight == ()

    expired = state.saves[_save(0)]
    assert expired.state == "expired"
    again = apply(state, [completed(_save(0)), ev.SavesExpired(save_ids=[_save(0)])])
    assert again.saves[_save(0)] == expired
    assert again.saves_completed == state.saves_completed


def _long_saved() -> Sandbox:
    """A sandbox with 200 saves behind it, a failure streak, a Snapshot, and
    one save under way."""
    return given_sandbox(
        *RUNNING,
        *_saved(200),
        snapshot(),
        captured(snap_id()),
        uploaded(snap_id()),
        completed(snap_id()),
        *(s for n in (300, 301, 302) for s in (requested(n), failed(_save(n)))),
        requested(303),
    )


def test_the_saver_decides_without_going_through_every_save():
    state = _long_saved()
    guarded = _guarded(state)
    now = T0 + 10_000
    assert policy.due_save(guarded, now=now, cause="tick") == []  # one is under way
    assert [w.save_id for _, w in policy.save_work(guarded)] == [_save(303)]
    assert policy.awaiting_verification(guarded) == []
    timed_out = policy.timed_out(guarded, now=now + 10_000, timeout_s=600)
    assert [e.save_id for e in timed_out if isinstance(e, ev.SaveFailed)] == [_save(303)]
    assert policy.expired(guarded, keep_last=5) == []
    assert policy.expired(guarded, keep_last=2) == [
        ev.SavesExpired(save_ids=[_save(195), _save(196), _save(197)])
    ]
    kept = [*(_save(n) for n in range(195, 200)), snap_id()]
    assert policy.retained(guarded) == sorted(kept)

    # With nothing under way, the interval counts from the latest request.
    done = apply(
        state, [captured(_save(303)), uploaded(_save(303)), completed(_save(303))], time=T0 + 5000
    )
    last = done.saves[_save(303)].requested_at
    assert policy.due_save(_guarded(done), now=last + 1, cause="early") == []
    (due,) = policy.due_save(_guarded(done), now=last + done.save_interval_s + 1, cause="due")
    assert isinstance(due, ev.SaveRequested) and due.parent_id == _save(303)


def test_the_view_recovery_and_snapshots_do_not_go_through_every_save():
    state = _long_saved()
    view = sandbox_view(_guarded(state), now=T0 + 10_000)
    assert view.save_health is not None and view.save_health.state == "failing"
    assert view.save_in_progress is not None and view.save_in_progress.id == _save(303)
    assert [s.id for s in view.snapshots] == [snap_id()]
    assert view.last_completed_save is not None and view.last_completed_save.id == snap_id()

    lost = msgspec.structs.replace(
        state,
        phase="lost",
        lost=LostInfo(host=HOST_A, generation=1, last_renewal_at=T0, fence_at=T0),
    )
    ends = after_loss(_guarded(lost))
    assert [(e.save_id, e.stage) for e in ends if isinstance(e, ev.SaveFailed)] == [
        (_save(303), "interrupted")
    ]

    # A Snapshot's name is checked against the Snapshots alone.
    refused(when(_guarded(state), snapshot(key="snap-2")), "snapshot_name_taken")
    (other,) = decide(_guarded(state), snapshot(name="another", key="snap-3"))
    assert isinstance(other, ev.SaveRequested) and other.parent_id == snap_id()


def test_a_view_reads_only_the_saves_the_sandbox_names():
    """The read model's sandbox row keeps only `named_saves` (its lists render
    views from that row): the saves behind it, expired or failed before the
    streak, are not needed for the view, nor kept there."""
    state = _long_saved()
    named = state.named_saves()
    assert set(named) == {
        *(_save(n) for n in range(195, 200)),
        snap_id(),
        *(_save(n) for n in (300, 301, 302, 303)),
    }
    assert all(named[i] is state.saves[i] for i in named)
    now = T0 + 10_000
    assert sandbox_view(msgspec.structs.replace(state, saves=named), now=now) == sandbox_view(
        state, now=now
    )
    # A stop's final save and the save a placement restores are named too.
    stopping = msgspec.structs.replace(state, final_save_id=_save(3), restore_save_id=_save(4))
    assert {_save(3), _save(4)} <= set(stopping.named_saves())


def test_saves_taken_while_a_command_runs_are_not_kept_to_be_stamped():
    """Only a quiet save's `changed_at` matters, so only a save that may be
    quiet waits for the count to move: saves every interval under one long
    command do not pile up in `requested_since_activity`."""
    busy = [run("long"), dispatched("long"), command_started("long")]
    state = given_sandbox(*RUNNING, *busy, *_saved(50), requested(60))
    assert state.requested_since_activity == (_save(60),)  # not captured yet

    quiet = msgspec.structs.replace(captured(_save(60)), quiet=True)
    state = apply(state, [quiet, uploaded(_save(60)), completed(_save(60))], time=T0 + 5000)
    assert state.requested_since_activity == (_save(60),)
    ended = apply(state, [command_ended("long")], time=T0 + 5001)
    assert ended.saves[_save(60)].changed_at == T0 + 5001
    assert ended.saves[_save(49)].changed_at is None  # captured busy: nothing to stamp
