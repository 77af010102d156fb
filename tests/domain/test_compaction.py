"""What a service keeps of a sandbox (`compact`, decision 057) decides as the
whole sandbox would, over random histories made by the real deciders
(`test_fold_property.drive`), and is a function of the log alone."""

from __future__ import annotations

from hypothesis import given
from sandhold.domain import events as ev
from sandhold.domain import recovery
from sandhold.domain import requests as rq
from sandhold.domain import saver as policy
from sandhold.domain.errors import Rejected
from sandhold.domain.reconcile import plan
from sandhold.domain.reports import decide_report
from sandhold.domain.sandbox import (
    Sandbox,
    compact,
    decide,
    ended_away,
    evolve,
    queued_by,
    result_of,
    saved_until,
    unchanged_since,
    whole_needed,
)
from sandhold.domain.views import reply_for, sandbox_view

from . import test_fold_property as fp
from .history import (
    HOST_A,
    RUNNING,
    SID,
    apply,
    cmd,
    command_ended,
    delete,
    deleted,
    dispatched,
    given_sandbox,
    run,
    stop,
    stopped,
)

Outcome = tuple[str, object]


def compacted_fold(trace: fp.Trace) -> list[Sandbox | None]:
    """The states as a compacting store holds them: compacted after every event."""
    states: list[Sandbox | None] = [None]
    for line in trace.log:
        state = evolve(states[-1], fp.DECODER.decode(line))
        states.append(None if state is None else compact(state))
    return states


def assert_compacted_as_the_whole_fold(trace: fp.Trace) -> None:
    """A compacted state depends on the log alone, not on when it was compacted:
    a checkpoint's states are compared with `compact(fold from zero)` (audit)."""
    for n, (kept, whole) in enumerate(zip(compacted_fold(trace), trace.states, strict=True)):
        assert kept == (None if whole is None else compact(whole)), f"after {n} envelopes"


def assert_decided_as_on_the_whole(trace: fp.Trace, request_choice: fp.Choice) -> None:
    """A request drawn against the whole state (retries of ended commands
    included), decided as a store decides on what it kept, is decided as on
    the whole."""
    whole = trace.state
    kept = compacted_fold(trace)[-1]
    assert whole is not None and kept is not None
    request = fp.read_request(whole, request_choice)
    assert as_a_store_decides(kept, whole, request) == as_the_whole_decides(whole, request)


def as_a_store_decides(kept: Sandbox, whole: Sandbox, request: rq.AnyRequest) -> Outcome:
    """`AggregateStore.execute` with `whole=`: on the whole state where
    `whole_needed` says so, else on the kept one; the reply is then made from
    the state the store holds (compacted)."""
    if whole_needed(kept, request):
        return as_the_whole_decides(whole, request)
    try:
        events = decide(kept, request)
    except Rejected as refusal:
        return "refused", refusal.code
    return "decided", (events, _reply(compact(apply(kept, events)), request))


def as_the_whole_decides(whole: Sandbox, request: rq.AnyRequest) -> Outcome:
    try:
        events = decide(whole, request)
    except Rejected as refusal:
        return "refused", refusal.code
    return "decided", (events, _reply(apply(whole, events), request))


def _reply(state: Sandbox, request: rq.AnyRequest) -> object:
    """What the caller is sent (the scheduler's reply), at a fixed time."""
    return reply_for(result_of(state, request), SID, now=fp.T0 + 1000)


@fp.SETTINGS
@given(fp.MEMORY_CHOICE, fp.STEPS)
def test_compacting_after_every_event_is_compacting_the_whole_fold(
    memory_n: int, steps: list[fp.Choice]
) -> None:
    assert_compacted_as_the_whole_fold(fp.drive(memory_n, steps))


@fp.SETTINGS
@given(fp.MEMORY_CHOICE, fp.STEPS, fp.CHOICE)
def test_any_request_decided_on_the_kept_state_is_decided_as_on_the_whole(
    memory_n: int, steps: list[fp.Choice], request_choice: fp.Choice
) -> None:
    assert_decided_as_on_the_whole(fp.drive(memory_n, steps), request_choice)


