"""The task aggregate: a manifest's lifecycle and its step ledger.

`pending → staging → provisioning → running → completing → completed`, or
`failed` / `cancelled` / `timed_out`. The log on `<prefix>.ev.task.<id>` is
the checkpoint: every transition, every failed attempt with its cause, every
step claimed before it executes and its output once it finished. The
orchestrator's runner reads only this state to know where to go on, which is
what makes a restart resume instead of start over.
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Literal

import msgspec
from sandhold.domain import events as ev
from sandhold.domain.envelope import Envelope
from sandhold.domain.errors import Rejected
from sandhold.domain.idempotency import seen_before
from sandhold.domain.requests import IdempotencyKey, Secrets, Tenant
from sandhold.domain.task_manifest import (
    DEFAULT_KEEP_STOPPED_S,
    RecordedManifest,
    RecordedStep,
    TaskManifest,
)

TaskState = Literal[
    "pending",
    "staging",
    "provisioning",
    "running",
    "completing",
    "completed",
    "failed",
    "cancelled",
    "timed_out",
]
TERMINAL: frozenset[str] = frozenset({"completed", "failed", "cancelled", "timed_out"})
STAGES = ("staging", "provisioning", "running", "completing")

# Of a step's output, the ledger records the tail: an agent's stdout, a tool's response.
OUTPUT_KEPT = 16 * 1024

TaskId = Annotated[str, msgspec.Meta(pattern=r"^tk-[0-9a-f]{16}$")]


def task_id_for(tenant: str, key: str) -> str:
    """A submission's task id follows from its key, so a retried submit finds it."""
    digest = hashlib.sha256(f"task\x00{tenant}\x00{key}".encode()).hexdigest()[:16]
    return f"tk-{digest}"


# --- requests ----------------------------------------------------------------


# Subclasses repeat `frozen=True`: msgspec inherits it, but type checkers only
# read the keywords of the class itself.
class TaskRequest(
    msgspec.Struct, frozen=True, kw_only=True, tag_field="type", forbid_unknown_fields=True
):
    key: IdempotencyKey
    tenant: Tenant = "default"


class SubmitTask(TaskRequest, tag="task.submit", frozen=True):
    manifest: TaskManifest
    # The values of the secrets the manifest names, one each; never recorded.
    secrets: Secrets = {}

    def __post_init__(self) -> None:
        named, given = set(self.manifest.secrets), set(self.secrets)
        if named != given:
            missing, extra = sorted(named - given), sorted(given - named)
            raise ValueError(
                "`secrets`: a value for each secret the manifest names, and no other"
                + (f"; missing {', '.join(missing)}" if missing else "")
                + (f"; not named in the manifest: {', '.join(extra)}" if extra else "")
            )

    def __repr__(self) -> str:  # never a secret's value in a log line or a traceback
        shown = msgspec.structs.replace(self, secrets=dict.fromkeys(self.secrets, "***"))
        return "SubmitTask" + repr(msgspec.structs.asdict(shown))


class CancelTask(TaskRequest, tag="task.cancel", frozen=True):
    task_id: TaskId


AnyTaskRequest = SubmitTask | CancelTask

_decoder = msgspec.json.Decoder(AnyTaskRequest)
_encoder = msgspec.json.Encoder(order="sorted")


def decode_task_request(payload: bytes) -> AnyTaskRequest:
    return _decoder.decode(payload)


def encode_task_request(request: AnyTaskRequest) -> bytes:
    return _encoder.encode(request)


def task_request_tag(request: AnyTaskRequest) -> str:
    # (the ignore: our tags are all str; msgspec's may be int)
    return type(request).__struct_config__.tag  # type: ignore[return-value]


