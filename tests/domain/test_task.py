"""The task aggregate: `decide` on submit and cancel, `evolve` through the
lifecycle and the step ledger, and the pure pieces the runner walks with
(`instances`, `render`, `deadline`), given/when/then."""

from __future__ import annotations

from functools import reduce

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st
from sandhold.domain import events as ev
from sandhold.domain import task as tk
from sandhold.domain.envelope import Envelope, wrap
from sandhold.domain.errors import Rejected
from sandhold.domain.task_manifest import TaskManifest, load_manifest
from sandhold.domain.task_views import task_view

T0 = 1_700_000_000.0
KEY = "submit-1"
TID = tk.task_id_for("default", KEY)
AGENT = {"command": ["sh", "-c", "echo hi"]}


def manifest(**fields: object) -> TaskManifest:
    fields.setdefault("name", "demo")
    if "pipeline" not in fields:
        fields.setdefault("agent", AGENT)
    return load_manifest(fields)


def submit(key: str = KEY, *, tenant: str = "default", **fields: object) -> tk.SubmitTask:
    return tk.SubmitTask(key=key, tenant=tenant, manifest=manifest(**fields))


def cancel(key: str = "cancel-1", *, tenant: str = "default", task_id: str = TID):
    return tk.CancelTask(key=key, tenant=tenant, task_id=task_id)


def envelopes(events: list[ev.AnyEvent], *, start: float = T0, step: float = 1.0):
    return [
        wrap(
            [event],
            aggregate_id=TID,
            id_base=f"e{i}",
            actor="test",
            causation_id="c",
            correlation_id="c",
            time=start + i * step,
        )[0]
        for i, event in enumerate(events)
    ]


def fold(events: list[ev.AnyEvent], **timing: float) -> tk.Task:
    state = reduce(tk.evolve, envelopes(events, **timing), None)
    assert state is not None
    return state


def submitted(request: tk.SubmitTask | None = None) -> list[ev.AnyEvent]:
    return tk.decide(None, request or submit())


def claimed(step_id: str = "agent", attempt: int = 1, **extra: object) -> ev.TaskStepClaimed:
    return ev.TaskStepClaimed(
        step_id=step_id,
        step=step_id.split("[")[0],
        kind="agent",
        attempt=attempt,
        idempotency_key=tk.step_key(TID, step_id, attempt),
        **extra,  # type: ignore[arg-type]
    )


def through_running() -> list[ev.AnyEvent]:
    return [
        *submitted(submit(repository={"url": "git://h/p.git"})),
        ev.TaskStageEntered(stage="staging"),
        ev.TaskStaged(seed_save_id="sv-seed", commit="c" * 40, files=3, bytes=10),
        ev.TaskStageEntered(stage="provisioning"),
        ev.TaskProvisioned(sandbox_id="sb-1"),
        ev.TaskStageEntered(stage="running"),
    ]


# --- submit ---------------------------------------------------------------------------


def test_submit_records_the_manifest_under_an_id_derived_from_tenant_and_key():
    [event] = submitted()
    assert isinstance(event, ev.TaskSubmitted)
    assert event.task_id == TID == tk.task_id_for("default", KEY)
    assert event.request_key == KEY and event.manifest == manifest()
    state = fold([event])
    assert state.state == "pending" and state.id == TID and state.submitted_at == T0
    assert tk.task_id_for("other", KEY) != TID  # tenants never share ids


def test_the_same_submit_again_changes_nothing():
    state = fold(submitted())
    assert tk.decide(state, submit()) == []


def test_the_same_key_for_a_different_manifest_is_an_idempotency_conflict():
    state = fold(submitted())
    with pytest.raises(Rejected) as caught:
        tk.decide(state, submit(name="other"))
    assert caught.value.code == "idempotency_conflict"


