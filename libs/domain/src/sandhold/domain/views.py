"""What callers see: the sandbox and command records, without internals."""

from __future__ import annotations

from datetime import UTC, datetime

import msgspec
from sandhold.domain import events as ev
from sandhold.domain import saves as sv
from sandhold.domain.sandbox import (
    Command,
    RecoveredFrom,
    Sandbox,
    deletes_at,
    reaps_at,
    saved_until,
    unchanged_since,
)


class CommandView(msgspec.Struct, kw_only=True):
    id: str
    sandbox_id: str
    state: str
    argv: list[str]
    exit_code: int | None = None
    signal: int | None = None
    reason: str = ""
    host: str | None = None
    generation: int = 0
    pid: int | None = None
    queued_at: float = 0.0
    ended_at: float | None = None
    output_kept: dict[str, int] = {}
    output_complete: bool = True
    # Queued while its sandbox was stopped for being idle, it waited for the sandbox
    # to start again: `cold_start` is that start, once it has happened.
    cold: bool = False
    cold_start: ColdStart | None = None


class ColdStart(msgspec.Struct, kw_only=True):
    """The start a command paid for: its sandbox had been stopped for being idle."""

    start_ms: float | None = None  # from the start it asked for to `sandbox.started`
    from_save: str | None = None  # the save restored; None: the host still had the files
    restore_ms: float = 0.0
    bytes_fetched: int = 0
    chunks_fetched: int = 0
    cache_hits: int = 0  # chunks the host's cache had, not fetched


class IdleView(msgspec.Struct, kw_only=True):
    timeout_s: float  # 0: never reaped
    since: float  # the last activity: started, a command queued/started/ended, a touch
    reaps_at: float | None = None  # None: not idle now (not running, or a command is under way)


class SaveView(msgspec.Struct, kw_only=True):
    id: str
    kind: str
    state: str
    sandbox_id: str
    requested_at: float
    completed_at: float | None = None
    name: str | None = None
    bytes: int = 0
    files: int = 0
    freeze_ms: float | None = None
    freeze_method: str | None = None
    uploaded_bytes: int = 0
    stage: str = ""
    reason: str = ""
    # A completed save: the last capture that found the files unchanged from it
    # (decision 067), so it holds them as of then.
    confirmed_at: float | None = None


class SandboxView(msgspec.Struct, kw_only=True):
    id: str
    tenant: str
    phase: str
    host: str | None
    generation: int
    created_at: float
    memory_limit_bytes: int | None = None
    pids_limit: int | None = None  # None: its host's default
    cpu_limit: float | None = None  # CPUs; None: none
    disk_limit_bytes: int | None = None  # the persistent layer's quota; None: none
    reason: str = ""
    delete_requested: bool = False
    capabilities: dict[str, str] = {}
    # What keeps this sandbox apart (docs/isolation.md): the requested network and
    # image, and what its host's driver enforces once it has started there.
    isolation: dict[str, object] = {}
    commands: dict[str, int] = {}  # command state -> how many
    save_interval_s: float = sv.DEFAULT_SAVE_INTERVAL_S
    stop_deadline_s: float = 60.0
    last_completed_save: SaveView | None = None
    save_health: sv.SaveHealth | None = None
    # What a failure now would lose: now - when the files were last all in a
    # completed save (0 while they are still those of the last save).
    rpo_s: float | None = None
    # The save whose files the sandbox still has (nothing ran since it was taken
    # with nothing but the box running): scheduled saves wait for a change.
    unchanged_since_save: str | None = None
    recoverable_from: str = ""  # what a host failure now would bring back
    save_in_progress: SaveView | None = None
    final_save: SaveView | None = None  # of the latest stop
    snapshots: list[SaveView] = []
    storage: dict[str, object] | None = None  # where saves live (filled by the reader)
    lost_host: str | None = None  # the host that failed under it
    recovery: dict[str, object] | None = None  # while lost: waiting_for_fence / fenced / ...
    recovered_from: RecoveredFrom | None = None  # the latest recovery's source
    # Names of its Connections (files at /run/connections/<name>), never values;
    # pending: not yet written where the sandbox runs (commands wait for it).
    connections: list[str] = []
    connections_pending: bool = False
    idle: IdleView | None = None
    # Retention once stopped (decision 074): 0 = kept until deleted.
    keep_stopped_s: float = 0.0
    deletes_at: float | None = None  # when, if it stays stopped (or failed)