def task_request_digest(request: AnyTaskRequest) -> str:
    body = msgspec.to_builtins(msgspec.structs.replace(request, key="-"))
    # Secrets: the names only (a digest is recorded); none at all left out, so a
    # task submitted before secrets existed keeps its digest.
    if not body.get("secrets"):
        body.pop("secrets", None)
    else:
        body["secrets"] = sorted(body["secrets"])
    manifest = body.get("manifest")
    if isinstance(manifest, dict) and manifest.get("secrets") == []:
        manifest.pop("secrets")
    # The same for a manifest field added later, at the value a manifest from
    # before it now gets (decision 074): a submit retried across the upgrade.
    sandbox = manifest.get("sandbox") if isinstance(manifest, dict) else None
    if isinstance(sandbox, dict) and sandbox.get("keep_stopped") == DEFAULT_KEEP_STOPPED_S:
        sandbox.pop("keep_stopped")
    return hashlib.sha256(_encoder.encode(body)).hexdigest()[:32]


def aggregate_of(request: AnyTaskRequest) -> str:
    if isinstance(request, SubmitTask):
        return task_id_for(request.tenant, request.key)
    return request.task_id


# --- state -------------------------------------------------------------------

StepStatus = Literal["claimed", "dispatched", "finished", "failed"]


class StepRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One step instance in the ledger (the latest attempt)."""

    id: str
    step: str
    index: int | None
    kind: Literal["agent", "http"]
    attempt: int
    status: StepStatus
    idempotency_key: str
    claimed_at: float
    sandbox_id: str | None = None
    command_id: str | None = None
    finished_at: float | None = None
    output: str = ""
    exit_code: int | None = None
    http_status: int | None = None
    reason: str = ""
    detail: str = ""
    end_state: str | None = None
    hang_warned: bool = False

    @property
    def done(self) -> bool:
        return self.status in ("finished", "failed")


class Attempt(msgspec.Struct, frozen=True, kw_only=True):
    """A failed attempt at an operation, with its cause."""

    operation: str
    attempt: int
    error_class: str
    reason: str
    detail: str
    at: float
    retry_at: float | None


class Task(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    tenant: str
    manifest: RecordedManifest
    state: TaskState
    submitted_at: float
    stage_entered_at: float
    request_key: str
    updated_at: float = 0.0
    finished_at: float | None = None
    reason: str = ""
    detail: str = ""
    failed_stage: str = ""
    seed_save_id: str | None = None
    seed_manifest_digest: str = ""
    commit: str | None = None
    sandbox_id: str | None = None
    attempts: list[Attempt] = []
    steps: dict[str, StepRecord] = {}
    cancel_requested: bool = False
    artifacts: list[ev.Artifact] = []
    snapshot_id: str | None = None
    final_save_id: str | None = None
    hang_warnings: int = 0
    requests: dict[str, str] = {}  # idempotency key -> digest
    # The orchestrator instance that drives it, and the epoch of its claim
    # (`task.driver_claimed`; none yet: 0). Only that epoch's runner may write.
    driver: str | None = None
    driver_epoch: int = 0
    # Its recorded outputs, attempts and artifacts dropped by `compact` (ended).
    compacted: bool = False
    # Ended, and nothing about it can change any more (`task.released`).
    released: bool = False

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    def failures(self, operation: str) -> list[Attempt]:
        return [a for a in self.attempts if a.operation == operation]

    @property
    def last_attempt(self) -> Attempt | None:
        return self.attempts[-1] if self.attempts else None


def compact(state: Task) -> Task:
    """What the orchestrator keeps of a task to decide on (decision 059): once
    it has ended (an end is final: nothing after it changes the task), the
    ledger's recorded outputs (up to 16 KiB a step), the attempts and the
    artifacts go; only a view shows them. The step records stay, outputs
    emptied, for a runner that reads its step as the end lands. A request to a
    compacted task is decided on the whole of it (`whole_needed`)."""
    if not state.terminal or state.compacted:
        return state
    if not (state.attempts or state.artifacts or any(r.output for r in state.steps.values())):
        return state  # nothing to drop: kept whole, and decided on as it is
    replace = msgspec.structs.replace
    return replace(
        state,
        steps={i: replace(r, output="") if r.output else r for i, r in state.steps.items()},
        attempts=[],
        artifacts=[],
        compacted=True,
    )


def forgettable(state: Task) -> bool:
    """Whether a service need keep nothing of this task (decision 071): it
    ended and was released (its sandbox stopped, or none can still be made).
    Nothing periodic decides on it again; a request to it (a submit's retry, a
    cancel) is decided on it read back from the log."""
    return state.released


def release(state: Task | None) -> list[ev.AnyEvent]:
    """`task.released` for an ended task not released yet; `[]` otherwise (a
    twin released it first, or it has not ended)."""
    if state is None or not state.terminal or state.released:
        return []
    return [ev.TaskReleased()]


def whole_needed(state: Task | None, request: AnyTaskRequest) -> bool:
    """Whether a request to this task must be decided on the whole task, read
    back from the log: its answer is the task's view, outputs included."""
    return state is not None and state.compacted


