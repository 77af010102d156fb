"""Every event type of sandhold, in one tagged union.

Events are facts, named in the past tense. They are frozen msgspec Structs,
JSON on the wire, with explicit string tags so that renaming a class never
breaks the log. New fields always get defaults and never change type: old
readers skip fields they do not know, and a breaking change gets a new tag.
"""

from __future__ import annotations

from typing import Literal

import msgspec
from sandhold.domain.commands import CommandEndState
from sandhold.domain.task_manifest import RecordedManifest


# Subclasses repeat `frozen=True`: msgspec inherits it, but type checkers only
# read the keywords of the class itself.
class Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """Base of every event."""


# --- sandbox lifecycle -------------------------------------------------------


class SandboxCreated(Event, tag="sandbox.created", frozen=True):
    sandbox_id: str
    request_key: str
    request_digest: str
    memory_limit_bytes: int | None = None
    tenant: str = "default"
    save_interval_s: float | None = None  # None: the saver's global interval
    stop_deadline_s: float = 60.0  # how long a stop may take, final save included
    source_snapshot_id: str | None = None  # created from this Snapshot (a save id)
    source_snapshot_digest: str = ""  # its manifest's SHA-256, as the Snapshot recorded
    source_sandbox_id: str | None = None  # ...which belongs to this sandbox
    recovery: Literal["lazy", "eager"] = "lazy"  # after a host failure: wait to be used, or not
    network: str = "none"  # "none" | "egress" (docs/isolation.md)
    image: str | None = None  # the read-only base's directory on the host; None: the host's own
    pids_limit: int | None = None  # None: the host's default
    cpu_limit: float | None = None  # CPUs; None: no limit
    disk_limit_bytes: int | None = None  # the persistent layer's quota; None: none
    # Reaped (stopped with its final save) after this long without activity;
    # 0: never. None: created before idle limits existed, so never reaped.
    idle_timeout_s: float | None = None
    # Deleted once it has been stopped (or failed) this long; 0 or None: kept
    # until someone deletes it (decision 074).
    keep_stopped_s: float | None = None


class SandboxPlaced(Event, tag="sandbox.placed", frozen=True):
    """The scheduler chose a host; `generation` grows on every (re)placement."""

    host: str
    generation: int
    # What the host materialises when it has no workspace for this placement:
    # decided here, once, so the files and `recovered_from` always agree.
    restore_save_id: str | None = None


class SandboxStarting(Event, tag="sandbox.starting", frozen=True):
    """The host-agent took the start instruction and is preparing the sandbox."""

    host: str
    generation: int


class RestoreReport(msgspec.Struct, frozen=True, kw_only=True):
    """What a start had to bring back from the save store (a cold start's cost)."""

    save_id: str
    restore_ms: float
    fetched_bytes: int
    fetched_chunks: int
    files: int
    cache_hits: int = 0  # chunks the host's own cache had: not fetched
    cached_bytes: int = 0


class SandboxStarted(Event, tag="sandbox.started", frozen=True):
    host: str
    generation: int
    capabilities: dict[str, str] = {}
    # The revision of the sandbox's Connections its files were written from.
    connections_revision: int = 0
    # The restore this start needed; None: the host had the files (or there were none).
    restore: RestoreReport | None = None


class SandboxStartFailed(Event, tag="sandbox.start_failed", frozen=True):
    host: str
    generation: int
    reason: str


class SandboxWaiting(Event, tag="sandbox.waiting", frozen=True):
    """No host can take the sandbox now, and why (`no host has room: 64/64`):
    written when the reason changes, so a pending sandbox says what it waits for."""

    reason: str


class SandboxStartRequested(Event, tag="sandbox.start_requested", frozen=True):
    request_key: str
    request_digest: str
    # The command whose arrival started it (a sandbox stopped because it was idle).
    woken_by: str | None = None


class SandboxStopRequested(Event, tag="sandbox.stop_requested", frozen=True):
    request_key: str
    request_digest: str
    final_save_id: str | None = None  # the save the host takes once processes are stopped
    reason: str = ""  # "idle": stopped by the reaper (docs/saves.md); "": asked for


class SandboxStopped(Event, tag="sandbox.stopped", frozen=True):
    host: str | None
    generation: int


class SandboxTouched(Event, tag="sandbox.touched", frozen=True):
    """A keep-alive: the sandbox counts as active now (its idle time starts again)."""

    request_key: str
    request_digest: str


class SandboxDeleteRequested(Event, tag="sandbox.delete_requested", frozen=True):
    request_key: str
    request_digest: str
    # "": someone's Delete; "kept_stopped": stopped for its `keep_stopped_s`.
    reason: str = ""


class SandboxDeleted(Event, tag="sandbox.deleted", frozen=True):
    host: str | None
    generation: int


