"""Given/when/then helpers shared by the pure domain tests.

A history is a sequence of steps: a client request (decided against the state
so far, and required to be accepted) or an event (a host report or a scheduler
decision, applied as is). `given` folds the envelopes with the one `fold`, as
the live path and the replay tool do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sandhold.domain import events as ev
from sandhold.domain import requests as rq
from sandhold.domain.commands import CommandEndState
from sandhold.domain.envelope import Envelope, wrap
from sandhold.domain.errors import Rejected
from sandhold.domain.fold import fold
from sandhold.domain.sandbox import Sandbox, decide, evolve

T0 = 1_700_000_000.0
TENANT = "default"
CREATE_KEY = "create-1"
SID = rq.sandbox_id_for(TENANT, CREATE_KEY)
HOST_A = "host-a"
HOST_B = "host-b"

Step = rq.AnyRequest | ev.AnyEvent
Outcome = list[ev.AnyEvent] | Rejected


# --- requests ----------------------------------------------------------------


def create(
    key: str = CREATE_KEY,
    *,
    tenant: str = TENANT,
    memory_limit_bytes: int | None = None,
    **settings: Any,
) -> rq.CreateSandbox:
    """A create request; ``settings``: any other field of it (network, limits)."""
    return rq.CreateSandbox(
        key=key, tenant=tenant, memory_limit_bytes=memory_limit_bytes, **settings
    )


def start(key: str = "start-1", *, tenant: str = TENANT, sandbox_id: str = SID) -> rq.StartSandbox:
    return rq.StartSandbox(key=key, tenant=tenant, sandbox_id=sandbox_id)


def stop(key: str = "stop-1", *, tenant: str = TENANT, sandbox_id: str = SID) -> rq.StopSandbox:
    return rq.StopSandbox(key=key, tenant=tenant, sandbox_id=sandbox_id)


def delete(
    key: str = "delete-1", *, tenant: str = TENANT, sandbox_id: str = SID
) -> rq.DeleteSandbox:
    return rq.DeleteSandbox(key=key, tenant=tenant, sandbox_id=sandbox_id)


def run(
    key: str = "run-1",
    argv: Sequence[str] = ("echo", "hi"),
    *,
    tenant: str = TENANT,
    sandbox_id: str = SID,
    cwd: str | None = None,
    env: dict[str, str] | None = None,
    timeout_s: float | None = None,
    kill_grace_s: float = 5.0,
) -> rq.RunCommand:
    return rq.RunCommand(
        key=key,
        tenant=tenant,
        sandbox_id=sandbox_id,
        argv=list(argv),
        cwd=cwd,
        env=env or {},
        timeout_s=timeout_s,
        kill_grace_s=kill_grace_s,
    )


def cancel(
    command_id: str, key: str = "cancel-1", *, tenant: str = TENANT, sandbox_id: str = SID
) -> rq.CancelCommand:
    return rq.CancelCommand(key=key, tenant=tenant, sandbox_id=sandbox_id, command_id=command_id)


def cmd(run_key: str = "run-1") -> str:
    """The id of the command a run request with `run_key` queues."""
    return rq.command_id_for(SID, run_key)


# --- host and scheduler events -------------------------------------------------


def placed(host: str = HOST_A, generation: int = 1) -> ev.SandboxPlaced:
    return ev.SandboxPlaced(host=host, generation=generation)


def starting(host: str = HOST_A, generation: int = 1) -> ev.SandboxStarting:
    return ev.SandboxStarting(host=host, generation=generation)


def started(host: str = HOST_A, generation: int = 1) -> ev.SandboxStarted:
    return ev.SandboxStarted(host=host, generation=generation, capabilities={"net": "none"})


def start_failed(host: str = HOST_A, generation: int = 1) -> ev.SandboxStartFailed:
    return ev.SandboxStartFailed(host=host, generation=generation, reason="image not found")


def stopped(host: str | None = HOST_A, generation: int = 1) -> ev.SandboxStopped:
    return ev.SandboxStopped(host=host, generation=generation)


def deleted(host: str | None = HOST_A, generation: int = 1) -> ev.SandboxDeleted:
    return ev.SandboxDeleted(host=host, generation=generation)


def dispatched(
    run_key: str = "run-1", host: str = HOST_A, generation: int = 1
) -> ev.CommandDispatched:
    return ev.CommandDispatched(command_id=cmd(run_key), host=host, generation=generation)


def queued(run_key: str = "run-1", argv: Sequence[str] = ("echo", "hi")) -> ev.CommandQueued:
    """A command queued and not dispatched, as an event: what a run request
    decided on a sandbox not running yet appends, and what the log of any
    sandbox held before decision 098 (on a running one, `run` now queues and
    dispatches the command in one event)."""
    request = run(run_key, argv)
    return ev.CommandQueued(
        command_id=cmd(run_key),
        request_key=run_key,
        request_digest=rq.request_digest(request),
        argv=list(argv),
    )


def command_started(
    run_key: str = "run-1", host: str = HOST_A, generation: int = 1, pid: int = 4242
) -> ev.CommandStarted:
    return ev.CommandStarted(command_id=cmd(run_key), host=host, generation=generation, pid=pid)


def command_ended(
    run_key: str = "run-1",
    state: CommandEndState = "exited",
    host: str | None = HOST_A,
    generation: int = 1,
    exit_code: int | None = 0,
) -> ev.CommandEnded:
    return ev.CommandEnded(
        command_id=cmd(run_key), state=state, exit_code=exit_code, host=host, generation=generation
    )


# --- histories of each phase ---------------------------------------------------

PENDING: tuple[Step, ...] = (create(),)
PLACED: tuple[Step, ...] = (*PENDING, placed())
STARTING: tuple[Step, ...] = (*PLACED, starting())
RUNNING: tuple[Step, ...] = (*STARTING, started())
STOPPING: tuple[Step, ...] = (*RUNNING, stop())
STOPPED: tuple[Step, ...] = (*STOPPING, stopped())
FAILED: tuple[Step, ...] = (*STARTING, start_failed())
DELETED: tuple[Step, ...] = (*STOPPED, delete(), deleted())


# --- given / when / then ---------------------------------------------------------


def envelopes_for(steps: Sequence[Step]) -> list[Envelope]:
    """The envelopes a history appends; a request that is refused fails the test."""
    state: Sandbox | None = None
    envelopes: list[Envelope] = []
    for i, step in enumerate(steps):
        if isinstance(step, rq.Request):
            events, actor, cause = decide(state, step), "client", step.key
        else:
            events, actor, cause = [step], "host-agent", f"step-{i}"
        new = wrap(
            events,
            aggregate_id=SID,
            id_base=f"step-{i}",
            actor=actor,
            causation_id=cause,
            correlation_id=cause,
            time=T0 + i,
        )
        for envelope in new:
            state = evolve(state, envelope)
        envelopes.extend(new)
    return envelopes


def given(*steps: Step) -> Sandbox | None:
    return fold(evolve, envelopes_for(steps), None)


def given_sandbox(*steps: Step) -> Sandbox:
    state = given(*steps)
    assert state is not None
    return state


def when(state: Sandbox | None, request: rq.AnyRequest) -> Outcome:
    try:
        return decide(state, request)
    except Rejected as refusal:
        return refusal


def then_rejected(outcome: Outcome, code: str) -> None:
    assert isinstance(outcome, Rejected), f"expected Rejected({code!r}), got {outcome!r}"
    assert outcome.code == code, outcome
    assert outcome.message, "a refusal carries a sentence for people"


def apply(
    state: Sandbox | None, events: Sequence[ev.AnyEvent], *, time: float = T0 + 1000
) -> Sandbox:
    """Apply decided events to a state, as the live loop does after appending them."""
    envelopes = wrap(
        list(events),
        aggregate_id=SID,
        id_base=f"apply-{time}",
        actor="scheduler",
        causation_id="apply",
        correlation_id="apply",
        time=time,
    )
    result = fold(evolve, envelopes, state)
    assert result is not None
    return result
