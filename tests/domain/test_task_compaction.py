"""What the orchestrator keeps of a task (`task.compact`, decision 059): an
ended task without its recorded outputs, attempts and artifacts, decided on
and answered as the whole task would be, and a function of the log alone."""

from __future__ import annotations

from functools import reduce

import pytest
from hypothesis import given
from hypothesis import strategies as st
from sandhold.domain import events as ev
from sandhold.domain import task as tk
from sandhold.domain.errors import Rejected
from sandhold.domain.task_views import task_view

from .test_task import TID, claimed, envelopes, submit, through_running

ARTIFACT = ev.Artifact(path="out/r.txt", size=5, save_id="sv-snap")
RETRY = ev.TaskOperationFailed(
    operation="provision", attempt=1, error_class="network", reason="network", detail="reset"
)


def history(end: ev.AnyEvent) -> list[ev.AnyEvent]:
    """A task with everything compaction drops (outputs, an attempt, artifacts),
    its end, and what a second writer might append after the end."""
    return [
        *through_running(),
        RETRY,
        claimed(sandbox_id="sb-1", command_id="cmd-1"),
        ev.TaskStepDispatched(step_id="agent", attempt=1),
        ev.TaskStepFinished(step_id="agent", attempt=1, output="x" * 4096, exit_code=0),
        ev.TaskStageEntered(stage="completing"),
        ev.TaskArtifactsCollected(snapshot_id="sv-snap", artifacts=[ARTIFACT]),
        end,
        ev.TaskCancelRequested(request_key="late", request_digest="d"),
        claimed("agent", attempt=2),
    ]


ENDS = [
    ev.TaskCompleted(final_save_id="sv-final"),
    ev.TaskFailed(reason="hung", detail="d", stage="completing"),
    ev.TaskCancelled(stage="completing"),
    ev.TaskTimedOut(stage="completing", detail="d"),
]


def kept_states(events: list[ev.AnyEvent]) -> list[tk.Task | None]:
    """The states as a compacting store holds them: compacted after every event."""
    states: list[tk.Task | None] = [None]
    for envelope in envelopes(events):
        state = tk.evolve(states[-1], envelope)
        states.append(None if state is None else tk.compact(state))
    return states


def whole_states(events: list[ev.AnyEvent]) -> list[tk.Task | None]:
    return [reduce(tk.evolve, envelopes(events[:n]), None) for n in range(len(events) + 1)]


REQUESTS = [
    submit(repository={"url": "git://h/p.git"}),  # as `through_running`'s: a retry
    submit(),  # its key for another manifest: a conflict
    tk.CancelTask(key="cancel-1", task_id=TID),
    tk.CancelTask(key="late", task_id=TID),  # the key of a cancel recorded after the end
    tk.CancelTask(key="cancel-2", task_id=TID, tenant="other"),
]


def outcome(state: tk.Task | None, request: tk.AnyTaskRequest) -> object:
    """What the orchestrator answers: the events and the task's view, or the refusal."""
    try:
        events = tk.decide(state, request)
    except Rejected as refusal:
        return "refused", refusal.code
    after = reduce(tk.evolve, envelopes(events, start=2e9), state)
    return events, None if after is None else task_view(after)


@pytest.mark.parametrize("end", ENDS, ids=lambda e: e.__struct_config__.tag)
def test_compacting_after_every_event_is_compacting_the_whole_fold(end: ev.AnyEvent):
    events = history(end)
    for kept, whole in zip(kept_states(events), whole_states(events), strict=True):
        assert kept == (None if whole is None else tk.compact(whole))


@pytest.mark.parametrize("end", ENDS, ids=lambda e: e.__struct_config__.tag)
@given(cut=st.integers(min_value=0, max_value=20), which=st.integers(min_value=0, max_value=4))
def test_any_request_is_decided_and_answered_as_on_the_whole_task(
    end: ev.AnyEvent, cut: int, which: int
):
    """As `AggregateStore.execute(whole=...)` decides: on the whole task where
    `whole_needed` says so, else on the kept one."""
    events = history(end)[:cut]
    kept, whole = kept_states(events)[-1], whole_states(events)[-1]
    request = REQUESTS[which]
    decided_on = whole if tk.whole_needed(kept, request) else kept
    assert outcome(decided_on, request) == outcome(whole, request)


def test_an_ended_task_keeps_its_steps_without_outputs_and_its_request_keys():
    whole = reduce(tk.evolve, envelopes(history(ENDS[0])), None)
    assert whole is not None and whole.steps["agent"].output
    kept = tk.compact(whole)
    assert kept.compacted and kept.state == "completed"
    assert kept.steps["agent"].status == "finished" and kept.steps["agent"].exit_code == 0
    assert kept.steps["agent"].output == "" and kept.attempts == [] and kept.artifacts == []
    assert kept.requests == whole.requests and kept.manifest == whole.manifest
    assert kept.sandbox_id == whole.sandbox_id and kept.final_save_id == whole.final_save_id
    assert tk.whole_needed(kept, REQUESTS[0])
    assert outcome(whole, REQUESTS[0]) != outcome(kept, REQUESTS[0])  # the view shows outputs


def test_a_task_not_ended_is_kept_whole():
    events = history(ENDS[0])[:-3]  # up to the artifacts, before the end
    whole = reduce(tk.evolve, envelopes(events), None)
    assert whole is not None and not whole.terminal
    assert tk.compact(whole) is whole
    assert not tk.whole_needed(whole, submit())


def test_an_ended_task_with_nothing_to_drop_is_decided_on_as_it_is():
    events = [*tk.decide(None, submit()), ev.TaskCancelled(stage="pending")]
    whole = reduce(tk.evolve, envelopes(events), None)
    assert whole is not None and whole.terminal
    assert tk.compact(whole) is whole and not tk.whole_needed(whole, submit())