def evolve(state: Task | None, envelope: Envelope) -> Task | None:
    """Apply one task event. The only place a task's state changes."""
    event = envelope.event
    at = envelope.time
    replace = msgspec.structs.replace
    if isinstance(event, ev.TaskSubmitted):
        if state is not None:
            return state
        return Task(
            id=event.task_id,
            tenant=event.tenant,
            manifest=event.manifest,
            state="pending",
            submitted_at=at,
            stage_entered_at=at,
            updated_at=at,
            request_key=event.request_key,
            requests={event.request_key: event.request_digest},
        )
    if state is None or not isinstance(event, ev.TaskEvent):
        return state
    if isinstance(event, ev.TaskReleased):
        # Only after the end (nothing else is appended after it).
        return replace(state, released=True) if state.terminal else state
    if state.terminal:
        # The first end is final: whatever a second writer appended after it
        # (another orchestrator, a decision re-appended after a conflict) is history.
        return state
    state = replace(state, updated_at=at)
    match event:
        case ev.TaskDriverClaimed():
            return replace(state, driver=event.driver, driver_epoch=event.epoch)
        case ev.TaskStageEntered(stage=stage):
            return replace(state, state=stage, stage_entered_at=at)
        case ev.TaskOperationFailed():
            attempt = Attempt(
                operation=event.operation,
                attempt=event.attempt,
                error_class=event.error_class,
                reason=event.reason,
                detail=event.detail,
                at=at,
                retry_at=event.retry_at,
            )
            return replace(state, attempts=[*state.attempts, attempt])
        case ev.TaskStaged():
            return replace(
                state,
                seed_save_id=event.seed_save_id,
                seed_manifest_digest=event.seed_manifest_digest,
                commit=event.commit,
            )
        case ev.TaskProvisioned():
            return replace(state, sandbox_id=event.sandbox_id)
        case ev.TaskStepClaimed():
            record = StepRecord(
                id=event.step_id,
                step=event.step,
                index=event.index,
                kind=event.kind,
                attempt=event.attempt,
                status="claimed",
                idempotency_key=event.idempotency_key,
                claimed_at=at,
                sandbox_id=event.sandbox_id,
                command_id=event.command_id,
            )
            return replace(state, steps={**state.steps, event.step_id: record})
        case ev.TaskStepDispatched():
            return _update_step(state, event.step_id, event.attempt, status="dispatched")
        case ev.TaskStepFinished():
            return _update_step(
                state,
                event.step_id,
                event.attempt,
                status="finished",
                finished_at=at,
                output=event.output,
                exit_code=event.exit_code,
                http_status=event.status,
            )
        case ev.TaskStepFailed():
            return _update_step(
                state,
                event.step_id,
                event.attempt,
                status="failed",
                finished_at=at,
                output=event.output,
                exit_code=event.exit_code,
                reason=event.reason,
                detail=event.detail,
                end_state=event.end_state,
            )
        case ev.TaskHangWarned():
            state = replace(state, hang_warnings=state.hang_warnings + 1)
            current = state.steps.get(event.step_id)
            if current is None or current.command_id != event.command_id:
                return state  # about an earlier attempt's command
            return _update_step(state, event.step_id, None, hang_warned=True)
        case ev.TaskCancelRequested():
            requests = {**state.requests, event.request_key: event.request_digest}
            return replace(state, cancel_requested=True, requests=requests)
        case ev.TaskArtifactsCollected():
            return replace(state, artifacts=event.artifacts, snapshot_id=event.snapshot_id)
        case ev.TaskCompleted():
            return replace(
                state, state="completed", finished_at=at, final_save_id=event.final_save_id
            )
        case ev.TaskFailed():
            return replace(
                state,
                state="failed",
                finished_at=at,
                reason=event.reason,
                detail=event.detail,
                failed_stage=event.stage,
            )
        case ev.TaskCancelled():
            return replace(
                state,
                state="cancelled",
                finished_at=at,
                reason="cancelled",
                failed_stage=event.stage,
            )
        case ev.TaskTimedOut():
            return replace(
                state,
                state="timed_out",
                finished_at=at,
                reason="timed_out",
                detail=event.detail,
                failed_stage=event.stage,
            )
        case _:
            return state


