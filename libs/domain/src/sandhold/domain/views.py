"""What callers see: the sandbox and command records, without internals."""

from __future__ import annotations

import msgspec
from sandhold.domain.sandbox import Command, Sandbox


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


class SandboxView(msgspec.Struct, kw_only=True):
    id: str
    tenant: str
    phase: str
    host: str | None
    generation: int
    created_at: float
    memory_limit_bytes: int | None = None
    reason: str = ""
    delete_requested: bool = False
    capabilities: dict[str, str] = {}
    commands: dict[str, int] = {}  # command state -> how many


class ErrorBody(msgspec.Struct, kw_only=True):
    code: str
    message: str


class Reply(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The scheduler's answer to a request: a record, or an error."""

    ok: bool
    sandbox: SandboxView | None = None
    command: CommandView | None = None
    error: ErrorBody | None = None


def command_view(sandbox_id: str, c: Command) -> CommandView:
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
    )


def sandbox_view(s: Sandbox) -> SandboxView:
    counts: dict[str, int] = {}
    for c in s.commands.values():
        counts[c.state] = counts.get(c.state, 0) + 1
    return SandboxView(
        id=s.id,
        tenant=s.tenant,
        phase=s.phase,
        host=s.host,
        generation=s.generation,
        created_at=s.created_at,
        memory_limit_bytes=s.memory_limit_bytes,
        reason=s.reason,
        delete_requested=s.delete_requested,
        capabilities=s.capabilities,
        commands=counts,
    )


def reply_for(record: Sandbox | Command, sandbox_id: str) -> Reply:
    if isinstance(record, Sandbox):
        return Reply(ok=True, sandbox=sandbox_view(record))
    return Reply(ok=True, command=command_view(sandbox_id, record))
