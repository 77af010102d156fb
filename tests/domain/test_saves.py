"""Saves, Snapshots and the final save of a stop: the pure rules."""

from __future__ import annotations

import msgspec
import pytest
from sandhold.domain import events as ev
from sandhold.domain import requests as rq
from sandhold.domain import sandbox as sb
from sandhold.domain import saver as policy
from sandhold.domain import saves as sv
from sandhold.domain import work as wk
from sandhold.domain.errors import Rejected
from sandhold.domain.reconcile import plan
from sandhold.domain.reports import decide_report
from sandhold.domain.sandbox import Sandbox, decide
from sandhold.domain.views import sandbox_view

from .history import (
    HOST_A,
    RUNNING,
    SID,
    T0,
    TENANT,
    apply,
    command_ended,
    command_started,
    delete,
    deleted,
    dispatched,
    given,
    given_sandbox,
    placed,
    run,
    started,
    starting,
    stop,
    when,
)
from .history import then_rejected as refused


def snapshot(name: str = "milestone", key: str = "snap-1") -> rq.SnapshotSandbox:
    return rq.SnapshotSandbox(key=key, sandbox_id=SID, name=name)


def snap_id(key: str = "snap-1") -> str:
    return rq.save_id_for(SID, f"snapshot:{key}")


def captured(save_id: str) -> ev.SaveCaptured:
    return ev.SaveCaptured(
        save_id=save_id, host=HOST_A, generation=1, freeze_ms=3.0, freeze_method="cgroup"
    )


def uploaded(save_id: str) -> ev.SaveUploaded:
    return ev.SaveUploaded(
        save_id=save_id,
        host=HOST_A,
        generation=1,
        total_bytes=10,
        files=2,
        uploaded_bytes=10,
        uploaded_chunks=1,
        manifest_bytes=100,
        duration_ms=5.0,
    )


def completed(save_id: str) -> ev.SaveCompleted:
    return ev.SaveCompleted(save_id=save_id, total_bytes=10, files=2)


def failed(save_id: str, stage: str = "upload") -> ev.SaveFailed:
    return ev.SaveFailed(
        save_id=save_id, stage=stage, reason="store unavailable", host=HOST_A, generation=1
    )


def test_a_snapshot_of_a_running_sandbox_is_a_requested_save() -> None:
    [event] = when(given(*RUNNING), snapshot())
    assert isinstance(event, ev.SaveRequested)
    assert (event.save_id, event.kind, event.snapshot_name) == (snap_id(), "snapshot", "milestone")
    assert (event.host, event.generation, event.parent_id) == (HOST_A, 1, None)


def test_a_snapshot_is_refused_unless_the_sandbox_runs() -> None:
    refused(when(given(*RUNNING, stop()), snapshot()), "sandbox_not_running")


def test_a_snapshot_name_is_taken_once_and_its_key_is_idempotent() -> None:
    refused(when(given(*RUNNING, snapshot()), snapshot(key="snap-2")), "snapshot_name_taken")
    assert when(given(*RUNNING, snapshot()), snapshot()) == []
    refused(when(given(*RUNNING, snapshot()), snapshot(name="other")), "idempotency_conflict")


def test_only_a_completed_save_counts_and_a_later_failure_never_replaces_it() -> None:
    state = given_sandbox(*RUNNING, snapshot())
    first = snap_id()
    state = apply(state, [captured(first), uploaded(first)])
    assert state.last_completed_save is None  # uploaded is not completed
    state = apply(state, [completed(first)], time=T0 + 2000)
    assert state.last_completed_save is not None and state.last_completed_save.id == first
    [later] = policy.due_save(state, now=T0 + 10_000, cause="later")
    state = apply(state, [later, captured(later.save_id), failed(later.save_id)])
    assert state.last_completed_save.id == first
    assert state.restore_point() == first


def test_reports_of_a_save_are_news_once_and_never_after_it_ended() -> None:
    state = given_sandbox(*RUNNING, snapshot())
    assert decide_report(state, captured(snap_id())) == [captured(snap_id())]
    state = apply(state, [captured(snap_id()), uploaded(snap_id()), completed(snap_id())])
    assert decide_report(state, captured(snap_id())) == []
    assert decide_report(state, failed(snap_id())) == []