@fp.SETTINGS
@given(fp.MEMORY_CHOICE, fp.STEPS)
def test_the_scheduler_plans_the_same_on_the_kept_state(
    memory_n: int, steps: list[fp.Choice]
) -> None:
    trace = fp.drive(memory_n, steps)
    for kept, whole in zip(compacted_fold(trace)[1:], trace.states[1:], strict=True):
        assert kept is not None and whole is not None
        assert plan(kept, fp.choose(HOST_A)) == plan(whole, fp.choose(HOST_A))


def test_a_deleted_sandbox_keeps_neither_commands_nor_request_keys() -> None:
    whole = given_sandbox(
        *RUNNING, run("run-1"), dispatched("run-1"), command_ended("run-1"),
        stop(), stopped(), delete(), deleted(),
    )  # fmt: skip
    assert whole.requests and whole.commands
    kept = compact(whole)
    assert kept.compacted and not kept.requests and not kept.commands
    assert kept.ended_counts == whole.ended_counts, "what views count stays"
    assert compact(kept) is kept, "nothing more to drop: the same state, no copy"


def test_a_live_sandbox_drops_its_ended_commands_and_keeps_their_keys() -> None:
    whole = given_sandbox(
        *RUNNING, run("run-1"), dispatched("run-1"), command_ended("run-1"), run("run-2")
    )
    kept = compact(whole)
    assert list(kept.commands) == [cmd("run-2")], "the unended one stays"
    assert kept.requests == whole.requests, "a retry of run-1 is still known as one"
    assert kept.compacted and whole_needed(kept, run("run-1")), "its reply needs the whole"
    assert not whole_needed(kept, run("run-3")), "a new run decides on what is kept"
    assert compact(given_sandbox(*RUNNING, run("run-1"))).compacted is False, "nothing to drop"


def test_a_run_is_known_by_its_key_once_its_command_is_compacted_away() -> None:
    whole = given_sandbox(*RUNNING, run("run-1"), dispatched("run-1"), command_ended("run-1"))
    kept = compact(whole)
    assert queued_by(whole, "run-1") and queued_by(kept, "run-1")
    assert not queued_by(kept, "run-2"), "never sent"
    assert not ended_away(whole, cmd("run-1"), "run-1"), "kept whole: its record is there"
    assert ended_away(kept, cmd("run-1"), "run-1"), "in the log only"
    assert not ended_away(kept, cmd("run-2"), "run-2")
    deleted_ = compact(
        given_sandbox(
            *RUNNING, run("run-1"), dispatched("run-1"), command_ended("run-1"),
            stop(), stopped(), delete(), deleted(),
        )
    )  # fmt: skip
    assert not deleted_.requests and ended_away(deleted_, cmd("run-1"), "run-1"), "keys gone too"


# --- saves (decision 068) ------------------------------------------------------


def saves_seen(state: Sandbox, *, now: float) -> tuple[object, ...]:
    """Everything the saver, recovery, the scheduler's replies and the views
    decide or show of a sandbox's saves."""
    return (
        policy.due_save(state, now=now, cause="tick"),
        policy.due_save(state, now=now + 10_000, cause="tick"),
        policy.save_work(state),
        policy.awaiting_verification(state),
        policy.timed_out(state, now=now, timeout_s=3.0),
        policy.expired(state, keep_last=1),
        policy.expired(state, keep_last=5),
        policy.retained(state),
        unchanged_since(state),
        saved_until(state, now=now),
        recovery.after_loss(state),
        sandbox_view(state, now=now),
        state.restore_point(),
        state.restore_digest(),
        state.named_saves(),
    )


def reports_decided(state: Sandbox, save_ids: list[str]) -> list[object]:
    """What each kind of host report about each save decides: a late one about a
    save the kept state dropped must change nothing there, as on the whole."""
    outcomes: list[object] = []
    for save_id in save_ids:
        for report in fp.save_reports_of(save_id, host=HOST_A, generation=state.generation):
            try:
                outcomes.append(decide_report(state, report))
            except Rejected as refusal:
                outcomes.append(refusal.code)
    return outcomes


@fp.SETTINGS
@given(fp.MEMORY_CHOICE, fp.LONG_STEPS)
def test_a_sandbox_with_saves_compacted_after_every_event_is_its_whole_fold_compacted(
    memory_n: int, steps: list[fp.Choice]
) -> None:
    assert_compacted_as_the_whole_fold(fp.drive(memory_n, steps, fp.SAVES_MIX))


