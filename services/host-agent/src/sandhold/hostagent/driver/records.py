"""The records the driver and its supervisors exchange through files.

Plain JSON rather than msgspec: the supervisor imports this module in every warm
process, and these records never leave the host (the service maps them onto
domain events).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

Stream = Literal["stdout", "stderr"]
STREAMS: tuple[Stream, ...] = ("stdout", "stderr")

# How a command ended, as the supervisor (or the driver, for "unknown") saw it.
ExitReason = Literal[
    "exited", "timed_out", "interrupted", "launch_failed", "resource_exhausted", "unknown"
]
EXIT_REASONS: frozenset[str] = frozenset(get_args(ExitReason))

DEFAULT_KILL_GRACE_S = 5.0


def _fields_of(record: Any) -> dict[str, Any]:
    """A record's fields as they are, for `json.dumps` at once: no deep copy
    (`dataclasses.asdict`'s was a fifth of a launch's CPU)."""
    return {name: getattr(record, name) for name in record.__dataclass_fields__}


@dataclass(frozen=True)
class OutputChunk:
    """A piece of a command's output, at its byte offset in the stream file."""

    stream: Stream
    offset: int
    data: bytes


@dataclass(frozen=True)
class CommandExit:
    """The parsed ``exit.json`` of a command (or the driver's ``unknown`` verdict)."""

    reason: ExitReason
    exit_code: int | None = None
    signal: int | None = None
    detail: str = ""
    started_at: float | None = None
    ended_at: float | None = None
    oom_kills: int = 0
    tmp_isolated: bool = False
    # Why /tmp was not private, when it was not.
    tmp_detail: str = ""
    pid: int | None = None

    def to_json(self) -> dict[str, Any]:
        return _fields_of(self)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> CommandExit:
        reason = raw.get("reason")
        if reason not in EXIT_REASONS:
            return cls(reason="unknown", detail=f"unreadable exit record (reason {reason!r})")
        known = {name: raw[name] for name in cls.__dataclass_fields__ if name in raw}
        return cls(**known)


@dataclass(frozen=True)
class CommandSpec:
    """What a supervisor must run; written by the driver as ``spec.json``."""

    sandbox_id: str
    command_id: str
    argv: list[str]
    cwd: str
    env: dict[str, str]
    timeout_s: float | None = None
    kill_grace_s: float = DEFAULT_KILL_GRACE_S
    # cgroup.procs files of the command's cgroup(s): the child writes its pid
    # into them before exec, and the final KILL reaches everyone listed there.
    cgroup_procs: list[str] = field(default_factory=list)
    # The cgroup.procs files of the command's own cgroups (the final KILL's
    # reach); empty: all of cgroup_procs (specs written before the split).
    own_cgroup_procs: list[str] = field(default_factory=list)
    # memory.oom_control (v1) or memory.events (v2) of the command's cgroup,
    # and its OOM kill count before the command (a reused cgroup's, decision 079).
    oom_file: str | None = None
    oom_kills_before: int = 0
    # pids.events whose "max" count rises when a fork is refused by the process limit.
    pids_file: str | None = None
    isolate_tmp: bool = True
    # Directories under /tmp that must stay visible through the private /tmp.
    keep_visible: list[str] = field(default_factory=list)
    created_at: float = 0.0
    # Where the command runs: None on the host (the unisolated process driver),
    # else the box to join and as whom (``joining.BoxTarget`` as JSON).
    box: dict[str, Any] | None = None
    # The sandbox's own disk (disk.py): a command that fails while it is full
    # ran out of disk.
    disk_dir: str | None = None

    def to_json(self) -> dict[str, Any]:
        return _fields_of(self)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> CommandSpec:
        known = {name: raw[name] for name in cls.__dataclass_fields__ if name in raw}
        return cls(**known)


def write_atomically(
    path: Path, payload: bytes, *, durable: bool, placed: Callable[[], None] | None = None
) -> None:
    """Replace ``path`` so readers see the old file or the whole new one, never a part.

    ``durable`` adds the fsyncs that make the file survive a power loss; the
    exit record needs them, the pid file does not. Without ``placed`` the
    content is fsynced before the rename, so a power loss leaves the old name
    or the whole new file. ``placed`` is called as soon as the whole file is in
    place under its name, before any fsync (the supervisor rings there,
    decision 094): whoever it tells reads the whole file at once, while the
    file's and the directory's fsyncs follow here. A power loss before they
    end may then leave the name with no content, which `read_exit` takes for
    no record.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    # 0600: a spec holds the command's environment, records are the host's own.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(payload)
        while view:
            view = view[os.write(fd, view) :]
        if durable and placed is None:
            os.fsync(fd)
        os.replace(tmp, path)
        if placed is not None:
            placed()
            if durable:
                os.fsync(fd)
    finally:
        os.close(fd)
    if durable:
        dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def write_json(
    path: Path,
    value: dict[str, Any],
    *,
    durable: bool = False,
    placed: Callable[[], None] | None = None,
) -> None:
    raw = json.dumps(value, separators=(",", ":")).encode()
    write_atomically(path, raw, durable=durable, placed=placed)


def read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``, or None if the file does not exist (yet)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    value = json.loads(raw)
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return value


def read_exit(path: Path) -> CommandExit | None:
    """The exit record, or None if there is none. An empty or cut-off one is
    none too: only a power loss between its rename and its fsync leaves one
    (`write_atomically`'s `placed`), and its command ended then as one whose
    record was never made (`unknown`, unless its end is in the log already)."""
    try:
        raw = read_json(path)
    except ValueError:  # (json's decode error, or not an object)
        return None
    return None if raw is None else CommandExit.from_json(raw)


def read_pid(path: Path) -> int | None:
    """The pid file's pid; None if there is none, or none whole (written without
    an fsync: a power loss may leave it empty or cut off)."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return None
    return int(text) if text.endswith("\n") and text.strip().isdigit() else None