def isolation_of(s: Sandbox) -> dict[str, object]:
    """The sandbox's isolation as requested, and as enforced where it last started."""
    caps = s.capabilities
    enforced: dict[str, object] = {}
    if caps:
        enforced = {
            "driver": caps.get("driver", "process"),
            "user": caps.get("user", "host-root"),
            "namespaces": caps.get("namespaces", ""),
            "seccomp": caps.get("seccomp") == "True",
            "no_new_privs": caps.get("no_new_privs") == "True",
            "base": caps.get("base", ""),
        }
        if enforced["driver"] == "process":
            enforced["unisolated"] = True  # the development driver: the host's root, no walls
    return {"network": s.network, "image": s.image, **enforced}


class ErrorBody(msgspec.Struct, kw_only=True):
    code: str
    message: str


class Reply(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The scheduler's answer to a request: a record, or an error."""

    ok: bool
    sandbox: SandboxView | None = None
    command: CommandView | None = None
    save: SaveView | None = None
    error: ErrorBody | None = None


def ended_view(record: CommandView, end: ev.CommandEnded, *, at: float) -> CommandView:
    """A command's view as its stored `command.ended` (at `at`) leaves it: what a
    caller that waited for the end shows (the client, the CLI's quick exec)."""
    return msgspec.structs.replace(
        record,
        state=end.state,
        exit_code=end.exit_code,
        signal=end.signal,
        reason=end.reason,
        output_kept=end.output_kept,
        output_complete=end.output_complete,
        ended_at=at,
        host=end.host or record.host,
        generation=end.generation or record.generation,
        pid=record.pid if record.pid is not None else end.pid,
    )


def command_view(sandbox_id: str, c: Command, sandbox: Sandbox | None = None) -> CommandView:
    """`sandbox`: the command's sandbox, to tell whether the command woke it."""
    return CommandView(
        id=c.id,
        sandbox_id=sandbox_id,
        state=c.state,
        argv=c.argv,
        exit_code=c.exit_code,
        signal=c.signal,
        reason=c.reason,
        host=c.host,
        generation=c.generation,
        pid=c.pid,
        queued_at=c.queued_at,
        ended_at=c.ended_at,
        output_kept=c.output_kept,
        output_complete=c.output_complete,
        cold=c.cold,
        cold_start=cold_start_of(sandbox, c.id) if sandbox is not None else None,
    )


def cold_start_of(s: Sandbox, command_id: str) -> ColdStart | None:
    """The start `command_id` waited for (its sandbox had been reaped), once done."""
    command = s.commands.get(command_id)
    start = command.woke_with if command is not None else None
    if start is None:
        return None
    restore = start.restore
    return ColdStart(
        start_ms=round((start.started_at - start.requested_at) * 1000, 1),
        from_save=restore.save_id if restore else None,
        restore_ms=restore.restore_ms if restore else 0.0,
        bytes_fetched=restore.fetched_bytes if restore else 0,
        chunks_fetched=restore.fetched_chunks if restore else 0,
        cache_hits=restore.cache_hits if restore else 0,
    )


def save_view(sandbox_id: str, r: sv.SaveRecord) -> SaveView:
    return SaveView(
        id=r.id,
        kind=r.kind,
        state=r.state,
        sandbox_id=sandbox_id,
        requested_at=r.requested_at,
        completed_at=r.completed_at,
        name=r.snapshot_name,
        bytes=r.total_bytes,
        files=r.files,
        freeze_ms=r.freeze_ms,
        freeze_method=r.freeze_method,
        uploaded_bytes=r.uploaded_bytes,
        stage=r.stage,
        reason=r.reason,
        confirmed_at=r.confirmed_at,
    )


def _recoverable_from(s: Sandbox) -> str:
    latest = s.last_completed_save
    if latest is not None:
        return f"save {latest.id} (completed {_ago(latest.completed_at)})"
    if s.source_snapshot_id is not None:
        return (
            f"only the snapshot {s.source_snapshot_id} it was created from: "
            "no save has completed yet"
        )
    return "only the base image: no save has completed yet"


def _ago(at: float | None) -> str:
    if at is None:
        return "at an unknown time"
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _recovery(s: Sandbox) -> dict[str, object] | None:
    if s.lost is None:
        return None
    if not s.lost.fenced:
        state = "waiting_for_fence"
    elif s.phase == "lost":
        state = "fenced"  # safe to recover; waits for a start or a command
    else:
        state = "recovering"
    return {
        "state": state,
        "fence_at": s.lost.fence_at,
        "last_renewal_at": s.lost.last_renewal_at,
        "lost_host": s.lost.host,
        "lost_generation": s.lost.generation,
        "cause": s.lost.cause,
        "policy": s.recovery_policy,
    }


def sandbox_view(s: Sandbox, *, now: float) -> SandboxView:
    """The sandbox as clients see it at `now` (save health and RPO depend on it)."""
    counts = s.command_counts()
    latest = s.last_completed_save
    in_flight = s.saves_in_flight
    final = s.saves.get(s.final_save_id) if s.final_save_id else None
    saved = saved_until(s, now=now)
    unchanged = unchanged_since(s)
    health = None
    if s.phase == "running" or in_flight or s.save_failures:
        health = sv.health(
            latest,
            s.failed_saves(),
            interval_s=s.save_interval_s,
            running_since=s.running_since,
            now=now,
            saved_until=saved,
        )
    return SandboxView(
        id=s.id,
        tenant=s.tenant,
        phase=s.phase,
        host=s.host,
        generation=s.generation,
        created_at=s.created_at,
        memory_limit_bytes=s.memory_limit_bytes,
        pids_limit=s.pids_limit,
        cpu_limit=s.cpu_limit,
        disk_limit_bytes=s.disk_limit_bytes,
        reason=s.reason,
        delete_requested=s.delete_requested,
        capabilities=s.capabilities,
        isolation=isolation_of(s),
        commands=counts,
        save_interval_s=s.save_interval_s,
        stop_deadline_s=s.stop_deadline_s,
        last_completed_save=save_view(s.id, latest) if latest else None,
        save_health=health,
        rpo_s=None if saved is None else now - saved,
        unchanged_since_save=unchanged.id if unchanged is not None else None,
        recoverable_from=_recoverable_from(s),
        save_in_progress=save_view(s.id, s.saves[in_flight[-1]]) if in_flight else None,
        final_save=save_view(s.id, final) if final else None,
        lost_host=s.lost.host if s.lost else None,
        recovery=_recovery(s),
        recovered_from=s.recovered_from,
        snapshots=[save_view(s.id, r) for r in s.snapshots() if r.state != "failed"],
        connections=sorted(s.connections),
        connections_pending=s.phase in ("starting", "running") and not s.connections_current,
        idle=IdleView(timeout_s=s.idle_timeout_s, since=s.last_active_at, reaps_at=reaps_at(s)),
        keep_stopped_s=s.keep_stopped_s,
        deletes_at=deletes_at(s),
    )


def reply_for(record: Sandbox | Command | sv.SaveRecord, sandbox_id: str, *, now: float) -> Reply:
    if isinstance(record, Sandbox):
        return Reply(ok=True, sandbox=sandbox_view(record, now=now))
    if isinstance(record, sv.SaveRecord):
        return Reply(ok=True, save=save_view(sandbox_id, record))
    return Reply(ok=True, command=command_view(sandbox_id, record))