# --- commands ----------------------------------------------------------------


class CommandQueued(Event, tag="command.queued", frozen=True):
    command_id: str
    request_key: str
    request_digest: str
    argv: list[str]
    cwd: str | None = None
    env: dict[str, str] = {}
    timeout_s: float | None = None
    kill_grace_s: float = 5.0
    user: str = "user"  # "user" | "root", inside the sandbox
    # The names of the secrets it is given (their values are never recorded:
    # the scheduler keeps them for its dispatch only, docs/security.md).
    secret_names: list[str] = []
    # Queued on a sandbox that could take it at once: dispatched to this
    # placement by the same event (decision 098), not by a `command.dispatched`
    # appended after it.
    dispatched_to: Dispatch | None = None


class Dispatch(msgspec.Struct, frozen=True, kw_only=True):
    """Where a command was dispatched: the host and the placement it holds."""

    host: str
    generation: int


class CommandDispatched(Event, tag="command.dispatched", frozen=True):
    command_id: str
    host: str
    generation: int


class CommandStarted(Event, tag="command.started", frozen=True):
    command_id: str
    host: str
    generation: int
    pid: int


class CommandCancelRequested(Event, tag="command.cancel_requested", frozen=True):
    command_id: str
    request_key: str
    request_digest: str


class CommandEnded(Event, tag="command.ended", frozen=True):
    """A command reached its end state; see `CommandEndState` for the meanings.

    `output_kept` is how many bytes of each stream JetStream acknowledged on
    the OUTPUT stream; `output_complete` is False when newer output may be lost.
    """

    command_id: str
    state: CommandEndState
    exit_code: int | None = None
    signal: int | None = None  # the signal that ended the program, when one did
    reason: str = ""
    host: str | None = None
    generation: int = 0
    output_kept: dict[str, int] = {}
    output_complete: bool = True
    # The program's pid, where it ran: a command that ended within moments of
    # its start has no `command.started` (decision 095), so its end names it.
    pid: int | None = None
    # The host found, as this command ended and nothing was left running in the
    # sandbox, every file as this completed save holds them, with the sandbox's
    # `activity` count at `files_at` when it looked (decision 078). Then no
    # save is due for this command: it changed nothing.
    files_of: str | None = None
    files_at: int = -1


# --- connections -------------------------------------------------------------
# Named credentials delivered as files (decision 031). The log records that one
# was set or removed, its size and where the scheduler keeps its value; never
# the value. `revision` counts every change, so a host can say which it holds.


class ConnectionSet(Event, tag="connection.set", frozen=True):
    name: str
    value_id: str  # its value's subject in the Connections stream (scheduler only)
    size: int  # bytes
    revision: int
    request_key: str
    request_digest: str


class ConnectionRemoved(Event, tag="connection.removed", frozen=True):
    name: str
    revision: int
    request_key: str
    request_digest: str


class ConnectionsDelivered(Event, tag="sandbox.connections_delivered", frozen=True):
    """The host wrote the sandbox's Connections as of `revision` (all of them)."""

    host: str
    generation: int
    revision: int


class ConnectionsDropped(Event, tag="sandbox.connections_dropped", frozen=True):
    """The host no longer holds the files it was given (its tmpfs was emptied:
    a reboot, a full shutdown); the scheduler delivers them again."""

    host: str
    generation: int
    epoch: int  # the host's, when it found them gone


# --- saves and snapshots -----------------------------------------------------


class SaveRequested(Event, tag="save.requested", frozen=True):
    """A save was asked for: on schedule (saver), as a Snapshot, or at a stop."""

    save_id: str
    kind: Literal["scheduled", "snapshot", "final"]
    host: str | None
    generation: int
    parent_id: str | None = None  # the last completed save: what unchanged files come from
    snapshot_name: str | None = None
    request_key: str | None = None
    request_digest: str | None = None


class SaveCaptured(Event, tag="save.captured", frozen=True):
    """The host froze the sandbox, copied what changed into its spool, and thawed."""

    save_id: str
    host: str
    generation: int
    freeze_ms: float
    freeze_method: str  # "cgroup" | "sigstop" | "none" (stopped sandbox)
    scanned_files: int = 0
    changed_files: int = 0
    changed_bytes: int = 0
    # Nothing but the sandbox's box ran while it was frozen: no command, and no
    # process a command left behind. Until a command runs, its files stay these.
    quiet: bool = False


class SaveUploaded(Event, tag="save.uploaded", frozen=True):
    """Every chunk and the manifest were sent to the save store (not yet verified)."""

    save_id: str
    host: str
    generation: int
    total_bytes: int
    files: int
    uploaded_bytes: int
    uploaded_chunks: int
    manifest_bytes: int
    duration_ms: float
    # SHA-256 of the manifest as stored: the saver verifies, and a restore reads,
    # that one and no other (a manifest written over by anyone else is refused).
    manifest_digest: str = ""


