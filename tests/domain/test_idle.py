"""Idle sandboxes: when the reaper stops one, what keeps it alive, and how a
command brings a reaped one back (seed 004, "Idle and cold starts")."""

from __future__ import annotations

import msgspec
from sandhold.domain import events as ev
from sandhold.domain import requests as rq
from sandhold.domain.fold import fold
from sandhold.domain.reconcile import plan
from sandhold.domain.sandbox import (
    DEFAULT_IDLE_TIMEOUT_S,
    Defaults,
    Sandbox,
    decide,
    evolve,
    reap_if_idle,
    reaps_at,
)
from sandhold.domain.views import cold_start_of, sandbox_view

from .history import (
    HOST_A,
    SID,
    T0,
    apply,
    cancel,
    cmd,
    command_ended,
    command_started,
    create,
    delete,
    dispatched,
    envelopes_for,
    given_sandbox,
    placed,
    run,
    start,
    started,
    starting,
    stop,
    stopped,
    then_rejected,
    when,
)

TIMEOUT = 60.0
# Created at T0, running from T0 + 3 (each step one second after the last).
IDLE_RUNNING = (create(idle_timeout_s=TIMEOUT), placed(), starting(), started())


def touch(key: str = "touch-1", *, tenant: str = "default") -> rq.TouchSandbox:
    return rq.TouchSandbox(key=key, tenant=tenant, sandbox_id=SID)


def reaped() -> Sandbox:
    """A sandbox the reaper stopped (its final save taken): phase stopped, reason idle."""
    state = given_sandbox(*IDLE_RUNNING)
    at = T0 + 3 + TIMEOUT
    return apply(state, reap_if_idle(state, now=at, cause="7"), time=at)


def _final_save_completed(save_id: str) -> list[ev.AnyEvent]:
    at = {"save_id": save_id, "host": HOST_A, "generation": 1}
    return [
        ev.SaveCaptured(**at, freeze_ms=0.0, freeze_method="none"),
        ev.SaveUploaded(
            **at,
            total_bytes=4096,
            files=3,
            uploaded_bytes=4096,
            uploaded_chunks=1,
            manifest_bytes=300,
            duration_ms=4.0,
        ),
        ev.SaveCompleted(save_id=save_id, total_bytes=4096, files=3),
    ]


def test_a_running_sandbox_is_reaped_its_timeout_after_its_last_activity() -> None:
    state = given_sandbox(*IDLE_RUNNING)
    assert reaps_at(state) == T0 + 3 + TIMEOUT  # started at T0 + 3
    assert reap_if_idle(state, now=T0 + 3 + TIMEOUT - 0.1, cause="7") == []
    [stop_requested] = reap_if_idle(state, now=T0 + 3 + TIMEOUT, cause="7")
    assert isinstance(stop_requested, ev.SandboxStopRequested)
    assert stop_requested.reason == "idle"
    # A Stop like any other: its final save is taken once processes are stopped.
    assert stop_requested.final_save_id == rq.save_id_for(SID, "final:idle:7")
    # Two savers deciding on the same state name the same stop.
    assert reap_if_idle(state, now=T0 + 999, cause="7") == [stop_requested]


def test_the_installation_default_is_recorded_and_0_means_never() -> None:
    created = when(None, create())
    assert isinstance(created, list) and isinstance(created[0], ev.SandboxCreated)
    assert created[0].idle_timeout_s == DEFAULT_IDLE_TIMEOUT_S == 1800.0
    own = decide(None, create(), defaults=Defaults(idle_timeout_s=300.0))
    assert isinstance(own[0], ev.SandboxCreated) and own[0].idle_timeout_s == 300.0
    never = given_sandbox(create(idle_timeout_s=0), placed(), starting(), started())
    assert reaps_at(never) is None
    assert reap_if_idle(never, now=T0 + 10 * 365 * 86400, cause="7") == []


def test_a_sandbox_created_before_idle_limits_is_never_reaped() -> None:
    # Its `sandbox.created` has no idle_timeout_s: nobody asked for reaping then.
    old = ev.SandboxCreated(sandbox_id=SID, request_key="old", request_digest="d")
    assert old.idle_timeout_s is None
    envelopes = envelopes_for(IDLE_RUNNING)
    legacy = [msgspec.structs.replace(envelopes[0], event=old), *envelopes[1:]]
    folded = fold(evolve, legacy, None)
    assert folded is not None and folded.phase == "running"
    assert reaps_at(folded) is None


def test_a_command_queued_or_running_keeps_it_and_its_end_restarts_the_clock() -> None:
    busy = given_sandbox(*IDLE_RUNNING, run(), dispatched(), command_started())
    assert busy.unended == 1 and reaps_at(busy) is None
    assert reap_if_idle(busy, now=T0 + 10 * TIMEOUT, cause="9") == []
    done = given_sandbox(*IDLE_RUNNING, run(), dispatched(), command_started(), command_ended())
    # The end (step 7, at T0 + 7) is the last activity.
    assert done.unended == 0 and reaps_at(done) == T0 + 7 + TIMEOUT
    queued = given_sandbox(*IDLE_RUNNING, run("run-1"), run("run-2"))
    assert queued.unended == 2 and reaps_at(queued) is None