def test_verification_decides_completed_or_failed() -> None:
    state = apply(given_sandbox(*RUNNING, snapshot()), [captured(snap_id()), uploaded(snap_id())])
    assert policy.verified(state, snap_id(), [], total_bytes=10, files=2) == [completed(snap_id())]
    [fail] = policy.verified(state, snap_id(), ["chunk ab missing"], total_bytes=0, files=0)
    assert isinstance(fail, ev.SaveFailed) and fail.stage == "verify"
    assert "chunk ab missing" in fail.reason
    done = apply(state, [completed(snap_id())])
    assert policy.verified(done, snap_id(), [], total_bytes=10, files=2) == []


def test_a_scheduled_save_is_due_after_the_interval_and_one_at_a_time() -> None:
    state = given_sandbox(*RUNNING)
    assert state.running_since is not None
    # The first one a fraction of the interval in (spread by the id), never later.
    first = 30 * policy.first_save_fraction(state.id)
    assert 15 <= first < 30
    assert policy.due_save(state, now=state.running_since + first - 0.01, cause="a") == []
    [due] = policy.due_save(state, now=state.running_since + first, cause="a")
    assert isinstance(due, ev.SaveRequested) and due.kind == "scheduled"
    state = apply(state, [due], time=state.running_since + first)
    assert policy.due_save(state, now=state.running_since + 1000, cause="b") == []
    assert policy.save_work(state) == [
        (HOST_A, wk.SaveSandboxWork(sandbox_id=SID, generation=1, save_id=due.save_id))
    ]


def test_saves_under_way_too_long_fail() -> None:
    state = given_sandbox(*RUNNING, snapshot())
    [timeout] = policy.timed_out(state, now=T0 + 10_000, timeout_s=60)
    assert isinstance(timeout, ev.SaveFailed) and timeout.stage == "timeout"
    assert policy.timed_out(state, now=T0 + 10, timeout_s=60) == []


def _with_a_snapshot_and_saves(count: int) -> tuple[Sandbox, list[str]]:
    """A running sandbox with a completed Snapshot, then `count` scheduled saves
    completed one after another; their ids, oldest first."""
    state = given_sandbox(*RUNNING, snapshot())
    state = apply(state, [captured(snap_id()), uploaded(snap_id()), completed(snap_id())])
    ids = []
    for n in range(count):
        [due] = policy.due_save(state, now=T0 + 100_000 * (n + 1), cause=f"s{n}")
        state = apply(state, [due], time=T0 + 100_000 * (n + 1))
        state = apply(state, [completed(due.save_id)], time=T0 + 100_000 * (n + 1) + 1)
        ids.append(due.save_id)
    return state, ids


def test_retention_keeps_the_last_saves_every_snapshot_and_parents_in_flight() -> None:
    state, ids = _with_a_snapshot_and_saves(4)
    [expired] = policy.expired(state, keep_last=2)
    assert expired == ev.SavesExpired(save_ids=ids[:2])
    state = apply(state, [expired])
    assert set(policy.retained(state)) == {snap_id(), *ids[2:]}
    [due] = policy.due_save(state, now=T0 + 10**7, cause="next")
    assert due.parent_id == ids[-1]


def test_a_deleted_sandbox_keeps_only_its_snapshots() -> None:
    """Decision 060: once deleted, nothing restores or is placed from its other
    saves (nor from the Snapshot it was made from, which its owner retains)."""
    state, ids = _with_a_snapshot_and_saves(3)
    state = msgspec.structs.replace(state, source_snapshot_id="its-origin")
    assert policy.expired(state, keep_last=5) == []
    assert "its-origin" not in policy.retained(state), "its own saves are its restore points"
    fresh = given_sandbox(*RUNNING)
    fresh = msgspec.structs.replace(fresh, source_snapshot_id="its-origin")
    assert "its-origin" in policy.retained(fresh), "until a save of its own completes"
    state = apply(state, [*decide(state, delete()), deleted()])
    assert state.phase == "deleted"
    [expired] = policy.expired(state, keep_last=5)
    assert expired == ev.SavesExpired(save_ids=ids)
    state = apply(state, [expired])
    assert policy.retained(state) == [snap_id()]
    assert sorted(policy.dropped(state)) == sorted(ids)
    assert policy.expired(state, keep_last=5) == []