class SaveUnchanged(Event, tag="save.unchanged", frozen=True):
    """A scheduled save's capture found every file as its parent save holds
    them: nothing was stored, and the parent (the last completed save) holds
    the sandbox's files as of this capture too (decision 067). The save itself
    ends here, `unchanged`: it is no restore point of its own."""

    save_id: str
    host: str
    generation: int
    freeze_ms: float
    freeze_method: str
    scanned_files: int = 0
    quiet: bool = False  # as `save.captured`'s


class SaveCompleted(Event, tag="save.completed", frozen=True):
    """The saver verified the manifest and every chunk it names: only now it counts."""

    save_id: str
    total_bytes: int
    files: int


class SaveFailed(Event, tag="save.failed", frozen=True):
    save_id: str
    stage: Literal["capture", "upload", "verify", "timeout", "interrupted"]
    reason: str
    host: str | None = None
    generation: int = 0


class SnapshotDeleted(Event, tag="snapshot.deleted", frozen=True):
    """A Snapshot was deleted on request (decision 069): from here on it is a
    save like the others (kind `scheduled`, no name), so retention drops it
    unless it is among the newest the sandbox keeps (a deleted sandbox keeps
    none), and garbage collection then frees what only it held."""

    save_id: str
    request_key: str
    request_digest: str


class SavesExpired(Event, tag="save.expired", frozen=True):
    """Retention dropped these completed saves; their chunks may be collected."""

    save_ids: list[str]


# --- host failure ------------------------------------------------------------


class SandboxLost(Event, tag="sandbox.lost", frozen=True):
    """The sandbox's host stopped renewing its lease (appended by recovery)."""

    host: str
    generation: int
    last_renewal_at: float  # the last lease renewal recovery saw from that host
    fence_at: float  # from then on the host can no longer write (lease_ttl + fence_margin)
    # What was lost: the host ("host": it stopped renewing its lease, or killed
    # the placement in its fence), or only the sandbox's files on a live host
    # ("files_gone", said by that host): the end states say which.
    cause: Literal["host", "files_gone"] = "host"


class SandboxFenced(Event, tag="sandbox.fenced", frozen=True):
    """The lost host's fence time passed: recovery elsewhere is now safe."""

    host: str
    generation: int


class SandboxRecoveryRequested(Event, tag="sandbox.recovery_requested", frozen=True):
    """A start or a command reached a lost sandbox (or it asked for eager recovery)."""

    cause: str  # "start" | "command" | "eager"
    request_key: str | None = None
    request_digest: str | None = None


class HostLost(Event, tag="host.lost", frozen=True):
    host: str
    epoch: int
    last_renewal_at: float
    fence_at: float


class HostFenced(Event, tag="host.fenced", frozen=True):
    host: str
    epoch: int


# --- hosts -------------------------------------------------------------------


class RequestNoted(Event, tag="request.noted", frozen=True):
    """A valid request that changed nothing (e.g. start of a running sandbox).

    Recorded so that its idempotency key is taken: the same key with a
    different body is refused later, as for every other request.
    """

    request_key: str
    request_digest: str


class HostRegistered(Event, tag="host.registered", frozen=True):
    host: str
    epoch: int
    capacity_sandboxes: int
    memory_bytes: int
    capabilities: dict[str, str] = {}


# --- tasks -------------------------------------------------------------------
# A task's log is its ledger: every transition, every attempt with its cause,
# every step claimed before it executes and its output once it finished.


class TaskEvent(Event, frozen=True):
    """Base of every task event (a sandbox or host never sees one)."""


class TaskSubmitted(TaskEvent, tag="task.submitted", frozen=True):
    task_id: str
    request_key: str
    request_digest: str
    manifest: RecordedManifest  # as accepted; read leniently forever after
    tenant: str = "default"


class TaskDriverClaimed(TaskEvent, tag="task.driver_claimed", frozen=True):
    """An orchestrator instance drives the task from here on, in `epoch` (one more
    than the last claim's). A runner appends only while the task's latest claim
    is its own: a former driver's next append is refused (decision 036)."""

    driver: str  # the instance, e.g. "orchestrator-2"
    epoch: int


class TaskStageEntered(TaskEvent, tag="task.stage_entered", frozen=True):
    stage: Literal["staging", "provisioning", "running", "completing"]


OperationErrorClass = Literal["network", "placement", "permanent", "infrastructure_lost"]


class TaskOperationFailed(TaskEvent, tag="task.operation_failed", frozen=True):
    """One attempt at an operation failed. `retry_at` is set when another
    attempt follows (the backoff chosen, so a restart waits the same)."""

    operation: str  # "clone" | "provision" | a step instance id
    attempt: int
    error_class: OperationErrorClass
    reason: str
    detail: str = ""
    retry_at: float | None = None


