"""What a task runner decides, as pure functions of the task's state.

The runner (services/orchestrator) does the IO: it sends requests, waits for
sandboxes and commands, reads the clock and draws random numbers. Everything
it *decides* from what it saw is here, with the clock (`now`) and the jitter
passed in, so each decision is a given/when/then test and a replay never
needs a clock or a random number generator:

* which time limit has passed, and how long until the next one;
* a failed attempt: its class, and whether (and when) another follows;
* why a command failed, in the task's words (exit code, hung, which timeout);
* what an HTTP tool step's answer means (finished, transient, permanent);
* the command an agent step runs (its environment and the time it has left);
* the events that record a step's failure.
"""

from __future__ import annotations

import math
from typing import Literal

import msgspec
from sandhold.domain import events as ev
from sandhold.domain import requests as rq
from sandhold.domain import sandbox as sb
from sandhold.domain import task as tk
from sandhold.domain.retry import backoff_delay
from sandhold.domain.task_manifest import RecordedHttpCall

# After a deadline, how long a command's host gets to end it itself (it carries
# the time left as its timeout) before the runner ends the stage on its own.
BACKSTOP_S = 10.0

Limit = Literal["task", "stage"]


# --- time limits -----------------------------------------------------------------------


def passed_limit(state: tk.Task, now: float) -> Limit | None:
    """The task's or the current stage's limit, if it has passed (with the backstop
    while a command runs: its host ends it on time)."""
    backstop = _backstop(state)
    for which in ("task", "stage"):
        deadline = tk.deadline(state, which)
        if deadline is not None and now >= deadline + backstop:
            return which
    return None


def time_to_next_limit(state: tk.Task, now: float) -> float:
    """Seconds until a limit passes (`math.inf`: none is set), never negative."""
    deadlines = [d for w in ("task", "stage") if (d := tk.deadline(state, w)) is not None]
    if not deadlines:
        return math.inf
    return max(0.0, min(deadlines) + _backstop(state) - now)


def _backstop(state: tk.Task) -> float:
    # Only a running command is ended by its host; any other stage's work is
    # the runner's, so its limit is kept on time.
    return BACKSTOP_S if state.state == "running" else 0.0


def limit_passed(state: tk.Task, which: Limit) -> ev.AnyEvent:
    """The event that ends the task when `which` limit passed."""
    if which == "task":
        limit = state.manifest.timeouts.task
        return ev.TaskTimedOut(stage=state.state, detail=f"the task's limit of {limit:g}s passed")
    return ev.TaskFailed(
        reason="stage_timeout", detail=f"the {state.state} stage's limit passed", stage=state.state
    )


# --- attempts and retries ----------------------------------------------------------------


def attempt_failed(
    state: tk.Task,
    operation: str,
    *,
    attempt: int,
    error_class: ev.OperationErrorClass,
    reason: str,
    detail: str,
    budget: int,
    now: float,
    jitter: float,
) -> ev.TaskOperationFailed:
    """A failed attempt with its cause; `retry_at` set when another follows. The
    backoff chosen now (`jitter` in [0, 1)) is recorded, so a restart waits the same."""
    retry = state.manifest.retry
    retry_at = None
    if error_class != "permanent" and attempt <= budget:
        delay = backoff_delay(
            attempt, base_s=float(retry.base_delay), cap_s=float(retry.max_delay), jitter=jitter
        )
        retry_at = now + delay
    return ev.TaskOperationFailed(
        operation=operation,
        attempt=attempt,
        error_class=error_class,
        reason=reason,
        detail=detail[-2000:],
        retry_at=retry_at,
    )


def next_attempt(state: tk.Task, operation: str, now: float) -> tuple[int, float]:
    """(the next attempt's number, seconds to wait for its recorded backoff)."""
    failures = state.failures(operation)
    wait = 0.0
    if failures and failures[-1].retry_at is not None:
        wait = max(0.0, failures[-1].retry_at - now)
    return len(failures) + 1, wait


def step_retry_wait(state: tk.Task, record: tk.StepRecord, now: float) -> float | None:
    """A failed step runs again only when its failure was recorded as retried (a
    `task.operation_failed` with `retry_at` for this attempt): seconds to wait
    for it, or None when it is not retried."""
    failures = state.failures(record.id)
    if not failures or failures[-1].attempt != record.attempt or failures[-1].retry_at is None:
        return None
    return max(0.0, failures[-1].retry_at - now)


def step_failed(
    record: tk.StepRecord,
    reason: str,
    detail: str,
    *,
    retry: ev.TaskOperationFailed | None = None,
    output: str | None = None,
    exit_code: int | None = None,
    end_state: str | None = None,
) -> list[ev.AnyEvent]:
    """The events of a step's failure and, where a retry is decided, that decision.

    One append is not atomic (its events are published one by one), so the
    retry decision goes first: a crash after it finds the step unfinished and
    records its end again, whereas a failure recorded without its decision
    would end the task although a retry was due. A failure for the task's
    time limit ends the task with it."""
    failed = ev.TaskStepFailed(
        step_id=record.id,
        attempt=record.attempt,
        reason=reason,
        detail=detail,
        output="" if output is None else output,  # the field's default when not given
        exit_code=exit_code,
        end_state=end_state,
    )
    events: list[ev.AnyEvent] = [failed] if retry is None else [retry, failed]
    if reason == "task_timeout":
        events.append(ev.TaskTimedOut(stage="running", detail=detail))
    return events


