"""The saver's decisions: when to save, whether a save counts, what to keep.

Pure functions of a sandbox's state (and the time, and what verification
found), so that two savers, or one restarted midway, decide the same things.
"""

from __future__ import annotations

import hashlib

from sandhold.domain import events as ev
from sandhold.domain import requests as rq
from sandhold.domain import saves as sv
from sandhold.domain import work as wk
from sandhold.domain.sandbox import Sandbox, unchanged_since


def first_save_fraction(sandbox_id: str) -> float:
    """Where in [0.5, 1) of its interval a placement's first save falls, by its id:
    sandboxes started together (a host's worth after a restart, a burst of
    creates) would otherwise all be saved together, every interval, each save
    freezing its sandbox and taking the host's CPU at the same moment (exec
    latency under load, bench/load.py). Never later than the interval."""
    digest = hashlib.sha256(sandbox_id.encode()).digest()
    return 0.5 + int.from_bytes(digest[:4], "big") / 2**33


def on_schedule(state: Sandbox) -> bool:
    """Whether the saver's schedule has anything to judge of the sandbox: a save
    due or its idle reaping (only while it runs), or a save that may time out
    (only while one is under way). Any other sandbox needs no look each tick.
    (One kept stopped for a time, decision 074, is looked at less often:
    `deletes_at`, on a selection of its own.)"""
    return state.phase == "running" or bool(state.saves_in_flight)


def due_save(state: Sandbox, *, now: float, cause: str) -> list[ev.AnyEvent]:
    """A scheduled save when the interval has passed since the last request (the
    placement's first: a fraction of it, `first_save_fraction`), and none while
    the sandbox's files are still those of its last save (`unchanged_since`):
    then the interval counts from when they could first have changed."""
    if state.phase != "running" or state.host is None or state.saves_in_flight:
        return []
    if unchanged_since(state) is not None:
        return []
    latest = state.last_completed_save
    last_request = state.last_save_request
    if last_request is not None and last_request[0] == state.generation:
        wait = state.save_interval_s
        since = last_request[1]
        if latest is not None and latest.quiet and latest.changed_at is not None:
            since = max(since, latest.changed_at)
    else:
        wait = state.save_interval_s * first_save_fraction(state.id)
        since = state.running_since or now
    if now - since < wait:
        return []
    return [
        ev.SaveRequested(
            save_id=rq.save_id_for(state.id, cause),
            kind="scheduled",
            host=state.host,
            generation=state.generation,
            parent_id=latest.id if latest else None,
        )
    ]


def save_work(state: Sandbox) -> list[tuple[str, wk.SaveSandboxWork]]:
    """Work for requested saves of the current placement (final saves travel
    with the stop instruction instead)."""
    if state.phase != "running" or state.host is None:
        return []
    return [
        (
            state.host,
            wk.SaveSandboxWork(
                sandbox_id=state.id,
                generation=state.generation,
                save_id=s.id,
                parent_save_id=s.parent_id,
            ),
        )
        for s in state.saves_under_way()
        if s.state == "requested" and s.kind != "final" and s.generation == state.generation
    ]


def awaiting_verification(state: Sandbox) -> list[sv.SaveRecord]:
    return [s for s in state.saves_under_way() if s.state == "uploaded"]


def verified(
    state: Sandbox, save_id: str, problems: list[str], *, total_bytes: int, files: int
) -> list[ev.AnyEvent]:
    """`SaveCompleted` only when verification found nothing wrong."""
    save = state.saves.get(save_id)
    if save is None or save.state != "uploaded":
        return []
    if problems:
        return [
            ev.SaveFailed(
                save_id=save_id,
                stage="verify",
                reason="; ".join(problems)[:2000],
                host=save.host,
                generation=save.generation,
            )
        ]
    return [ev.SaveCompleted(save_id=save_id, total_bytes=total_bytes, files=files)]


def timed_out(state: Sandbox, *, now: float, timeout_s: float) -> list[ev.AnyEvent]:
    """Saves the host did not finish in time fail: they never become the save that
    counts. An uploaded save is past the host; verifying it is the saver's own job,
    done whenever a saver runs, so it does not time out."""
    return [
        ev.SaveFailed(
            save_id=s.id,
            stage="timeout",
            reason=f"not completed within {timeout_s:.0f}s (stopped at {s.state})",
            host=s.host,
            generation=s.generation,
        )
        for s in state.saves_under_way()
        if s.state != "uploaded" and now - s.requested_at > timeout_s
    ]


def expired(state: Sandbox, *, keep_last: int) -> list[ev.AnyEvent]:
    """Keep the last `keep_last` completed saves and every Snapshot. A deleted
    sandbox keeps only its Snapshots (decision 060): its files were discarded,
    nothing can be restored or placed from its other saves, and a Snapshot is a
    named milestone others may still be created from."""
    if state.phase == "deleted":
        keep_last = 0
    completed = sorted(
        (state.saves[i] for i in state.saves_completed if state.saves[i].kind != "snapshot"),
        key=lambda s: s.completed_at or 0.0,
    )
    old = [s.id for s in completed[:-keep_last]] if keep_last > 0 else [s.id for s in completed]
    return [ev.SavesExpired(save_ids=old)] if old else []


def retained(state: Sandbox) -> list[str]:
    """Saves whose manifests and chunks must stay in the store: the completed ones,
    the parents of saves under way (they reuse the parent's chunks unsent), and
    the one a placement is restoring."""
    keep = set(state.saves_completed)
    keep |= {s.parent_id for s in state.saves_under_way() if s.parent_id}
    if state.restore_save_id is not None and state.phase in ("placed", "starting"):
        # Being restored: kept whatever retention or a delete said of it since.
        keep.add(state.restore_save_id)
    if (
        state.source_snapshot_id is not None
        and state.phase != "deleted"
        and not state.saves_completed
    ):
        # A fresh placement may still restore it: until a save of its own
        # completes (then that is the restore point; a deleted sandbox has none).
        keep.add(state.source_snapshot_id)
    return sorted(keep)


def dropped(state: Sandbox) -> list[str]:
    """Saves that no longer count (expired by retention, or failed): their
    manifests can go; their chunks go once no retained save names them. (A pass
    over all of them: garbage collection runs every few minutes, not per event.)"""
    return [s.id for s in state.saves.values() if s.state in ("expired", "failed")]