class TaskStaged(TaskEvent, tag="task.staged", frozen=True):
    """The repository at the ref, checked out and stored as the sandbox's first save."""

    seed_save_id: str
    commit: str
    files: int
    bytes: int
    seed_manifest_digest: str = ""  # SHA-256 of its manifest as stored


class TaskProvisioned(TaskEvent, tag="task.provisioned", frozen=True):
    sandbox_id: str


class TaskStepClaimed(TaskEvent, tag="task.step_claimed", frozen=True):
    """A step instance is claimed before it executes. For an agent step the
    command it will run is linked here, before the request is sent."""

    step_id: str  # "build", or "each[2]" for a loop's third item
    step: str
    kind: Literal["agent", "http"]
    idempotency_key: str
    index: int | None = None
    attempt: int = 1
    sandbox_id: str | None = None
    command_id: str | None = None


class TaskStepDispatched(TaskEvent, tag="task.step_dispatched", frozen=True):
    """The agent step's request was stored by JetStream (acked)."""

    step_id: str
    attempt: int
    fresh_after_crash: bool = False  # a stillborn dispatch replaced after a restart


class TaskStepFinished(TaskEvent, tag="task.step_finished", frozen=True):
    step_id: str
    attempt: int
    output: str = ""
    exit_code: int | None = None
    status: int | None = None  # an http step's response status


class TaskStepFailed(TaskEvent, tag="task.step_failed", frozen=True):
    step_id: str
    attempt: int
    reason: str  # "exit_code" | "interrupted" | "hung" | "timed_out" | "infrastructure_lost" | ...
    detail: str = ""
    output: str = ""
    exit_code: int | None = None
    end_state: str | None = None


class TaskHangWarned(TaskEvent, tag="task.hang_warned", frozen=True):
    step_id: str
    command_id: str
    silent_s: float


class TaskCancelRequested(TaskEvent, tag="task.cancel_requested", frozen=True):
    request_key: str
    request_digest: str


class Artifact(msgspec.Struct, frozen=True, kw_only=True):
    path: str
    size: int
    save_id: str


class TaskArtifactsCollected(TaskEvent, tag="task.artifacts_collected", frozen=True):
    """The artifacts matched in the final snapshot (stored in the save store)."""

    snapshot_id: str | None
    artifacts: list[Artifact] = []


class TaskCompleted(TaskEvent, tag="task.completed", frozen=True):
    final_save_id: str | None = None


class TaskFailed(TaskEvent, tag="task.failed", frozen=True):
    reason: str
    detail: str = ""
    stage: str = ""


class TaskCancelled(TaskEvent, tag="task.cancelled", frozen=True):
    stage: str = ""


class TaskTimedOut(TaskEvent, tag="task.timed_out", frozen=True):
    stage: str = ""
    detail: str = ""


class TaskReleased(TaskEvent, tag="task.released", frozen=True):
    """After the task's end: nothing about it can change any more. Its
    sandbox's stop was decided (or it is settled, or none was asked for), and
    no provisioning request of it can still be decided (decision 071). A
    service keeps nothing of a released task; a request to it is decided on
    it read back from the log."""


AnyEvent = (
    SandboxCreated
    | SandboxPlaced
    | SandboxStarting
    | SandboxStarted
    | SandboxStartFailed
    | SandboxWaiting
    | SandboxStartRequested
    | SandboxStopRequested
    | SandboxStopped
    | SandboxTouched
    | SandboxDeleteRequested
    | SandboxDeleted
    | CommandQueued
    | CommandDispatched
    | CommandStarted
    | CommandCancelRequested
    | CommandEnded
    | ConnectionSet
    | ConnectionRemoved
    | ConnectionsDelivered
    | ConnectionsDropped
    | RequestNoted
    | SaveRequested
    | SaveCaptured
    | SaveUploaded
    | SaveUnchanged
    | SaveCompleted
    | SaveFailed
    | SnapshotDeleted
    | SavesExpired
    | SandboxLost
    | SandboxFenced
    | SandboxRecoveryRequested
    | HostLost
    | HostFenced
    | HostRegistered
    | TaskSubmitted
    | TaskDriverClaimed
    | TaskStageEntered
    | TaskOperationFailed
    | TaskStaged
    | TaskProvisioned
    | TaskStepClaimed
    | TaskStepDispatched
    | TaskStepFinished
    | TaskStepFailed
    | TaskHangWarned
    | TaskCancelRequested
    | TaskArtifactsCollected
    | TaskCompleted
    | TaskFailed
    | TaskCancelled
    | TaskTimedOut
    | TaskReleased
)