def test_a_task_request_is_decoded_strictly():
    good = tk.encode_task_request(submit())
    assert tk.decode_task_request(good) == submit()
    data = msgspec.json.decode(good)
    with pytest.raises(msgspec.ValidationError, match="unknown field `extra`"):
        tk.decode_task_request(msgspec.json.encode({**data, "extra": 1}))
    data["manifest"]["timeouts"] = {"clone": "soon"}
    with pytest.raises(msgspec.ValidationError, match="`clone`"):
        tk.decode_task_request(msgspec.json.encode(data))


# --- cancel ---------------------------------------------------------------------------


def test_cancel_of_an_unknown_or_another_tenants_task_is_not_found():
    with pytest.raises(Rejected) as missing:
        tk.decide(None, cancel())
    assert missing.value.code == "task_not_found"
    state = fold(submitted())
    with pytest.raises(Rejected) as foreign:
        tk.decide(state, cancel(tenant="other"))
    assert foreign.value.code == "task_not_found"


def test_cancel_is_recorded_once_and_repeats_change_nothing():
    state = fold(through_running())
    [event] = tk.decide(state, cancel())
    assert isinstance(event, ev.TaskCancelRequested)
    state = fold([*through_running(), event])
    assert state.cancel_requested and state.state == "running"
    assert tk.decide(state, cancel()) == []  # the same request
    assert tk.decide(state, cancel("cancel-2")) == []  # another: already asked


def test_cancel_of_a_finished_task_is_rejected():
    state = fold([*through_running(), ev.TaskCompleted(final_save_id="sv-final")])
    with pytest.raises(Rejected) as caught:
        tk.decide(state, cancel())
    assert caught.value.code == "task_finished"


def test_a_cancel_key_reused_for_another_task_is_a_conflict():
    state = fold(through_running())
    [event] = tk.decide(state, cancel())
    state = fold([*through_running(), event])
    # A submit's key and a cancel's key share one space per task.
    with pytest.raises(Rejected) as caught:
        tk.decide(state, cancel(KEY))
    assert caught.value.code == "idempotency_conflict"


# --- evolve: the lifecycle and the ledger -----------------------------------------------------


def test_the_lifecycle_folds_to_completed_with_commit_sandbox_artifacts_and_final_save():
    artifact = ev.Artifact(path="out/r.txt", size=5, save_id="sv-snap")
    state = fold(
        [
            *through_running(),
            claimed(sandbox_id="sb-1", command_id="cmd-1"),
            ev.TaskStepDispatched(step_id="agent", attempt=1),
            ev.TaskStepFinished(step_id="agent", attempt=1, output="hi\n", exit_code=0),
            ev.TaskStageEntered(stage="completing"),
            ev.TaskArtifactsCollected(snapshot_id="sv-snap", artifacts=[artifact]),
            ev.TaskCompleted(final_save_id="sv-final"),
        ]
    )
    assert state.state == "completed" and state.terminal
    assert state.commit == "c" * 40 and state.seed_save_id == "sv-seed"
    assert state.sandbox_id == "sb-1"
    assert state.artifacts == [artifact] and state.snapshot_id == "sv-snap"
    assert state.final_save_id == "sv-final" and state.finished_at == T0 + 11
    record = state.steps["agent"]
    assert record.status == "finished" and record.output == "hi\n" and record.exit_code == 0
    assert record.command_id == "cmd-1" and record.done
    assert tk.outputs(state) == {"agent": "hi\n"}


def test_a_stage_entered_resets_the_stage_clock():
    state = fold(through_running(), step=10.0)
    assert state.state == "running" and state.stage_entered_at == T0 + 50


@pytest.mark.parametrize(
    ("end", "state_name", "reason"),
    [
        (ev.TaskFailed(reason="hung", detail="d", stage="running"), "failed", "hung"),
        (ev.TaskCancelled(stage="running"), "cancelled", "cancelled"),
        (ev.TaskTimedOut(stage="running", detail="d"), "timed_out", "timed_out"),
    ],
)
def test_each_unhappy_end_is_terminal_with_its_reason_and_stage(end, state_name, reason):
    state = fold([*through_running(), end])
    assert state.state == state_name and state.terminal
    assert state.reason == reason and state.failed_stage == "running"