def test_a_touch_starts_the_idle_time_again() -> None:
    state = given_sandbox(*IDLE_RUNNING, touch())
    assert state.last_active_at == T0 + 4 and reaps_at(state) == T0 + 4 + TIMEOUT
    # Idempotent by key: the same touch again changes nothing.
    assert when(state, touch()) == []
    view = sandbox_view(state, now=T0 + 10)
    assert view.idle is not None
    assert (view.idle.timeout_s, view.idle.since, view.idle.reaps_at) == (
        TIMEOUT,
        T0 + 4,
        T0 + 4 + TIMEOUT,
    )


def test_touch_is_refused_for_a_deleted_or_someone_elses_sandbox() -> None:
    deleting = given_sandbox(*IDLE_RUNNING, delete())
    then_rejected(when(deleting, touch("touch-2")), "sandbox_deleted")
    then_rejected(when(given_sandbox(*IDLE_RUNNING), touch(tenant="other")), "sandbox_not_found")


def test_a_reaped_sandbox_says_why_and_a_command_wakes_it() -> None:
    state = reaped()
    assert (state.phase, state.reason) == ("stopping", "idle")
    final = state.final_save_id or ""
    state = apply(state, [*_final_save_completed(final), stopped()], time=T0 + 100)
    assert (state.phase, state.reason) == ("stopped", "idle")
    assert state.saves[final].state == "completed"
    queued = decide(state, run("wake-1"))
    assert [type(e) for e in queued] == [ev.CommandQueued]
    state = apply(state, queued, time=T0 + 200)
    assert state.commands[cmd("wake-1")].cold
    # The scheduler starts it again (from its final save, wherever there is room).
    [start] = plan(state, lambda s: HOST_A).events
    assert isinstance(start, ev.SandboxStartRequested)
    assert start.woken_by == cmd("wake-1")
    state = apply(state, [start], time=T0 + 200.5)
    assert (state.phase, state.reason) == ("pending", "")
    [placement] = plan(state, lambda s: HOST_A).events
    assert isinstance(placement, ev.SandboxPlaced)
    assert placement.restore_save_id == final
    restore = ev.RestoreReport(
        save_id=state.final_save_id or "",
        restore_ms=80.0,
        fetched_bytes=4096,
        fetched_chunks=1,
        files=3,
    )
    state = apply(state, [placement], time=T0 + 201)
    state = apply(
        state,
        [ev.SandboxStarted(host=HOST_A, generation=2, restore=restore)],
        time=T0 + 202.5,
    )
    cold = cold_start_of(state, cmd("wake-1"))
    assert cold is not None
    assert (cold.from_save, cold.restore_ms, cold.bytes_fetched, cold.start_ms) == (
        final,
        80.0,
        4096,
        2000.0,
    )
    # ...and the command is dispatched to the new placement.
    assert any(isinstance(e, ev.CommandDispatched) for e in plan(state, lambda s: HOST_A).events)


def test_a_command_during_the_reaping_waits_for_it_to_end_then_wakes_it() -> None:
    stopping = reaped()
    state = apply(stopping, decide(stopping, run("early")), time=T0 + 90)
    # Not "not launched" as for a sandbox someone stopped: it waits, then wakes it.
    assert plan(state, lambda s: HOST_A).events == []
    state = apply(state, [stopped()], time=T0 + 91)
    [start] = plan(state, lambda s: HOST_A).events
    assert isinstance(start, ev.SandboxStartRequested) and start.woken_by == cmd("early")


def test_a_sandbox_someone_stopped_stays_stopped() -> None:
    state = given_sandbox(*IDLE_RUNNING, stop(), stopped())
    assert state.reason == ""
    then_rejected(when(state, run("late")), "sandbox_not_running")
    deleted_while_reaped = apply(reaped(), decide(reaped(), delete("rm")), time=T0 + 90)
    then_rejected(when(deleted_while_reaped, run("late")), "sandbox_not_running")


def test_an_explicit_start_of_a_reaped_sandbox_clears_the_reason() -> None:
    state = apply(reaped(), [stopped()], time=T0 + 100)
    state = apply(state, decide(state, start()), time=T0 + 101)
    assert (state.phase, state.reason) == ("pending", "")


def test_the_same_key_twice_to_a_reaped_sandbox_queues_one_command() -> None:
    state = reaped()
    final = state.final_save_id or ""
    state = apply(state, [*_final_save_completed(final), stopped()], time=T0 + 100)
    first = decide(state, run("wake-1"))
    state = apply(state, first, time=T0 + 101)
    assert decide(state, run("wake-1")) == []  # the same request again: nothing new
    assert [c.id for c in state.commands.values()] == [cmd("wake-1")]
    then_rejected(when(state, run("wake-1", argv=["other"])), "idempotency_conflict")


