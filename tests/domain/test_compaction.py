"""What a service keeps of a sandbox (`compact`, decision 057) decides as the
whole sandbox would, over random histories made by the real deciders
(`test_fold_property.drive`), and is a function of the log alone."""

from __future__ import annotations

from hypothesis import given
from sandhold.domain import requests as rq
from sandhold.domain.errors import Rejected
from sandhold.domain.reconcile import plan
from sandhold.domain.sandbox import (
    Sandbox,
    compact,
    decide,
    ended_away,
    evolve,
    queued_by,
    result_of,
    whole_needed,
)
from sandhold.domain.views import reply_for

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
    """A compacted state depends on the log alone, not on when it was compacted:
    a checkpoint's states are compared with `compact(fold from zero)` (audit)."""
    trace = fp.drive(memory_n, steps)
    for n, (kept, whole) in enumerate(zip(compacted_fold(trace), trace.states, strict=True)):
        assert kept == (None if whole is None else compact(whole)), f"after {n} envelopes"


@fp.SETTINGS
@given(fp.MEMORY_CHOICE, fp.STEPS, fp.CHOICE)
def test_any_request_decided_on_the_kept_state_is_decided_as_on_the_whole(
    memory_n: int, steps: list[fp.Choice], request_choice: fp.Choice
) -> None:
    trace = fp.drive(memory_n, steps)
    whole = trace.state
    kept = compacted_fold(trace)[-1]
    assert whole is not None and kept is not None
    # Requests drawn against the whole state: retries of ended commands included.
    request = fp.read_request(whole, request_choice)
    assert as_a_store_decides(kept, whole, request) == as_the_whole_decides(whole, request)


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