def test_stop_takes_a_final_save_of_the_stopped_processes() -> None:
    state = given_sandbox(*RUNNING, stop())
    final = state.saves[state.final_save_id]
    assert (final.kind, final.state) == ("final", "requested")
    [(host, work)] = plan(state, lambda s: None).work
    assert host == HOST_A and isinstance(work, wk.StopSandboxWork)
    assert work.final_save_id == final.id and work.deadline_s == state.stop_deadline_s


def test_create_from_a_completed_snapshot_only() -> None:
    owner = apply(
        given_sandbox(*RUNNING, snapshot()),
        [captured(snap_id()), uploaded(snap_id()), completed(snap_id())],
    )
    request = rq.CreateSandbox(key="copy", from_snapshot=snap_id())
    [created] = decide(None, request, find_snapshot=lambda sid: (owner, owner.saves[sid]))
    assert isinstance(created, ev.SandboxCreated)
    assert (created.source_snapshot_id, created.source_sandbox_id) == (snap_id(), SID)
    refused(when(None, request), "snapshot_not_found")
    pending = given_sandbox(*RUNNING, snapshot())
    try:
        decide(None, request, find_snapshot=lambda sid: (pending, pending.saves[sid]))
    except Exception as err:
        assert getattr(err, "code", "") == "snapshot_not_completed"
    else:
        raise AssertionError("a snapshot under way is no starting point")
    other = rq.CreateSandbox(key="copy", tenant="other", from_snapshot=snap_id())
    try:
        decide(None, other, find_snapshot=lambda sid: (owner, owner.saves[sid]))
    except Exception as err:
        assert getattr(err, "code", "") == "snapshot_not_found"
    else:
        raise AssertionError("another tenant's snapshot is not found")


def test_status_says_what_is_recoverable_and_how_healthy_saving_is() -> None:
    state = given_sandbox(*RUNNING)
    view = sandbox_view(state, now=state.running_since + 1)
    assert view.recoverable_from.startswith("only the base image")
    assert view.save_health == sv.SaveHealth(state="ok") and view.rpo_s is None
    late = sandbox_view(state, now=state.running_since + 61)
    assert late.save_health is not None and late.save_health.state == "delayed"
    for n in range(3):
        [due] = policy.due_save(state, now=T0 + 1000 * (n + 1), cause=f"f{n}")
        state = apply(state, [due, failed(due.save_id)], time=T0 + 1000 * (n + 1))
    failing = sandbox_view(state, now=T0 + 3500)
    assert failing.save_health is not None and failing.save_health.state == "failing"
    assert "store unavailable" in failing.save_health.reason
    assert TENANT == "default"


def test_sandboxes_started_together_are_not_first_saved_together() -> None:
    fractions = [policy.first_save_fraction(f"sb-{i:016x}") for i in range(64)]
    assert all(0.5 <= f < 1.0 for f in fractions)
    assert max(fractions) - min(fractions) > 0.4  # spread over most of the half interval


# --- a sandbox whose files cannot have changed is not saved again (decision 051) ---


def _saved(state: Sandbox, at: float, *, quiet: bool) -> tuple[Sandbox, str]:
    """A scheduled save requested at `at`, captured (quiet or not) and completed."""
    [due] = policy.due_save(state, now=at, cause=f"at{at}")
    capture = msgspec.structs.replace(captured(due.save_id), quiet=quiet)
    state = apply(state, [due], time=at)
    state = apply(state, [capture, uploaded(due.save_id)], time=at + 1)
    return apply(state, [completed(due.save_id)], time=at + 2), due.save_id


def _queued_and_ended(state: Sandbox, at: float, key: str) -> Sandbox:
    [queued] = decide(state, run(key))
    state = apply(state, [queued], time=at)
    state = apply(state, [dispatched(key), command_started(key)], time=at + 0.5)
    return apply(state, [command_ended(key)], time=at + 1)


