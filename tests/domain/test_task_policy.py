"""`task_policy`: what a runner decides, given the task's state, the clock and
the jitter (given/when/then; no IO, no clock, no random numbers)."""

from __future__ import annotations

import pytest
from sandhold.domain import events as ev
from sandhold.domain import sandbox as sb
from sandhold.domain import task as tk
from sandhold.domain import task_policy as policy

from .test_task import T0, TID, claimed, fold, submit, submitted, through_running


def running(*then: ev.AnyEvent, **manifest: object) -> tk.Task:
    """A task with `manifest` in its running stage (entered at T0 + 5), then `then`."""
    request = submit(repository={"url": "git://h/p.git"}, **manifest)
    events = through_running()
    events[0] = submitted(request)[0]
    return fold([*events, *then])


CLAIMED = claimed(sandbox_id="sb-1", command_id="cmd-1")


def command(state: str, **fields: object) -> sb.Command:
    return sb.Command(
        id="cmd-1",
        state=state,
        argv=["x"],
        request_key="k",
        request_digest="d",
        **fields,  # type: ignore[arg-type]
    )


# --- time limits --------------------------------------------------------------------------


def test_no_limit_has_passed_before_the_task_limit():
    state = fold(submitted(submit(timeouts={"task": 100})))  # pending: only the task's limit
    assert policy.passed_limit(state, T0 + 99) is None
    assert policy.time_to_next_limit(state, T0 + 40) == 60
    assert policy.passed_limit(state, T0 + 100) == "task"


def test_while_a_command_runs_its_host_gets_a_backstop_before_the_runner_acts():
    state = running(timeouts={"task": 100})
    assert state.state == "running"
    assert policy.passed_limit(state, T0 + 100) is None
    assert policy.passed_limit(state, T0 + 100 + policy.BACKSTOP_S) == "task"
    assert policy.time_to_next_limit(state, T0 + 100) == policy.BACKSTOP_S


def test_the_stage_limit_passes_before_the_task_limit_when_it_is_earlier():
    state = fold([*submitted(submit(timeouts={"stage": 30})), ev.TaskStageEntered(stage="staging")])
    staging_at = T0 + 1
    assert policy.passed_limit(state, staging_at + 29) is None
    assert policy.passed_limit(state, staging_at + 30) == "stage"
    event = policy.limit_passed(state, "stage")
    assert event == ev.TaskFailed(
        reason="stage_timeout", detail="the staging stage's limit passed", stage="staging"
    )


def test_a_running_stage_without_its_own_limit_waits_for_the_task_limit_only():
    state = running(timeouts={"task": 1000})
    assert policy.time_to_next_limit(state, T0) == 1000 + policy.BACKSTOP_S
    assert policy.limit_passed(state, "task") == ev.TaskTimedOut(
        stage="running", detail="the task's limit of 1000s passed"
    )


# --- attempts and retries -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("attempt", "budget", "error_class", "retried"),
    [(1, 3, "network", True), (3, 3, "network", True), (4, 3, "network", False),
     (1, 3, "permanent", False), (1, 0, "placement", False)],
)  # fmt: skip
def test_an_attempt_is_retried_while_its_class_has_budget(attempt, budget, error_class, retried):
    state = fold(submitted(submit(retry={"base_delay": 2, "max_delay": 60})))
    event = policy.attempt_failed(
        state, "clone", attempt=attempt, error_class=error_class, reason="r", detail="d",
        budget=budget, now=T0, jitter=0.5,
    )  # fmt: skip
    assert (event.retry_at is not None) == retried
    assert (event.operation, event.attempt, event.error_class) == ("clone", attempt, error_class)


def test_the_backoff_drawn_is_recorded_and_bounded_by_the_jitter():
    state = fold(submitted(submit(retry={"base_delay": 2, "max_delay": 60})))

    def retry_at(jitter: float) -> float:
        event = policy.attempt_failed(
            state, "clone", attempt=2, error_class="network", reason="r", detail="d", budget=3,
            now=T0, jitter=jitter,
        )  # fmt: skip
        assert event.retry_at is not None
        return event.retry_at - T0

    # attempt 2: envelope 4 s, equal jitter in [2, 4]
    assert retry_at(0.0) == pytest.approx(2.0) and retry_at(0.999) == pytest.approx(4.0, abs=0.01)


def test_a_long_detail_keeps_its_end():
    state = fold(submitted())
    event = policy.attempt_failed(
        state, "clone", attempt=1, error_class="permanent", reason="r", detail="x" * 5000 + "END",
        budget=0, now=T0, jitter=0,
    )  # fmt: skip
    assert len(event.detail) == 2000 and event.detail.endswith("END")


def test_the_next_attempt_waits_for_the_recorded_backoff():
    state = fold(submitted())
    assert policy.next_attempt(state, "clone", T0) == (1, 0.0)
    failure = ev.TaskOperationFailed(
        operation="clone", attempt=1, error_class="network", reason="r", retry_at=T0 + 10
    )
    state = fold([*submitted(), failure])
    assert policy.next_attempt(state, "clone", T0 + 4) == (2, 6.0)
    assert policy.next_attempt(state, "clone", T0 + 20) == (2, 0.0)