@pytest.mark.parametrize(
    "late",
    [
        ev.TaskStageEntered(stage="running"),
        ev.TaskFailed(reason="exit_code", stage="running"),
        ev.TaskCompleted(final_save_id="sv-late"),
        claimed("agent", attempt=2),
    ],
)
def test_the_first_end_is_final_whatever_is_appended_after_it(late):
    # Two writers (a second orchestrator, a runner re-appending its decision
    # after a conflict) can append after the end: the fold keeps the first end.
    ended = fold([*through_running(), ev.TaskCancelled(stage="running")])
    state = fold([*through_running(), ev.TaskCancelled(stage="running"), late])
    assert (state.state, state.reason, state.steps) == ("cancelled", "cancelled", ended.steps)
    assert state.final_save_id is None


def test_a_release_counts_only_after_the_end_and_makes_the_task_forgettable():
    running = fold([*through_running(), ev.TaskReleased()])
    assert not running.released and not tk.forgettable(running)
    assert tk.release(running) == [] and tk.release(None) == []
    ended = fold([*through_running(), ev.TaskFailed(reason="exit_code", stage="running")])
    assert not ended.released and not tk.forgettable(ended)
    assert tk.release(ended) == [ev.TaskReleased()]
    released = fold(
        [*through_running(), ev.TaskFailed(reason="exit_code", stage="running"), ev.TaskReleased()]
    )
    assert released.released and tk.forgettable(released)
    assert tk.release(released) == []  # a twin released it first: nothing more
    assert (task_view(ended).released, task_view(released).released) == (False, True)
    # Nothing else changed: the ended task as it was, released.
    assert msgspec.structs.replace(released, released=False) == ended


def test_a_failed_attempt_is_kept_with_its_cause_and_retry_time():
    failure = ev.TaskOperationFailed(
        operation="clone",
        attempt=1,
        error_class="network",
        reason="network",
        detail="reset",
        retry_at=T0 + 5,
    )
    state = fold([*submitted(), ev.TaskStageEntered(stage="staging"), failure])
    [attempt] = state.failures("clone")
    assert attempt.error_class == "network" and attempt.retry_at == T0 + 5
    assert state.last_attempt == attempt and state.failures("provision") == []


def test_a_late_report_about_an_older_attempt_changes_nothing():
    state = fold(
        [
            *through_running(),
            claimed(attempt=1),
            ev.TaskStepFailed(step_id="agent", attempt=1, reason="infrastructure_lost"),
            claimed(attempt=2),
            ev.TaskStepFinished(step_id="agent", attempt=1, output="stale"),
        ]
    )
    record = state.steps["agent"]
    assert record.attempt == 2 and record.status == "claimed" and record.output == ""


def test_a_hang_warning_marks_the_step_and_counts():
    state = fold(
        [
            *through_running(),
            claimed(sandbox_id="sb-1", command_id="cmd-1"),
            ev.TaskHangWarned(step_id="agent", command_id="cmd-1", silent_s=31.0),
        ]
    )
    assert state.hang_warnings == 1 and state.steps["agent"].hang_warned


def test_a_late_hang_warning_about_an_earlier_attempt_does_not_mark_the_retry():
    state = fold(
        [
            *through_running(),
            claimed(sandbox_id="sb-1", command_id="cmd-1"),
            ev.TaskStepFailed(step_id="agent", attempt=1, reason="infrastructure_lost"),
            claimed(attempt=2, sandbox_id="sb-1", command_id="cmd-2"),
            ev.TaskHangWarned(step_id="agent", command_id="cmd-1", silent_s=31.0),
        ]
    )
    assert state.steps["agent"].attempt == 2 and not state.steps["agent"].hang_warned


def test_events_of_other_aggregates_and_before_submit_are_ignored():
    assert tk.evolve(None, envelopes([ev.TaskStageEntered(stage="staging")])[0]) is None
    state = fold(submitted())
    again = tk.evolve(state, envelopes(submitted())[0])
    assert again == state  # a second submitted event does not reset the task


