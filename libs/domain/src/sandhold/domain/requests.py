"""Requests from outside: imperative names, decoded strictly.

Unknown fields are refused (a typo must not be silently ignored) and every
field is validated on decode, so a malformed request never reaches a decider.
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Literal

import msgspec

IdempotencyKey = Annotated[
    str, msgspec.Meta(min_length=1, max_length=200, pattern=r"^[\x21-\x7e]+$")
]
SandboxId = Annotated[str, msgspec.Meta(pattern=r"^sb-[0-9a-f]{16}$")]
CommandId = Annotated[str, msgspec.Meta(pattern=r"^cmd-[0-9a-f]{16}$")]
Tenant = Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
Argv = Annotated[list[Annotated[str, msgspec.Meta(max_length=65536)]], msgspec.Meta(min_length=1)]
Seconds = Annotated[float, msgspec.Meta(gt=0, le=7 * 24 * 3600)]
Grace = Annotated[float, msgspec.Meta(ge=0, le=3600)]
# Below a few MiB the kernel cannot even start a Python interpreter in the cgroup.
MemoryLimit = Annotated[int, msgspec.Meta(ge=4 * 1024 * 1024, le=2**63 - 1)]
# Processes and threads at once; a shell and a few tools need a dozen or so.
PidsLimit = Annotated[int, msgspec.Meta(ge=16, le=4 * 1024 * 1024)]
# CPUs' worth of time per scheduling period (0.5 = half a core); a throttle.
CpuLimit = Annotated[float, msgspec.Meta(ge=0.01, le=1024)]
# The persistent layer's size, in bytes: a file system of its own (64 MiB..16 TiB).
DiskLimit = Annotated[int, msgspec.Meta(ge=64 * 1024 * 1024, le=16 * 1024**4)]


# Subclasses repeat `frozen=True`: msgspec inherits it, but type checkers only
# read the keywords of the class itself.
class Request(
    msgspec.Struct, frozen=True, kw_only=True, tag_field="type", forbid_unknown_fields=True
):
    """Base of every client request. `key` is the idempotency key."""

    key: IdempotencyKey
    tenant: Tenant = "default"


SaveId = Annotated[str, msgspec.Meta(pattern=r"^sv-[0-9a-f]{16}$")]
ManifestDigest = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}$")]
SnapshotName = Annotated[
    str, msgspec.Meta(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$")
]
Interval = Annotated[float, msgspec.Meta(ge=1, le=86400)]
Deadline = Annotated[float, msgspec.Meta(ge=1, le=3600)]
# Seconds without activity before a sandbox is stopped with its final save; 0: never.
IdleTimeout = Annotated[float, msgspec.Meta(ge=0, le=30 * 86400)]
# Seconds a stopped (or failed) sandbox is kept before it is deleted; 0: until
# someone deletes it (decision 074).
KeepStopped = Annotated[float, msgspec.Meta(ge=0, le=365 * 86400)]
# A sandbox's network: its own loopback only, or outbound through user-mode
# networking (docs/isolation.md). The host's loopback is unreachable in both.
Network = Literal["none", "egress"]
# After a host failure: recover when next used, or at once.
Recovery = Literal["lazy", "eager"]
# The read-only base of the sandbox's root: a directory under one of its host's
# image directories, by name or absolute path (the host refuses anything else,
# so no caller can make a host directory such as / into a sandbox's base).
_IMAGE = r"^(/[^\x00]*|[A-Za-z0-9][A-Za-z0-9._-]*)$"
ImagePath = Annotated[str, msgspec.Meta(min_length=1, max_length=4096, pattern=_IMAGE)]
# Who a command runs as inside the sandbox: its unprivileged user, or its root
# (which holds no capability outside the sandbox either way).
CommandUser = Literal["user", "root"]


class CreateSandbox(Request, tag="sandbox.create", frozen=True):
    memory_limit_bytes: MemoryLimit | None = None
    from_snapshot: SaveId | None = None  # a Snapshot's id: its files are the starting point
    save_interval_s: Interval | None = None  # default: the scheduler's (30 s)
    stop_deadline_s: Deadline | None = None  # default: the scheduler's (60 s)
    recovery: Recovery | None = None  # default lazy
    # A save the caller staged in the store for this very sandbox (its manifest
    # names the new sandbox's id), e.g. a task's checked-out repository.
    seed: SaveId | None = None
    # ...and the SHA-256 of its manifest as staged: restored only if it is that one.
    seed_manifest_digest: ManifestDigest | None = None
    network: Network = "none"
    image: ImagePath | None = None
    pids_limit: PidsLimit | None = None  # default: the host's (4096)
    cpu_limit: CpuLimit | None = None  # default: no limit
    disk_limit_bytes: DiskLimit | None = None  # default: no quota (the host's free space)
    idle_timeout_s: IdleTimeout | None = None  # default: the scheduler's (30 min); 0: never
    keep_stopped_s: KeepStopped | None = None  # default (and 0): kept until deleted


class StartSandbox(Request, tag="sandbox.start", frozen=True):
    sandbox_id: SandboxId
    # Keys of requests that end what this start is for (a task's stops): decided
    # after any of them (a start redelivered late), it starts nothing (decision 082).
    superseded_by: Annotated[tuple[IdempotencyKey, ...], msgspec.Meta(max_length=8)] = ()


class StopSandbox(Request, tag="sandbox.stop", frozen=True):
    sandbox_id: SandboxId


class TouchSandbox(Request, tag="sandbox.touch", frozen=True):
    """A keep-alive: the sandbox's idle time starts again, as after a command."""

    sandbox_id: SandboxId