def test_a_quiet_save_holds_the_files_until_a_command_runs() -> None:
    state, save_id = _saved(given_sandbox(*RUNNING), T0 + 100, quiet=True)
    # Hours later, nothing ran: no scheduled save, nothing at risk, health ok.
    later = T0 + 10_000
    assert policy.due_save(state, now=later, cause="x") == []
    view = sandbox_view(state, now=later)
    assert view.unchanged_since_save == save_id
    assert view.rpo_s == 0.0
    assert view.save_health is not None and view.save_health.state == "ok"

    # A command ran at T0+9000: from then on the files may differ from the save.
    state = _queued_and_ended(state, T0 + 9000, "run-9")
    view = sandbox_view(state, now=later)
    assert view.unchanged_since_save is None
    assert view.rpo_s == later - (T0 + 9000)
    # The interval counts from that change, not from the old request.
    assert policy.due_save(state, now=T0 + 9000 + 29, cause="y") == []
    [due] = policy.due_save(state, now=T0 + 9000 + 30, cause="y")
    assert due.parent_id == save_id


def test_a_save_taken_while_something_ran_is_followed_by_the_next() -> None:
    state, _ = _saved(given_sandbox(*RUNNING), T0 + 100, quiet=False)
    [due] = policy.due_save(state, now=T0 + 100 + 30, cause="x")
    assert due.kind == "scheduled"
    assert sandbox_view(state, now=T0 + 200).unchanged_since_save is None


def test_a_command_between_the_request_and_the_capture_keeps_saves_coming() -> None:
    """A command queued before the request but started after the capture was not
    in the quiet capture: the count moved, so the save no longer holds the files."""
    state = given_sandbox(*RUNNING)
    [queued] = decide(state, run("early"))
    state = apply(state, [queued], time=T0 + 99)
    [due] = policy.due_save(state, now=T0 + 100, cause="x")
    state = apply(state, [due], time=T0 + 100)
    state = apply(
        state, [msgspec.structs.replace(captured(due.save_id), quiet=True)], time=T0 + 101
    )
    state = apply(state, [dispatched("early"), command_started("early")], time=T0 + 102)
    state = apply(state, [command_ended("early"), uploaded(due.save_id)], time=T0 + 103)
    state = apply(state, [completed(due.save_id)], time=T0 + 104)
    assert sandbox_view(state, now=T0 + 200).unchanged_since_save is None
    assert policy.due_save(state, now=T0 + 102 + 30, cause="y") != []


def test_a_running_command_or_a_new_placement_is_never_unchanged() -> None:
    state, _ = _saved(given_sandbox(*RUNNING), T0 + 100, quiet=True)
    [queued] = decide(state, run("long"))
    running = apply(state, [queued, dispatched("long")], time=T0 + 200)
    assert sandbox_view(running, now=T0 + 300).unchanged_since_save is None
    # Placed again (a recovery onto another host): its first save is taken.
    moved = apply(state, [placed(generation=2), starting(generation=2), started(generation=2)])
    assert sandbox_view(moved, now=T0 + 5000).unchanged_since_save is None
    assert policy.due_save(moved, now=T0 + 5000, cause="z") != []


def test_a_quiet_save_still_holds_the_files_while_the_sandbox_stops_or_is_lost() -> None:
    """Stopped by the reaper after a long quiet stretch, its final save under way
    (or failed): nothing is at risk, and its health is not "delayed"."""
    state, _ = _saved(given_sandbox(*RUNNING), T0 + 100, quiet=True)
    [stop_event] = decide(state, stop())
    stopping = apply(state, [stop_event], time=T0 + 36_000)
    view = sandbox_view(stopping, now=T0 + 36_000)
    assert view.phase == "stopping" and view.rpo_s == 0.0
    assert view.save_health is not None and view.save_health.state == "ok"
    assert view.unchanged_since_save is None  # only a running sandbox is "not saved again"
    lost = apply(
        state,
        [
            ev.SandboxLost(
                host=HOST_A, generation=1, last_renewal_at=T0 + 36_000, fence_at=T0 + 36_010
            )
        ],
        time=T0 + 36_005,
    )
    assert sandbox_view(lost, now=T0 + 36_005).rpo_s == 0.0


def test_a_recovery_from_a_quiet_save_is_behind_only_from_the_first_change() -> None:
    state, save_id = _saved(given_sandbox(*RUNNING), T0 + 100, quiet=True)
    loss = ev.SandboxLost(host=HOST_A, generation=1, last_renewal_at=T0 + 9000, fence_at=T0 + 9010)

    def recovered(state: Sandbox) -> sb.RecoveredFrom:
        state = apply(state, [loss, ev.SandboxFenced(host=HOST_A, generation=1)], time=T0 + 9005)
        state = apply(state, [ev.SandboxRecoveryRequested(cause="start")], time=T0 + 9020)
        placed2 = ev.SandboxPlaced(host="host-b", generation=2, restore_save_id=save_id)
        state = apply(state, [placed2, starting("host-b", 2), started("host-b", 2)], time=T0 + 9030)
        assert state.recovered_from is not None and state.recovered_from.save_id == save_id
        return state.recovered_from

    assert recovered(state).behind_failure_s == 0.0  # nothing ran since it was taken
    changed = _queued_and_ended(state, T0 + 8000, "late")
    assert recovered(changed).behind_failure_s == 1000.0  # from the command on


