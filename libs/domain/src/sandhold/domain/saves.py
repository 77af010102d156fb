"""Saves of a sandbox: their records, how save events change them, their health.

Only a save the saver verified (`SaveCompleted`) counts. A save under way when
anything failed never replaces the last completed one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal

import msgspec
from sandhold.domain import events as ev

SaveState = Literal[
    "requested", "captured", "uploaded", "completed", "unchanged", "failed", "expired"
]
IN_FLIGHT: frozenset[str] = frozenset({"requested", "captured", "uploaded"})

DEFAULT_SAVE_INTERVAL_S = 30.0
FAILING_AFTER = 3  # consecutive failed attempts before status says "failing"
DELAYED_AFTER_INTERVALS = 2.0


class SaveRecord(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    kind: Literal["scheduled", "snapshot", "final"]
    state: SaveState
    requested_at: float
    host: str | None = None
    generation: int = 0
    parent_id: str | None = None
    snapshot_name: str | None = None
    freeze_ms: float | None = None
    freeze_method: str | None = None
    changed_bytes: int = 0
    uploaded_bytes: int = 0
    total_bytes: int = 0
    files: int = 0
    completed_at: float | None = None
    captured_at: float | None = None  # when its files were copied: the state it holds
    failed_at: float | None = None
    stage: str = ""
    reason: str = ""
    manifest_digest: str = ""  # recorded with `save.uploaded` ("" before digests were)
    # The sandbox's `activity` count when this save was requested (-1: unknown),
    # and whether nothing but its box ran when it was captured: together, whether
    # its files can have changed since (`unchanged_since`).
    activity: int = -1
    quiet: bool = False
    changed_at: float | None = None  # when the sandbox's count first moved after it
    # A completed save a later capture found the files unchanged from (decision
    # 067): that capture's time and placement. The save holds the sandbox's
    # files as of then; `activity`, `quiet` and `changed_at` are that capture's.
    confirmed_at: float | None = None
    confirmed_generation: int | None = None


class SaveHealth(msgspec.Struct, kw_only=True):
    state: Literal["ok", "delayed", "failing"]
    since: float | None = None
    reason: str = ""


def requested(event: ev.SaveRequested, at: float, *, activity: int = -1) -> SaveRecord:
    """A new save's record; `activity`: the sandbox's count when it was requested."""
    return SaveRecord(
        id=event.save_id,
        kind=event.kind,
        state="requested",
        requested_at=at,
        host=event.host,
        generation=event.generation,
        parent_id=event.parent_id,
        snapshot_name=event.snapshot_name,
        activity=activity,
    )


def advanced(record: SaveRecord, event: ev.AnyEvent, at: float) -> SaveRecord | None:
    """`record` after one of its events, or None when the event does not change
    it. Only a save under way moves on (captured, uploaded, completed, failed)
    and only a completed one expires: failed and expired are final, as a
    command's end state is (the saver and the hosts decide nothing else)."""
    if record.state == "completed":
        if isinstance(event, ev.SavesExpired):
            return msgspec.structs.replace(record, state="expired")
        return None
    if record.state not in IN_FLIGHT:
        return None
    match event:
        case ev.SaveCaptured():
            changes: dict[str, object] = {
                "state": "captured",
                "captured_at": at,
                "freeze_ms": event.freeze_ms,
                "freeze_method": event.freeze_method,
                "changed_bytes": event.changed_bytes,
                "quiet": event.quiet,
            }
        case ev.SaveUploaded():
            changes = {
                "state": "uploaded",
                "uploaded_bytes": event.uploaded_bytes,
                "total_bytes": event.total_bytes,
                "files": event.files,
                "manifest_digest": event.manifest_digest,
            }
        case ev.SaveUnchanged():
            changes = {
                "state": "unchanged",
                "captured_at": at,
                "freeze_ms": event.freeze_ms,
                "freeze_method": event.freeze_method,
                "quiet": event.quiet,
            }
        case ev.SaveCompleted():
            changes = {
                "state": "completed",
                "completed_at": at,
                "total_bytes": event.total_bytes,
                "files": event.files,
            }
        case ev.SaveFailed():
            changes = {
                "state": "failed",
                "failed_at": at,
                "stage": event.stage,
                "reason": event.reason,
            }
        case _:
            return None
    return msgspec.structs.replace(record, **changes)


def confirmed(parent: SaveRecord, unchanged: SaveRecord) -> SaveRecord:
    """The parent completed save after a capture (`unchanged`, a save of the same
    sandbox) found the files as it holds them: it holds them as of that capture,
    and whether they can have changed since is judged from there."""
    return msgspec.structs.replace(
        parent,
        confirmed_at=unchanged.captured_at,
        confirmed_generation=unchanged.generation,
        activity=unchanged.activity,
        quiet=unchanged.quiet,
        changed_at=unchanged.changed_at,
    )


def holds_as_of(save: SaveRecord) -> float | None:
    """Up to when a completed save is known to hold the sandbox's files (before
    any quiet holding): its capture, or a later capture that found them unchanged."""
    taken = save.captured_at or save.completed_at
    if save.confirmed_at is not None and (taken is None or save.confirmed_at > taken):
        return save.confirmed_at
    return taken


def newest_completed(completed: Iterable[SaveRecord]) -> SaveRecord | None:
    """Of completed saves, the one completed last: what recovery would start from."""
    return max(completed, key=lambda s: s.completed_at or 0.0, default=None)


def health(
    latest: SaveRecord | None,
    failures: Sequence[SaveRecord],
    *,
    interval_s: float,
    running_since: float | None,
    now: float,
    saved_until: float | None = None,
) -> SaveHealth:
    """ok / delayed (no completed save for more than twice the interval) /
    failing (the last attempts failed), with since when and why. `latest`: the
    last completed save; `failures`: the failed attempts since, oldest first;
    `saved_until`: up to when the files are known to be in a save, if later than
    its completion (`sandbox.saved_until`: a quiet sandbox's save holds them
    until a change)."""
    if len(failures) >= FAILING_AFTER:
        return SaveHealth(
            state="failing",
            since=failures[0].failed_at,
            reason=f"{failures[-1].stage}: {failures[-1].reason}",
        )
    reference = latest.completed_at if latest is not None else running_since
    if saved_until is not None and reference is not None:
        reference = max(reference, saved_until)
    if reference is not None and now - reference > DELAYED_AFTER_INTERVALS * interval_s:
        reason = f"no completed save for {now - reference:.0f}s (interval {interval_s:.0f}s)"
        if failures:
            reason += f"; last attempt failed: {failures[-1].reason}"
        return SaveHealth(
            state="delayed", since=reference + DELAYED_AFTER_INTERVALS * interval_s, reason=reason
        )
    return SaveHealth(state="ok")