class DeleteSandbox(Request, tag="sandbox.delete", frozen=True):
    sandbox_id: SandboxId


class SnapshotSandbox(Request, tag="sandbox.snapshot", frozen=True):
    """Take a named, retained save now (a milestone)."""

    sandbox_id: SandboxId
    name: SnapshotName


class DeleteSnapshot(Request, tag="sandbox.delete_snapshot", frozen=True):
    """A Snapshot is no longer wanted: it becomes a save like the others, and
    retention drops it (decision 069). Also of a deleted sandbox."""

    sandbox_id: SandboxId
    save_id: SaveId


# A secret's name is an environment variable's; its value reaches the command's
# environment and nothing else: events, views and logs carry the name only.
SecretName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")]
SecretValue = Annotated[str, msgspec.Meta(max_length=65536)]
Secrets = Annotated[dict[SecretName, SecretValue], msgspec.Meta(max_length=64)]


class RunCommand(Request, tag="command.run", frozen=True):
    sandbox_id: SandboxId
    argv: Argv
    cwd: str | None = None
    env: dict[str, str] = {}
    timeout_s: Seconds | None = None
    kill_grace_s: Grace = 5.0
    user: CommandUser = "user"
    secrets: Secrets = {}

    def __post_init__(self) -> None:
        both = sorted(set(self.env) & set(self.secrets))
        if both:
            raise ValueError(f"{', '.join(both)} given both in `env` and in `secrets`")

    def __repr__(self) -> str:  # never a secret's value in a log line or a traceback
        shown = msgspec.structs.replace(self, secrets=dict.fromkeys(self.secrets, "***"))
        return "RunCommand" + repr(msgspec.structs.asdict(shown))


class CancelCommand(Request, tag="command.cancel", frozen=True):
    sandbox_id: SandboxId
    command_id: CommandId


# A Connection is a named credential delivered as the file
# /run/connections/<name> (decision 031): a file name, never "." or "..",
# and with no ".." anywhere (the host's own rule for names it writes).
ConnectionName = Annotated[
    str, msgspec.Meta(max_length=64, pattern=r"^[A-Za-z0-9](\.?[A-Za-z0-9_-])*\.?$")
]
# Text (a token, a key, a config file); the size of every Connection of a
# sandbox together is bounded too (sandbox.MAX_CONNECTIONS_BYTES).
ConnectionValue = Annotated[str, msgspec.Meta(max_length=65536)]