def test_the_saver_schedule_looks_at_running_sandboxes_and_saves_under_way() -> None:
    assert policy.on_schedule(given_sandbox(*RUNNING))
    stopped = apply(
        given_sandbox(*RUNNING), [ev.SandboxStopRequested(request_key="s", request_digest="d")]
    )
    assert stopped.phase == "stopping" and not stopped.saves_in_flight
    assert not policy.on_schedule(stopped)
    # Stopping with its final save under way: that save may still time out.
    saving = apply(
        given_sandbox(*RUNNING),
        [ev.SandboxStopRequested(request_key="s", request_digest="d", final_save_id="final-1")],
    )
    assert saving.phase == "stopping" and saving.saves_in_flight == ("final-1",)
    assert policy.on_schedule(saving)


# --- a capture that finds nothing changed stores nothing (decision 067) ---


def unchanged(save_id: str, *, quiet: bool = False) -> ev.SaveUnchanged:
    return ev.SaveUnchanged(
        save_id=save_id,
        host=HOST_A,
        generation=1,
        freeze_ms=1.0,
        freeze_method="cgroup",
        quiet=quiet,
    )


def test_an_unchanged_capture_ends_the_save_and_its_parent_holds_the_files_as_of_then() -> None:
    state, parent = _saved(given_sandbox(*RUNNING), T0 + 100, quiet=False)
    state = _queued_and_ended(state, T0 + 110, "run-true")  # a command ran: a save is due
    [due] = policy.due_save(state, now=T0 + 140, cause="x")
    assert due.parent_id == parent
    state = apply(state, [due], time=T0 + 140)
    assert decide_report(state, unchanged(due.save_id)) == [unchanged(due.save_id)]
    state = apply(state, [unchanged(due.save_id)], time=T0 + 141)

    record = state.saves[due.save_id]
    assert record.state == "unchanged" and record.captured_at == T0 + 141
    assert not state.saves_in_flight  # nothing to verify, nothing to time out
    latest = state.last_completed_save
    assert latest is not None and latest.id == parent  # still the restore point
    assert (latest.confirmed_at, latest.confirmed_generation) == (T0 + 141, 1)
    view = sandbox_view(state, now=T0 + 150)
    assert view.rpo_s == 150 - 141  # saved as of the capture, not the parent's completion
    assert view.last_completed_save is not None
    assert view.last_completed_save.confirmed_at == T0 + 141
    # The interval counts from this save's request: the next is due 30 s later.
    assert policy.due_save(state, now=T0 + 169, cause="y") == []
    assert policy.due_save(state, now=T0 + 170, cause="y") != []
    # A report of it again is no news; nor a later capture or upload of it.
    assert decide_report(state, unchanged(due.save_id)) == []
    assert decide_report(state, captured(due.save_id)) == []


def test_a_quiet_unchanged_capture_holds_the_files_until_a_command_runs() -> None:
    state, parent = _saved(given_sandbox(*RUNNING), T0 + 100, quiet=False)
    state = _queued_and_ended(state, T0 + 110, "run-true")
    [due] = policy.due_save(state, now=T0 + 140, cause="x")
    state = apply(state, [due], time=T0 + 140)
    state = apply(state, [unchanged(due.save_id, quiet=True)], time=T0 + 141)
    # Quiet, nothing since: not saved again, nothing at risk, hours later.
    later = T0 + 10_000
    assert policy.due_save(state, now=later, cause="y") == []
    view = sandbox_view(state, now=later)
    assert view.unchanged_since_save == parent and view.rpo_s == 0.0
    # A command ran: from its start the files may differ.
    state = _queued_and_ended(state, T0 + 9000, "run-9")
    view = sandbox_view(state, now=later)
    assert view.unchanged_since_save is None and view.rpo_s == later - (T0 + 9000)
    assert policy.due_save(state, now=T0 + 9000 + 30, cause="z") != []