def test_a_failed_step_runs_again_only_when_its_failure_was_retried():
    failed = ev.TaskStepFailed(step_id="agent", attempt=1, reason="exit_code")
    retried = ev.TaskOperationFailed(
        operation="agent", attempt=1, error_class="network", reason="r", retry_at=T0 + 30
    )
    not_retried = ev.TaskOperationFailed(
        operation="agent", attempt=1, error_class="permanent", reason="r"
    )
    base = [*through_running(), claimed()]
    for events, wait in (([failed], None), ([not_retried, failed], None), ([retried, failed], 5.0)):
        state = fold([*base, *events])
        assert policy.step_retry_wait(state, state.steps["agent"], T0 + 25) == wait


def test_a_step_failure_puts_the_retry_decision_first_and_a_task_timeout_ends_the_task():
    state = fold([*through_running(), claimed()])
    record = state.steps["agent"]
    retry = ev.TaskOperationFailed(operation="agent", attempt=1, error_class="network", reason="r")
    events = policy.step_failed(record, "exit_code", "exited 1", retry=retry, exit_code=1)
    assert events == [
        retry,
        ev.TaskStepFailed(
            step_id="agent", attempt=1, reason="exit_code", detail="exited 1", exit_code=1
        ),
    ]
    timed_out = policy.step_failed(record, "task_timeout", "reached the task's limit")
    assert timed_out[-1] == ev.TaskTimedOut(stage="running", detail="reached the task's limit")


# --- agent steps ------------------------------------------------------------------------------


def test_an_agent_command_carries_the_time_left_and_the_step_environment():
    pipeline = [
        {
            "name": "fix",
            "agent": {"command": ["run", "{{ item }}"], "env": {"A": "b"}, "timeout": 3600},
            "for_each": ["x"],
        }
    ]
    [instance] = tk.instances(running(pipeline=pipeline).manifest)
    state = running(
        claimed(instance.id, sandbox_id="sb-1", command_id="c-1"),
        timeouts={"task": 600},
        environment={"SHARED": "1"},
        pipeline=pipeline,
    )
    record = state.steps[instance.id]
    request = policy.run_request(state, instance, record)
    assert request.argv == ["run", "x"]
    assert request.key == record.idempotency_key and request.sandbox_id == "sb-1"
    assert request.env["SHARED"] == "1" and request.env["A"] == "b"
    assert request.env["SANDHOLD_ITEM"] == "x" and request.env["SANDHOLD_TASK_ID"] == TID
    # the step's own 3600 s is cut to what the task has left after the claim
    assert request.timeout_s == pytest.approx(T0 + 600 - record.claimed_at)


@pytest.mark.parametrize(
    ("end", "fields", "reason"),
    [
        ("exited", {"exit_code": 2}, "exit_code"),
        ("timed_out", {"ended_at": T0 + 50}, "timed_out"),
        ("timed_out", {"ended_at": T0 + 999.5}, "task_timeout"),
        ("infrastructure_lost", {"reason": "host h1 lost"}, "infrastructure_lost"),
        ("interrupted", {"cancel_requested": True}, "interrupted"),
    ],
)
def test_why_a_command_failed_in_the_tasks_words(end, fields, reason):
    state = running(CLAIMED, timeouts={"task": 1000})
    got, detail = policy.why_command_failed(
        state, state.steps["agent"], command(end, **fields), now=T0
    )
    assert got == reason and detail


def test_a_command_cancelled_for_silence_after_a_warning_is_hung():
    warned = ev.TaskHangWarned(step_id="agent", command_id="cmd-1", silent_s=30)
    state = running(CLAIMED, warned)
    got, _ = policy.why_command_failed(
        state, state.steps["agent"], command("interrupted", cancel_requested=True), now=T0
    )
    assert got == "hung"


@pytest.mark.parametrize(("on_lost", "retried"), [("recover_and_retry", True), ("fail", False)])
def test_a_lost_command_is_retried_once_only_when_the_task_says_so(on_lost, retried):
    state = running(CLAIMED, on_infrastructure_lost=on_lost)
    event = policy.lost_command_retry(state, state.steps["agent"], now=T0, jitter=0.1)
    assert (event.retry_at is not None) == retried and event.error_class == "infrastructure_lost"


# --- tool steps ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "unsendable", "finished", "error_class"),
    [(200, False, True, None), (204, False, True, None), (None, False, False, "network"),
     (503, False, False, "network"), (429, False, False, "network"), (408, False, False, "network"),
     (404, False, False, "permanent"), (None, True, False, "permanent")],
)  # fmt: skip
def test_what_an_http_answer_means(status, unsendable, finished, error_class):
    outcome = policy.http_outcome(status, "body", unsendable=unsendable)
    assert (outcome.finished, outcome.error_class) == (finished, error_class)
    if not finished:
        assert outcome.reason == ("http_error" if status is None else "http_status")
        assert outcome.detail.startswith("body" if status is None else f"HTTP {status}")


def test_a_provisioning_failure_says_what_became_of_the_sandbox():
    base = dict(id="sb-1", tenant="t", created_at=T0)
    failed = sb.Sandbox(phase="failed", reason="no room", **base)  # type: ignore[arg-type]
    lost = sb.Sandbox(phase="lost", **base)  # type: ignore[arg-type]
    assert policy.provision_failure(failed) == ("start_failed", "no room")
    assert policy.provision_failure(lost) == (
        "sandbox_lost",
        "the sandbox became lost while starting",
    )
