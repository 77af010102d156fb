"""What callers see of a task: its state, stages, steps and artifacts."""

from __future__ import annotations

import msgspec
from sandhold.domain import task as tk
from sandhold.domain.events import Artifact
from sandhold.domain.views import ErrorBody


class StepView(msgspec.Struct, kw_only=True):
    id: str
    step: str
    kind: str
    attempt: int
    status: str
    command_id: str | None = None
    sandbox_id: str | None = None
    exit_code: int | None = None
    http_status: int | None = None
    end_state: str | None = None
    reason: str = ""
    detail: str = ""
    output: str = ""
    claimed_at: float = 0.0
    finished_at: float | None = None
    hang_warned: bool = False


class AttemptView(msgspec.Struct, kw_only=True):
    operation: str
    attempt: int
    error_class: str
    reason: str
    detail: str = ""
    at: float = 0.0
    retry_at: float | None = None


class TaskView(msgspec.Struct, kw_only=True):
    id: str
    name: str
    tenant: str
    state: str
    submitted_at: float
    updated_at: float
    finished_at: float | None = None
    reason: str = ""
    detail: str = ""
    failed_stage: str = ""
    commit: str | None = None
    sandbox_id: str | None = None
    cancel_requested: bool = False
    hang_warnings: int = 0
    steps: list[StepView] = []
    attempts: list[AttemptView] = []
    artifacts: list[Artifact] = []
    final_save_id: str | None = None
    # Ended, and nothing about it changes any more: its sandbox's stop decided
    # (decision 071).
    released: bool = False


class TaskReply(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The orchestrator's answer to a task request: the task, or an error."""

    ok: bool
    task: TaskView | None = None
    error: ErrorBody | None = None


def task_view(state: tk.Task) -> TaskView:
    return TaskView(
        id=state.id,
        name=state.manifest.name,
        tenant=state.tenant,
        state=state.state,
        submitted_at=state.submitted_at,
        updated_at=state.updated_at,
        finished_at=state.finished_at,
        reason=state.reason,
        detail=state.detail,
        failed_stage=state.failed_stage,
        commit=state.commit,
        sandbox_id=state.sandbox_id,
        cancel_requested=state.cancel_requested,
        hang_warnings=state.hang_warnings,
        steps=[
            StepView(
                id=r.id,
                step=r.step,
                kind=r.kind,
                attempt=r.attempt,
                status=r.status,
                command_id=r.command_id,
                sandbox_id=r.sandbox_id,
                exit_code=r.exit_code,
                http_status=r.http_status,
                end_state=r.end_state,
                reason=r.reason,
                detail=r.detail,
                output=r.output,
                claimed_at=r.claimed_at,
                finished_at=r.finished_at,
                hang_warned=r.hang_warned,
            )
            for r in state.steps.values()
        ],
        attempts=[AttemptView(**msgspec.structs.asdict(a)) for a in state.attempts],
        artifacts=state.artifacts,
        final_save_id=state.final_save_id,
        released=state.released,
    )