def test_an_unchanged_capture_ends_a_failure_streak() -> None:
    state, parent = _saved(given_sandbox(*RUNNING), T0 + 100, quiet=False)
    for i in range(sv.FAILING_AFTER):
        [due] = policy.due_save(state, now=T0 + 200 + 100 * i, cause=f"f{i}")
        state = apply(state, [due], time=T0 + 200 + 100 * i)
        state = apply(state, [failed(due.save_id)], time=T0 + 201 + 100 * i)
    view = sandbox_view(state, now=T0 + 600)
    assert view.save_health is not None and view.save_health.state == "failing"
    [due] = policy.due_save(state, now=T0 + 700, cause="ok")
    state = apply(state, [due, unchanged(due.save_id)], time=T0 + 700)
    view = sandbox_view(state, now=T0 + 701)
    assert view.save_health is not None and view.save_health.state == "ok"


def test_only_a_scheduled_save_with_a_parent_may_end_unchanged() -> None:
    state, _ = _saved(given_sandbox(*RUNNING), T0 + 100, quiet=False)
    [requested] = decide(state, snapshot())
    state = apply(state, [requested], time=T0 + 120)
    with pytest.raises(Rejected) as refused_snapshot:
        decide_report(state, unchanged(snap_id()))
    assert refused_snapshot.value.code == "save_must_be_stored"
    first = given_sandbox(*RUNNING)
    [due] = policy.due_save(first, now=T0 + 100, cause="first")
    assert due.parent_id is None
    first = apply(first, [due], time=T0 + 100)
    with pytest.raises(Rejected):
        decide_report(first, unchanged(due.save_id))


def test_an_unchanged_capture_confirms_nothing_once_another_save_completed() -> None:
    """A Snapshot completed between the request and the capture: the parent is
    no longer the restore point, and the capture says nothing of the Snapshot."""
    state, parent = _saved(given_sandbox(*RUNNING), T0 + 100, quiet=False)
    state = _queued_and_ended(state, T0 + 110, "run-true")
    [due] = policy.due_save(state, now=T0 + 140, cause="x")
    [snap] = decide(apply(state, [due], time=T0 + 140), snapshot())
    state = apply(state, [due, snap], time=T0 + 140)
    state = apply(
        state,
        [captured(snap_id()), uploaded(snap_id()), completed(snap_id())],
        time=T0 + 141,
    )
    state = apply(state, [unchanged(due.save_id, quiet=True)], time=T0 + 142)
    assert state.saves[due.save_id].state == "unchanged"
    latest = state.last_completed_save
    assert latest is not None and latest.id == snap_id() and latest.confirmed_at is None
    assert state.saves[parent].confirmed_at is None


# --- deleting a Snapshot (decision 069) ------------------------------------------


def delete_snapshot(save_id: str, key: str = "unsnap-1") -> rq.DeleteSnapshot:
    return rq.DeleteSnapshot(key=key, sandbox_id=SID, save_id=save_id)


def test_a_deleted_snapshot_is_a_save_like_the_others_and_retention_drops_it() -> None:
    state, ids = _with_a_snapshot_and_saves(2)
    assert policy.expired(state, keep_last=2) == [], "a Snapshot is never expired"
    [gone] = when(state, delete_snapshot(snap_id()))
    assert gone == ev.SnapshotDeleted(
        save_id=snap_id(), request_key="unsnap-1", request_digest=gone.request_digest
    )
    state = apply(state, [gone])
    record = state.saves[snap_id()]
    assert (record.kind, record.snapshot_name, record.state) == ("scheduled", None, "completed")
    assert state.snapshots() == [] and sandbox_view(state, now=T0).snapshots == []
    # The oldest completed save now: retention keeping two drops it.
    [expired] = policy.expired(state, keep_last=2)
    assert expired == ev.SavesExpired(save_ids=[snap_id()])
    state = apply(state, [expired])
    assert snap_id() in policy.dropped(state) and snap_id() not in policy.retained(state)
    assert set(policy.retained(state)) == set(ids)