@fp.SETTINGS
@given(fp.MEMORY_CHOICE, fp.LONG_STEPS)
def test_the_saves_decide_and_show_the_same_on_the_kept_state(
    memory_n: int, steps: list[fp.Choice]
) -> None:
    trace = fp.drive(memory_n, steps, fp.SAVES_MIX)
    kept_states = compacted_fold(trace)
    for n, (kept, whole) in enumerate(zip(kept_states[1:], trace.states[1:], strict=True), 1):
        assert kept is not None and whole is not None
        now = fp.T0 + n / 7
        assert saves_seen(kept, now=now) == saves_seen(whole, now=now), f"after {n}"
        assert set(policy.dropped(kept)) <= set(policy.dropped(whole)), "never more dropped"
        every_save = list(whole.saves)
        assert reports_decided(kept, every_save) == reports_decided(whole, every_save)


@fp.SETTINGS
@given(fp.MEMORY_CHOICE, fp.LONG_STEPS, fp.CHOICE)
def test_any_request_to_a_sandbox_with_saves_is_decided_on_the_kept_state_as_on_the_whole(
    memory_n: int, steps: list[fp.Choice], request_choice: fp.Choice
) -> None:
    trace = fp.drive(memory_n, steps, fp.SAVES_MIX)
    whole = trace.state
    kept = compacted_fold(trace)[-1]
    assert whole is not None and kept is not None
    deletes = [
        rq.DeleteSnapshot(key=key, tenant="default", sandbox_id=SID, save_id=save_id)
        for save_id in whole.saves
        for key in ("d-new", *(k for k in whole.requests if k.startswith("d")))
    ]  # a new key, and every key a delete used (retries, conflicts)
    retries = [
        rq.SnapshotSandbox(key=key, tenant="default", sandbox_id=SID, name=f"snap-{n % 4}")
        for key in whole.requests
        if key.startswith("s")
        for n in range(4)
    ]  # a Snapshot's retry (its own name among them), its Snapshot deleted and dropped maybe
    for request in (
        fp.read_request(whole, request_choice),
        rq.SnapshotSandbox(key="s1", tenant="default", sandbox_id=SID, name="snap-1"),
        *deletes,
        *retries,
    ):
        assert as_a_store_decides(kept, whole, request) == as_the_whole_decides(whole, request)


def test_saves_that_nothing_names_go_and_the_rest_stay() -> None:
    """Expired, failed behind a later success, and unchanged saves go; the
    completed one and the failure streak after it stay."""
    state = given_sandbox(*RUNNING)
    t = fp.T0 + 100

    def save(state: Sandbox, outcome: str) -> tuple[Sandbox, str]:
        nonlocal t
        t += 100
        [requested] = policy.due_save(state, now=t, cause=f"at-{t}")
        assert isinstance(requested, ev.SaveRequested)
        save_id = requested.save_id
        captured, uploaded, unchanged, failed = fp.save_reports_of(
            save_id, host=HOST_A, generation=state.generation
        )
        done = ev.SaveCompleted(save_id=save_id, total_bytes=10, files=1)
        reports: list[ev.AnyEvent] = {
            "completed": [captured, uploaded, done],
            "unchanged": [unchanged],
            "failed": [failed],
        }[outcome]
        for event in [requested, *reports]:
            t += 1
            state = apply(state, [event], time=t)
        assert state.saves[save_id].state == outcome
        return state, save_id

    state, first = save(state, "completed")
    state, failed_before = save(state, "failed")
    state, second = save(state, "completed")
    state, unchanged = save(state, "unchanged")
    state = apply(state, policy.expired(state, keep_last=1), time=t + 1)
    state, failed_after = save(state, "failed")
    assert state.saves[first].state == "expired"
    kept = compact(state)
    assert set(kept.saves) == {second, failed_after}, "expired, failed before it, unchanged: gone"
    assert kept.compacted and set(state.saves) == {
        first,
        failed_before,
        second,
        unchanged,
        failed_after,
    }
    assert kept.saves[second].confirmed_at is not None, "the record the capture confirmed"
    assert compact(kept) is kept, "nothing more to drop: the same state, no copy"
