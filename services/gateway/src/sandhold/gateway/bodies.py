"""HTTP request and response bodies, made from the bus's own msgspec types.

A request body is the bus request without what HTTP carries elsewhere: the
idempotency `key` (the `Idempotency-Key` header), the `tenant` (the bearer
token) and the ids in the path. The structs are derived from the request
types field by field, so a field added to a request appears over HTTP and in
the OpenAPI document with the same type, constraints and default. Responses
are the views the NATS replies carry (`SandboxView`, `CommandView`,
`SaveView`).
"""

from __future__ import annotations

from typing import Any

import msgspec
from sandhold.domain import requests as rq
from sandhold.domain.host import ChunkCacheStats
from sandhold.domain.views import CommandView, SandboxView, SaveView
from sandhold.gateway.problems import FieldError, ProblemError, field_of
from sandhold.gateway.sse import EventPage, EventRecord, OutputChunk

# Carried by the header, the token or the path; or set by services, not callers
# (`seed`: a save staged for the new sandbox, e.g. a task's checkout, which only
# the orchestrator can stage).
_NOT_IN_BODY = frozenset(
    {"key", "tenant", "sandbox_id", "command_id", "seed", "seed_manifest_digest"}
)


def body_of(request_type: type, name: str) -> type:
    fields: list[tuple[str, Any] | tuple[str, Any, Any]] = []  # as defstruct takes them
    for f in msgspec.structs.fields(request_type):
        if f.name in _NOT_IN_BODY:
            continue
        if f.required:
            fields.append((f.name, f.type))
        elif f.default_factory is not msgspec.NODEFAULT:
            fields.append((f.name, f.type, msgspec.field(default_factory=f.default_factory)))
        else:
            fields.append((f.name, f.type, f.default))
    return msgspec.defstruct(
        name, fields, kw_only=True, forbid_unknown_fields=True, module=__name__
    )


CreateSandboxBody = body_of(rq.CreateSandbox, "CreateSandboxBody")
RunCommandBody = body_of(rq.RunCommand, "RunCommandBody")
SnapshotBody = body_of(rq.SnapshotSandbox, "SnapshotBody")


class ConnectionBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A Connection's value (its name is in the path): never recorded, never shown."""

    value: rq.ConnectionValue


__all__ = ["EventPage", "EventRecord", "OutputChunk"]  # the SSE payload, documented with the bodies


def request_fields(body: msgspec.Struct) -> dict[str, Any]:
    # Any: a body's fields are made at runtime from its request's (`body_of`),
    # with the same types, so what they hold fits the request they go back into.
    return {f: getattr(body, f) for f in body.__struct_fields__}


class Page(msgspec.Struct, kw_only=True):
    next_cursor: str | None = None


class SandboxPage(Page, kw_only=True):
    items: list[SandboxView]


class CommandPage(Page, kw_only=True):
    items: list[CommandView]


class SavePage(Page, kw_only=True):
    items: list[SaveView]


class StopResult(msgspec.Struct, kw_only=True):
    """A stop and, separately, the outcome of its final save (decision 006)."""

    stopped: bool  # the sandbox reached `stopped`
    phase: str
    final_save: SaveView | None  # null: it held no host, so nothing to save
    settled: bool  # the stop ended and its final save completed or failed
    sandbox: SandboxView


class CommandOutput(msgspec.Struct, kw_only=True):
    """A command's kept output. `complete` is true only when the command has
    ended and every byte it produced is here."""

    command_id: str
    state: str
    ended: bool
    encoding: str  # "utf-8", or "base64" when either stream is not valid UTF-8
    stdout: str
    stderr: str
    kept_bytes: dict[str, int]  # what the host recorded per stream
    missing_bytes: dict[str, int]  # kept but no longer readable (expired from the store)
    output_complete: bool  # false when the host could not store some output
    complete: bool


class HostView(msgspec.Struct, kw_only=True):
    host: str
    # live | suspect | down (from its lease's age) | lost | fenced (recovery's
    # verdict): the same as `sandhold host ls` (`host.liveness`)
    status: str
    epoch: int
    capacity_sandboxes: int
    memory_bytes: int
    registered_at: float
    capabilities: dict[str, str] = {}
    fence_at: float | None = None
    last_renewal_age_s: float | None = None  # by the host's clock; None: no lease
    lease_interval_s: float = 1.0
    chunk_cache: ChunkCacheStats | None = None  # as of its last renewal; None: keeps none


class HostList(msgspec.Struct, kw_only=True):
    items: list[HostView]


class RebuildResult(msgspec.Struct, kw_only=True):
    position: int
    sandboxes: int
    commands: int
    saves: int
    hosts: int
    tasks: int


def decode_json(data: bytes, body_type: type, *, empty_ok: bool = False):
    """Strict decoding: unknown fields refused, every field validated.

    Unparseable JSON is `malformed_body` (400); JSON that does not match the
    schema is `invalid_request` (422) naming the field.
    """
    # Only a body of no bytes at all is "no body": whitespace alone is not JSON,
    # and a request that sent it meant something it did not say.
    if not data and empty_ok:
        data = b"{}"
    try:
        parsed = msgspec.json.decode(data)
    except msgspec.DecodeError as err:
        raise ProblemError("malformed_body", f"the body is not valid JSON: {err}") from err
    return convert(parsed, body_type)


def convert(parsed: object, body_type: type):
    try:
        return msgspec.convert(_integral(parsed), body_type, strict=True)
    except msgspec.ValidationError as err:
        raise invalid(err) from err


def _integral(value: object) -> object:
    """JSON (and JSON Schema) has one number type: 936878.0 is an integer there, so
    an integral float is taken as an int (a float field takes an int as well)."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
        return int(value)
    if isinstance(value, dict):
        return {k: _integral(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_integral(v) for v in value]
    return value


def invalid(err: msgspec.ValidationError) -> ProblemError:
    field = field_of(err)
    return ProblemError(
        "invalid_request",
        f"{field}: {err}",
        errors=[FieldError(field=field, message=str(err))],
    )