def _update_step(state: Task, step_id: str, attempt: int | None, **changes: object) -> Task:
    record = state.steps.get(step_id)
    if record is None or (attempt is not None and record.attempt != attempt):
        return state  # a late report about an older attempt changes nothing
    updated = msgspec.structs.replace(record, **changes)
    return msgspec.structs.replace(state, steps={**state.steps, step_id: updated})


# --- deciding requests ---------------------------------------------------------


def decide(state: Task | None, request: AnyTaskRequest) -> list[ev.AnyEvent]:
    """What a submit or cancel changes; `[]` when it was already applied."""
    digest = task_request_digest(request)
    if isinstance(request, SubmitTask):
        if state is not None:
            seen_before(state.requests, request.key, digest)
            return []
        return [
            ev.TaskSubmitted(
                task_id=task_id_for(request.tenant, request.key),
                request_key=request.key,
                request_digest=digest,
                manifest=request.manifest,
                tenant=request.tenant,
            )
        ]
    if state is None or state.tenant != request.tenant:
        raise Rejected("task_not_found", f"no task {request.task_id}")
    if seen_before(state.requests, request.key, digest) or state.cancel_requested:
        return []
    if state.terminal:
        raise Rejected(
            "task_finished", f"task {state.id} already ended {state.state}; nothing to cancel"
        )
    return [ev.TaskCancelRequested(request_key=request.key, request_digest=digest)]


# --- the pipeline, as the runner walks it ----------------------------------------


class StepInstance(msgspec.Struct, frozen=True):
    """One execution unit: a step, or one item of a looping step."""

    id: str
    step: RecordedStep
    index: int | None
    item: str | None


def instances(manifest: RecordedManifest) -> list[StepInstance]:
    """Every step instance in order; a loop's items one at a time."""
    out: list[StepInstance] = []
    for step in manifest.steps:
        if step.for_each is None:
            out.append(StepInstance(step.name, step, None, None))
        else:
            for i, item in enumerate(step.for_each):
                out.append(StepInstance(f"{step.name}[{i}]", step, i, item))
    return out


def step_key(task_id: str, step_id: str, attempt: int) -> str:
    """The idempotency key of one step attempt, sent with it (derived from
    task, step and attempt, so a receiver can de-duplicate a replay)."""
    return f"{task_id}:{step_id}:{attempt}"


def outputs(state: Task) -> dict[str, str]:
    """Recorded outputs of finished steps: the scope later steps read from."""
    return {r.id: r.output for r in state.steps.values() if r.status == "finished"}


def render(text: str, *, item: str | None, scope: dict[str, str]) -> str:
    """`{{item}}` and `{{steps.NAME.output}}` in a step's arguments, from the ledger."""
    if "{{" not in text:
        return text
    out = text
    if item is not None:
        out = out.replace("{{item}}", item).replace("{{ item }}", item)
    for step_id, output in scope.items():
        for form in (f"{{{{steps.{step_id}.output}}}}", f"{{{{ steps.{step_id}.output }}}}"):
            out = out.replace(form, output.strip())
    return out


def deadline(state: Task, what: Literal["stage", "task"]) -> float | None:
    """When the current stage, or the whole task, must be over (unix time)."""
    timeouts = state.manifest.timeouts
    if what == "task":
        return state.submitted_at + float(timeouts.task)
    if state.state == "running":
        return state.stage_entered_at + float(timeouts.running) if timeouts.running else None
    if state.state in ("staging", "provisioning", "completing"):
        return state.stage_entered_at + float(timeouts.stage)
    return None