# --- agent steps ---------------------------------------------------------------------------


def run_request(state: tk.Task, instance: tk.StepInstance, record: tk.StepRecord) -> rq.RunCommand:
    """The command an agent step's attempt runs. The time left travels with it:
    the host ends it `timed_out` when the step's, the stage's or the task's limit
    comes, even if no orchestrator is up then."""
    agent = instance.step.agent
    assert agent is not None and record.sandbox_id is not None
    scope = tk.outputs(state)
    env = {
        **state.manifest.environment,
        **{k: tk.render(v, item=instance.item, scope=scope) for k, v in agent.env.items()},
        "SANDHOLD_TASK_ID": state.id,
        "SANDHOLD_STEP": instance.id,
        "SANDHOLD_STEP_KEY": record.idempotency_key,
    }
    if instance.item is not None:
        env["SANDHOLD_ITEM"] = instance.item
    limits = [float(agent.timeout)] if agent.timeout else []
    for which in ("stage", "task"):
        deadline = tk.deadline(state, which)
        if deadline is not None:
            limits.append(max(1.0, deadline - record.claimed_at))
    return rq.RunCommand(
        key=record.idempotency_key,
        tenant=state.tenant,
        sandbox_id=record.sandbox_id,
        argv=[tk.render(a, item=instance.item, scope=scope) for a in agent.command],
        cwd=agent.cwd,
        env=env,
        timeout_s=min(limits) if limits else None,
    )


def why_command_failed(
    state: tk.Task, record: tk.StepRecord, command: sb.Command, *, now: float
) -> tuple[str, str]:
    """(reason, detail) of an agent step whose command did not exit 0."""
    record = state.steps[record.id]
    if command.state == "exited":
        return "exit_code", f"{command.id} exited with {command.exit_code}"
    if command.state == "interrupted" and record.hang_warned and command.cancel_requested:
        cancel_after = state.manifest.hang.cancel_after
        return "hung", f"no output for {cancel_after:g}s: {command.id} was cancelled"
    if command.state == "timed_out":
        ended = (command.ended_at or now) + 1.0
        task_deadline = tk.deadline(state, "task")
        stage_deadline = tk.deadline(state, "stage")
        if task_deadline is not None and ended >= task_deadline:
            return "task_timeout", f"{command.id} reached the task's limit"
        if stage_deadline is not None and ended >= stage_deadline:
            return "stage_timeout", f"{command.id} reached the running stage's limit"
        return "timed_out", f"{command.id} reached the step's timeout"
    return command.state, command.reason or f"{command.id} ended {command.state}"


def lost_command_retry(
    state: tk.Task, record: tk.StepRecord, *, now: float, jitter: float
) -> ev.TaskOperationFailed:
    """A command whose host failed: `recover_and_retry` retries once (the next
    command brings the sandbox back), anything else not at all."""
    policy = state.manifest.on_infrastructure_lost
    return attempt_failed(
        state,
        record.id,
        attempt=record.attempt,
        error_class="infrastructure_lost",
        reason="infrastructure_lost",
        detail=(
            f"{record.command_id} was lost with {record.sandbox_id}'s placement while it ran "
            "(its host failed, or the sandbox's files there went missing)"
        ),
        budget=1 if policy == "recover_and_retry" else 0,
        now=now,
        jitter=jitter,
    )


# --- tool (HTTP) steps -----------------------------------------------------------------------


class HttpOutcome(msgspec.Struct, frozen=True):
    """What an HTTP tool step's answer means: finished, or a failure of a class."""

    finished: bool
    error_class: Literal["network", "permanent"] | None = None
    reason: str = ""
    detail: str = ""


def http_outcome(status: int | None, body: str, *, unsendable: bool = False) -> HttpOutcome:
    """`status` None: no HTTP answer (`body` says why); `unsendable`: the request
    itself cannot be sent (a bad rendered URL), so sending again cannot help.
    2xx finishes the step; no answer, 5xx, 408 and 429 are transient."""
    if status is not None and 200 <= status < 300:
        return HttpOutcome(finished=True)
    transient = not unsendable and (status is None or status >= 500 or status in (408, 429))
    reason = "http_error" if status is None else "http_status"
    detail = body if status is None else f"HTTP {status}: {body[:500]}"
    return HttpOutcome(
        finished=False,
        error_class="network" if transient else "permanent",
        reason=reason,
        detail=detail,
    )


def render_call(
    call: RecordedHttpCall, instance: tk.StepInstance, scope: dict[str, str]
) -> RecordedHttpCall:
    """The call with `{{ item }}` and earlier steps' outputs filled in."""

    def render(text: str) -> str:
        return tk.render(text, item=instance.item, scope=scope)

    return msgspec.structs.replace(
        call,
        url=render(call.url),
        body=render(call.body) if call.body is not None else None,
        headers={k: render(v) for k, v in call.headers.items()},
    )


# --- provisioning ------------------------------------------------------------------------------


def provision_failure(sandbox: sb.Sandbox) -> tuple[str, str]:
    """(reason, detail) of a sandbox that did not come up for its task."""
    reason = "start_failed" if sandbox.phase == "failed" else f"sandbox_{sandbox.phase}"
    return reason, sandbox.reason or f"the sandbox became {sandbox.phase} while starting"