def test_the_newest_save_stays_the_restore_point_when_its_snapshot_is_deleted() -> None:
    """Deleting a Snapshot never takes away what a failure would restore: the
    newest completed save stays, as any save retention keeps."""
    state, ids = _with_a_snapshot_and_saves(1)
    [due] = policy.due_save(state, now=T0 + 10**7, cause="later")
    state = apply(state, [due, captured(due.save_id)], time=T0 + 10**7)
    [snap] = decide(state, snapshot("newest", key="snap-2"))
    state = apply(state, [snap, captured(snap_id("snap-2")), uploaded(snap_id("snap-2"))])
    state = apply(state, [completed(snap_id("snap-2"))], time=T0 + 10**7 + 5)
    state = apply(state, when(state, delete_snapshot(snap_id("snap-2"))))
    assert state.restore_point() == snap_id("snap-2")
    assert policy.expired(state, keep_last=1) == [ev.SavesExpired(save_ids=ids)]
    assert snap_id("snap-2") in policy.retained(state)
    assert due.parent_id == ids[0] and ids[0] in policy.retained(state), "a parent in use stays"


def test_deleting_a_snapshot_refuses_other_saves_and_is_idempotent() -> None:
    under_way = given_sandbox(*RUNNING, snapshot())
    for report in ([], [captured(snap_id())], [uploaded(snap_id())]):
        under_way = apply(under_way, report)
        refused(when(under_way, delete_snapshot(snap_id())), "snapshot_not_completed")
    failed_one = apply(under_way, [failed(snap_id(), "verify")])
    assert len(when(failed_one, delete_snapshot(snap_id()))) == 1, "a failed one may go"
    state, ids = _with_a_snapshot_and_saves(1)
    refused(when(state, delete_snapshot(ids[0])), "snapshot_not_found")
    refused(when(state, delete_snapshot("sv-0000000000000000")), "snapshot_not_found")
    intruder = rq.DeleteSnapshot(key="x", tenant="other", sandbox_id=SID, save_id=snap_id())
    refused(when(state, intruder), "sandbox_not_found")
    state = apply(state, when(state, delete_snapshot(snap_id())))
    assert when(state, delete_snapshot(snap_id())) == [], "a retry changes nothing"
    assert sb.result_of(state, delete_snapshot(snap_id())) == state.saves[snap_id()]
    refused(when(state, delete_snapshot(snap_id(), key="unsnap-2")), "snapshot_not_found")
    refused(when(state, delete_snapshot(ids[0], key="unsnap-1")), "idempotency_conflict")
    # Its name is free again, and nothing can be created from it any more.
    assert when(state, snapshot()) == [], "the Snapshot request's own key: a retry"
    assert len(when(state, snapshot(key="snap-again"))) == 1, "the name is free"
    request = rq.CreateSandbox(key="copy", from_snapshot=snap_id())
    with pytest.raises(Rejected) as refusal:
        decide(None, request, find_snapshot=lambda sid: (state, state.saves[sid]))
    assert refusal.value.code == "snapshot_not_found"


def test_a_deleted_sandboxs_snapshot_can_be_deleted_and_then_nothing_is_left() -> None:
    state, ids = _with_a_snapshot_and_saves(1)
    state = apply(state, [*decide(state, delete()), deleted()])
    state = apply(state, policy.expired(state, keep_last=5))
    assert not sb.forgettable(state), "its Snapshot is kept for it"
    state = apply(state, when(state, delete_snapshot(snap_id())))
    [expired] = policy.expired(state, keep_last=5)
    assert expired == ev.SavesExpired(save_ids=[snap_id()])
    state = apply(state, [expired])
    assert policy.retained(state) == [] and sb.forgettable(state)


def test_a_save_being_restored_is_retained_whatever_was_said_of_it_since() -> None:
    """A placement restoring a save (a recovery, a create from a Snapshot) keeps
    its files, even if retention or a Snapshot's delete dropped it meanwhile."""
    state, ids = _with_a_snapshot_and_saves(1)
    restoring = msgspec.structs.replace(
        state, phase="starting", restore_save_id="sv-0123456789abcdef"
    )
    assert "sv-0123456789abcdef" in policy.retained(restoring)
    running = msgspec.structs.replace(restoring, phase="running")
    assert "sv-0123456789abcdef" not in policy.retained(running), "restored: nothing holds it"


# --- a command's end that found the files unchanged (decision 078) ---