@given(st.integers(min_value=0, max_value=12))
def test_replaying_any_prefix_equals_the_live_state(cut: int):
    events = [
        *through_running(),
        claimed(sandbox_id="sb-1", command_id="cmd-1"),
        ev.TaskStepDispatched(step_id="agent", attempt=1),
        ev.TaskStepFinished(step_id="agent", attempt=1, output="hi"),
        ev.TaskStageEntered(stage="completing"),
        ev.TaskArtifactsCollected(snapshot_id=None),
        ev.TaskCompleted(),
    ]
    all_envelopes: list[Envelope] = envelopes(events)
    cut = min(cut, len(all_envelopes))
    live = None
    for envelope in all_envelopes:
        live = tk.evolve(live, envelope)
    resumed = reduce(tk.evolve, all_envelopes[cut:], reduce(tk.evolve, all_envelopes[:cut], None))
    assert resumed == live


# --- the pipeline as the runner walks it --------------------------------------------------


def test_instances_expand_loops_into_items_in_order():
    pipeline = manifest(
        pipeline=[
            {"name": "build", "agent": AGENT},
            {"name": "each", "agent": AGENT, "for_each": ["a", "b", "c"]},
            {"name": "hook", "http": {"url": "http://h/"}},
        ]
    )
    got = [(i.id, i.index, i.item, i.step.name) for i in tk.instances(pipeline)]
    assert got == [
        ("build", None, None, "build"),
        ("each[0]", 0, "a", "each"),
        ("each[1]", 1, "b", "each"),
        ("each[2]", 2, "c", "each"),
        ("hook", None, None, "hook"),
    ]
    [only] = tk.instances(manifest())
    assert only.id == "agent" and only.item is None


def test_step_keys_differ_by_task_step_and_attempt():
    keys = {
        tk.step_key(TID, "a", 1),
        tk.step_key(TID, "a", 2),
        tk.step_key(TID, "b", 1),
        tk.step_key(tk.task_id_for("default", "x"), "a", 1),
    }
    assert len(keys) == 4


def test_render_fills_item_and_recorded_outputs():
    scope = {"build": "artifact-7\n", "each[1]": "b-done"}
    assert tk.render("{{item}}/{{ item }}", item="x", scope={}) == "x/x"
    assert tk.render("use {{steps.build.output}}!", item=None, scope=scope) == "use artifact-7!"
    assert tk.render("{{ steps.each[1].output }}", item=None, scope=scope) == "b-done"
    # Unknown names stay as written, and text without braces is returned as is.
    assert tk.render("{{steps.later.output}}", item=None, scope=scope) == ("{{steps.later.output}}")
    assert tk.render("{{item}}", item=None, scope=scope) == "{{item}}"
    assert tk.render("plain", item="x", scope=scope) == "plain"


def test_outputs_hold_only_finished_steps():
    state = fold(
        [
            *through_running(),
            claimed("a"),
            ev.TaskStepFinished(step_id="a", attempt=1, output="A"),
            claimed("b"),
            ev.TaskStepFailed(step_id="b", attempt=1, reason="exit_code", output="B"),
            claimed("c"),
        ]
    )
    assert tk.outputs(state) == {"a": "A"}


def test_deadlines_follow_the_stage_and_the_task():
    events = [
        *submitted(submit(timeouts={"stage": 10, "task": 100, "running": 30})),
        ev.TaskStageEntered(stage="staging"),
    ]
    staging = fold(events, step=1.0)
    assert tk.deadline(staging, "task") == T0 + 100
    assert tk.deadline(staging, "stage") == T0 + 1 + 10
    running = fold([*events, ev.TaskStageEntered(stage="running")], step=1.0)
    assert tk.deadline(running, "stage") == T0 + 2 + 30
    pending = fold(events[:1])
    assert tk.deadline(pending, "stage") is None


def test_the_running_stage_has_no_limit_of_its_own_by_default():
    state = fold([*submitted(), ev.TaskStageEntered(stage="running")])
    assert tk.deadline(state, "stage") is None
    assert tk.deadline(state, "task") == T0 + 86400