def test_a_reaped_sandbox_whose_final_save_failed_starts_from_the_save_before() -> None:
    earlier = "sv-earlier"
    at = {"host": HOST_A, "generation": 1}
    state = given_sandbox(*IDLE_RUNNING)
    state = apply(state, [ev.SaveRequested(save_id=earlier, kind="scheduled", **at)], time=T0 + 4)
    state = apply(state, _final_save_completed(earlier), time=T0 + 5)
    at_reap = T0 + 5 + TIMEOUT
    state = apply(state, reap_if_idle(state, now=at_reap, cause="9"), time=at_reap)
    final = state.final_save_id or ""
    assert final and final != earlier
    failed = ev.SaveFailed(save_id=final, stage="upload", reason="store unreachable", **at)
    state = apply(state, [failed, stopped()], time=at_reap + 2)

    view = sandbox_view(state, now=at_reap + 3)
    assert (view.phase, view.reason) == ("stopped", "idle")
    assert view.final_save is not None and view.final_save.state == "failed"
    assert view.recoverable_from.startswith(f"save {earlier}")  # status says so
    state = apply(state, decide(state, run("wake")), time=at_reap + 10)
    [wake] = plan(state, lambda s: HOST_A).events
    state = apply(state, [wake], time=at_reap + 11)
    [placement] = plan(state, lambda s: HOST_A).events
    assert isinstance(placement, ev.SandboxPlaced) and placement.restore_save_id == earlier


def test_a_cancelled_command_does_not_wake_a_reaped_sandbox() -> None:
    stopping = reaped()
    state = apply(stopping, decide(stopping, run("early")), time=T0 + 90)
    state = apply(state, decide(state, cancel(cmd("early"))), time=T0 + 91)
    state = apply(state, [stopped()], time=T0 + 92)
    events = plan(state, lambda s: HOST_A).events
    assert [type(e) for e in events] == [ev.CommandEnded]  # ended not_launched, no start


def test_an_activity_stamped_by_a_clock_behind_does_not_move_the_idle_time_back() -> None:
    state = given_sandbox(*IDLE_RUNNING)
    state = apply(state, decide(state, touch()), time=T0 + 500)
    # a host whose clock is 400 s behind reports a command's start
    state = apply(state, [*decide(state, run("late")), dispatched("late")], time=T0 + 501)
    state = apply(state, [command_started("late")], time=T0 + 100)
    state = apply(state, [command_ended("late")], time=T0 + 101)
    assert state.last_active_at == T0 + 501
    assert reap_if_idle(state, now=T0 + 501 + TIMEOUT - 1, cause="1") == []


def test_a_stop_of_a_reaped_sandbox_keeps_it_stopped_and_ends_what_waited_to_wake_it() -> None:
    stopping = reaped()
    final = stopping.final_save_id
    state = apply(stopping, decide(stopping, run("early")), time=T0 + 90)
    stop_events = decide(state, stop("user-stop"))
    assert [type(e) for e in stop_events] == [ev.SandboxStopRequested]
    state = apply(state, stop_events, time=T0 + 91)
    # The reaping's stop and final save stand; only the reason changes.
    assert (state.phase, state.reason, state.final_save_id) == ("stopping", "", final)
    assert decide(state, stop("user-stop")) == []  # the same Stop again: nothing new
    state = apply(state, [stopped()], time=T0 + 92)
    events = plan(state, lambda s: HOST_A).events
    assert [type(e) for e in events] == [ev.CommandEnded]  # not launched: no wake
    assert isinstance(events[0], ev.CommandEnded) and events[0].state == "not_launched"
    state = apply(state, events, time=T0 + 93)
    then_rejected(when(state, run("late")), "sandbox_not_running")


def test_a_cold_command_reports_the_start_it_waited_for_not_a_later_one() -> None:
    state = apply(reaped(), [stopped()], time=T0 + 100)
    state = apply(state, decide(state, run("wake-1")), time=T0 + 101)
    state = apply(state, plan(state, lambda s: HOST_A).events, time=T0 + 102)  # wake
    state = apply(state, plan(state, lambda s: HOST_A).events, time=T0 + 103)  # placed
    state = apply(state, [ev.SandboxStarted(host=HOST_A, generation=2)], time=T0 + 104)
    first = cold_start_of(state, cmd("wake-1"))
    assert first is not None and first.start_ms == 2000.0
    # It runs and ends; the sandbox is reaped and woken again by another command.
    state = apply(
        state,
        [dispatched("wake-1", generation=2), command_started("wake-1", generation=2)],
        time=T0 + 105,
    )
    state = apply(state, [command_ended("wake-1", generation=2)], time=T0 + 106)
    at = T0 + 106 + TIMEOUT
    state = apply(state, reap_if_idle(state, now=at, cause="2"), time=at)
    state = apply(state, [stopped(generation=2)], time=at + 1)
    state = apply(state, decide(state, run("wake-2")), time=at + 2)
    state = apply(state, plan(state, lambda s: HOST_A).events, time=at + 3)
    state = apply(state, plan(state, lambda s: HOST_A).events, time=at + 8)
    state = apply(state, [ev.SandboxStarted(host=HOST_A, generation=3)], time=at + 10)
    assert cold_start_of(state, cmd("wake-1")) == first
    second = cold_start_of(state, cmd("wake-2"))
    assert second is not None and second.start_ms == 7000.0