class SetConnection(Request, tag="connection.set", frozen=True):
    """Attach (or replace) a Connection; its value never reaches the log."""

    sandbox_id: SandboxId
    name: ConnectionName
    value: ConnectionValue

    def __repr__(self) -> str:  # never the value in a log line or a traceback
        shown = msgspec.structs.replace(self, value="***")
        return "SetConnection" + repr(msgspec.structs.asdict(shown))


class RemoveConnection(Request, tag="connection.remove", frozen=True):
    sandbox_id: SandboxId
    name: ConnectionName


AnyRequest = (
    CreateSandbox
    | StartSandbox
    | StopSandbox
    | TouchSandbox
    | DeleteSandbox
    | SnapshotSandbox
    | DeleteSnapshot
    | RunCommand
    | CancelCommand
    | SetConnection
    | RemoveConnection
)

_decoder = msgspec.json.Decoder(AnyRequest)
_encoder = msgspec.json.Encoder(order="sorted")


def decode_request(payload: bytes) -> AnyRequest:
    """Decode and validate a request; raises `msgspec.ValidationError` or `DecodeError`."""
    return _decoder.decode(payload)


def encode_request(request: AnyRequest) -> bytes:
    return _encoder.encode(request)


def request_tag(request: AnyRequest) -> str:
    # (the ignore: our tags are all str; msgspec's may be int)
    return type(request).__struct_config__.tag  # type: ignore[return-value]


# Fields added after the first release are left out of the digest while unset
# (or at the value that means what their absence meant), so a request retried
# across an upgrade keeps its digest (and its key stays its own).
_LATER_FIELDS: dict[str, object] = {
    "from_snapshot": None,
    "save_interval_s": None,
    "stop_deadline_s": None,
    "recovery": None,
    "seed": None,
    "seed_manifest_digest": None,
    "network": "none",
    "image": None,
    "user": "user",
    "pids_limit": None,
    "cpu_limit": None,
    "disk_limit_bytes": None,
    "idle_timeout_s": None,
    "keep_stopped_s": None,
    "secrets": {},
    "superseded_by": (),
}


def request_digest(request: AnyRequest) -> str:
    """What the request asks for, without its key: equal digests = same body."""
    body = msgspec.to_builtins(msgspec.structs.replace(request, key="-"))
    if body.get("secrets"):
        # The names, not the values: a digest is recorded, and a hash of a short
        # secret can be guessed. A retry with a new value is the same request.
        body["secrets"] = sorted(body["secrets"])
    if isinstance(request, SetConnection):
        body.pop("value")  # the same reasoning: a Connection's digest covers its name
    for name, unset in _LATER_FIELDS.items():
        if name in body and body[name] == unset:
            body.pop(name)
    return hashlib.sha256(_encoder.encode(body)).hexdigest()[:32]


def _short_hash(*parts: str) -> str:
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:16]


def sandbox_id_for(tenant: str, key: str) -> str:
    """A create request's sandbox id follows from its key, so a retry finds it."""
    return f"sb-{_short_hash('sandbox', tenant, key)}"


def save_id_for(sandbox_id: str, cause: str) -> str:
    """A save's id follows from what asked for it (a request key, or the state a
    scheduled save was decided on), so deciding twice names the same save."""
    return f"sv-{_short_hash('save', sandbox_id, cause)}"


def connection_value_id(sandbox_id: str, key: str) -> str:
    """Where a set request's value is kept (decision 031): one per request, so
    values set concurrently never overwrite each other."""
    return f"cv-{_short_hash('connection', sandbox_id, key)}"


def command_id_for(sandbox_id: str, key: str) -> str:
    """A run request's command id follows from its key, so the caller knows it up front."""
    return f"cmd-{_short_hash('command', sandbox_id, key)}"