def _ran_and_looked(
    state: Sandbox, at: float, key: str, *, files_of: str | None, moved: int = 0
) -> Sandbox:
    """A command queued, started and ended at `at`..`at + 1`; its host looked at
    the files at its end (`files_of`), at the count before the end less `moved`
    (what was recorded after the host looked)."""
    [queued] = decide(state, run(key))
    state = apply(state, [queued], time=at)
    state = apply(state, [dispatched(key), command_started(key)], time=at + 0.5)
    end = msgspec.structs.replace(
        command_ended(key), files_of=files_of, files_at=state.activity - moved
    )
    return apply(state, [end], time=at + 1)


def test_a_command_that_changed_nothing_brings_no_save() -> None:
    state, save_id = _saved(given_sandbox(*RUNNING), T0 + 100, quiet=False)
    state = _ran_and_looked(state, T0 + 200, "run-true", files_of=save_id)
    later = T0 + 10_000
    assert policy.due_save(state, now=later, cause="x") == []
    view = sandbox_view(state, now=later)
    assert view.unchanged_since_save == save_id and view.rpo_s == 0.0
    latest = state.last_completed_save
    assert latest is not None and latest.id == save_id
    # Held as of the end, by the placement that looked: a quiet holding from there.
    assert (latest.confirmed_at, latest.confirmed_generation) == (T0 + 201, 1)
    assert latest.quiet and latest.changed_at is None
    # The next command that may change a file starts the interval again.
    state = _queued_and_ended(state, T0 + 9000, "run-9")
    assert sandbox_view(state, now=later).unchanged_since_save is None
    assert sandbox_view(state, now=later).rpo_s == later - (T0 + 9000)
    assert policy.due_save(state, now=T0 + 9000 + 29, cause="y") == []
    assert policy.due_save(state, now=T0 + 9000 + 30, cause="y") != []


@pytest.mark.parametrize(
    "why",
    ["not looked", "moved after the look", "another command unended", "another save completed"],
)
def test_an_end_holds_the_files_only_as_its_host_found_them_with_nothing_since(why: str) -> None:
    """The end's word counts only for the last completed save, the only command,
    and the count the host looked at; anything else leaves the save due."""
    state, save_id = _saved(given_sandbox(*RUNNING), T0 + 100, quiet=True)
    files_of: str | None = save_id
    moved = 0
    if why == "not looked":
        files_of = None
    elif why == "moved after the look":
        moved = 1  # e.g. a command queued and ended between the look and the end
    elif why == "another command unended":
        [other] = decide(state, run("other"))
        state = apply(state, [other], time=T0 + 150)
    else:
        state, newer = _saved(_queued_and_ended(state, T0 + 150, "w"), T0 + 180, quiet=True)
        assert newer != save_id
    state = _ran_and_looked(state, T0 + 200, "run-true", files_of=files_of, moved=moved)
    assert sandbox_view(state, now=T0 + 500).unchanged_since_save is None
    assert policy.due_save(state, now=T0 + 500, cause="x") != []


def test_an_unchanged_capture_requested_before_an_end_that_held_the_files_undoes_nothing() -> None:
    """A save requested while a command ran ends unchanged after the command's
    end held the files: the end is the later word, so the save stays held."""
    state, save_id = _saved(given_sandbox(*RUNNING), T0 + 100, quiet=True)
    [queued] = decide(state, run("run-true"))
    state = apply(state, [queued, dispatched("run-true")], time=T0 + 200)
    state = apply(state, [command_started("run-true")], time=T0 + 200.5)
    during = ev.SaveRequested(
        save_id="sv-during", kind="scheduled", host=HOST_A, generation=1, parent_id=save_id
    )
    state = apply(state, [during], time=T0 + 200.6)
    end = msgspec.structs.replace(
        command_ended("run-true"), files_of=save_id, files_at=state.activity
    )
    state = apply(state, [end], time=T0 + 201)
    assert sandbox_view(state, now=T0 + 300).unchanged_since_save == save_id
    state = apply(state, [unchanged("sv-during")], time=T0 + 202)
    assert state.saves["sv-during"].state == "unchanged"
    assert sandbox_view(state, now=T0 + 300).unchanged_since_save == save_id
    latest = state.last_completed_save
    assert latest is not None and latest.confirmed_at == T0 + 201
    assert policy.due_save(state, now=T0 + 10_000, cause="x") == []
