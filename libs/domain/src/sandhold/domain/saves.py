"""Saves of a sandbox: their records, how save events change them, their health.

Only a save the saver verified (`SaveCompleted`) counts. A save under way when
anything failed never replaces the last completed one.
"""

from __future__ import annotations

from typing import Literal

import msgspec
from sandhold.domain import events as ev

SaveState = Literal["requested", "captured", "uploaded", "completed", "failed", "expired"]
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


class SaveHealth(msgspec.Struct, kw_only=True):
    state: Literal["ok", "delayed", "failing"]
    since: float | None = None
    reason: str = ""


def apply(
    saves: dict[str, SaveRecord], event: ev.AnyEvent, at: float, *, activity: int = -1
) -> dict[str, SaveRecord]:
    """A new saves map with one save event applied (others leave it as is);
    `activity`: the sandbox's count when a save is requested."""
    replace = msgspec.structs.replace
    match event:
        case ev.SaveRequested():
            if event.save_id in saves:
                return saves
            record = SaveRecord(
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
            return {**saves, record.id: record}
        case ev.SaveCaptured(save_id=save_id):
            changes = {
                "state": "captured",
                "captured_at": at,
                "freeze_ms": event.freeze_ms,
                "freeze_method": event.freeze_method,
                "changed_bytes": event.changed_bytes,
                "quiet": event.quiet,
            }
        case ev.SaveUploaded(save_id=save_id):
            changes = {
                "state": "uploaded",
                "uploaded_bytes": event.uploaded_bytes,
                "total_bytes": event.total_bytes,
                "files": event.files,
                "manifest_digest": event.manifest_digest,
            }
        case ev.SaveCompleted(save_id=save_id):
            changes = {
                "state": "completed",
                "completed_at": at,
                "total_bytes": event.total_bytes,
                "files": event.files,
            }
        case ev.SaveFailed(save_id=save_id):
            changes = {
                "state": "failed",
                "failed_at": at,
                "stage": event.stage,
                "reason": event.reason,
            }
        case ev.SavesExpired(save_ids=ids):
            return {
                k: replace(v, state="expired") if k in ids and v.state == "completed" else v
                for k, v in saves.items()
            }
        case _:
            return saves
    current = saves.get(save_id)
    if current is None:
        return saves
    return {**saves, save_id: replace(current, **changes)}


def last_completed(saves: dict[str, SaveRecord]) -> SaveRecord | None:
    """The newest completed save: what recovery would start from."""
    done = [s for s in saves.values() if s.state == "completed"]
    return max(done, key=lambda s: s.completed_at or 0.0, default=None)


def in_flight(saves: dict[str, SaveRecord]) -> list[SaveRecord]:
    return [s for s in saves.values() if s.state in IN_FLIGHT]


def consecutive_failures(saves: dict[str, SaveRecord]) -> list[SaveRecord]:
    """The failed attempts since the last completed save, oldest first."""
    ordered = sorted(saves.values(), key=lambda s: s.requested_at)
    streak: list[SaveRecord] = []
    for record in ordered:
        if record.state == "completed" or record.state == "expired":
            streak = []
        elif record.state == "failed":
            streak.append(record)
    return streak


def health(
    saves: dict[str, SaveRecord],
    *,
    interval_s: float,
    running_since: float | None,
    now: float,
    saved_until: float | None = None,
) -> SaveHealth:
    """ok / delayed (no completed save for more than twice the interval) /
    failing (the last attempts failed), with since when and why. `saved_until`:
    up to when the files are known to be in a save, if later than its completion
    (`sandbox.saved_until`: a quiet sandbox's save holds them until a change)."""
    failures = consecutive_failures(saves)
    if len(failures) >= FAILING_AFTER:
        return SaveHealth(
            state="failing",
            since=failures[0].failed_at,
            reason=f"{failures[-1].stage}: {failures[-1].reason}",
        )
    latest = last_completed(saves)
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
