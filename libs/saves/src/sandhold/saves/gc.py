"""Garbage collection: delete the chunks no retained save needs.

Safe against saves in flight by age: a chunk stored less than `grace_s` ago
is never collected, so chunks uploaded for a save whose manifest is not yet
stored (or not yet retained) survive until it is. What the age cannot
protect: a save in flight that *reuses* an old chunk no retained save names.
Run GC and "verify, then append SaveCompleted" mutually exclusive (the saver
does both, in the one instance holding its store claim) and read the retained
ids inside that exclusion: a chunk GC
deleted is then seen missing by the verification, and that save fails
instead of completing broken.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import msgspec
from sandhold.saves._bounded import for_each
from sandhold.saves.errors import CorruptManifest, GcAborted, MissingManifest
from sandhold.saves.manifest import Manifest
from sandhold.saves.store import SaveStore


class GcStats(msgspec.Struct, frozen=True, kw_only=True):
    stored_chunks: int
    retained_saves: int
    referenced_chunks: int
    deleted_chunks: int


def collectable(
    stored: Mapping[str, float],
    retained: Iterable[Manifest],
    *,
    now: float,
    grace_s: float,
) -> set[str]:
    """The stored chunks that no retained manifest names and that are older than `grace_s`."""
    referenced: set[str] = set()
    for manifest in retained:
        referenced |= manifest.digests
    cutoff = now - grace_s
    return {d for d, stored_at in stored.items() if d not in referenced and stored_at < cutoff}


async def delete_unretained_manifests(
    store: SaveStore,
    dropped_save_ids: Iterable[str],
    retained_save_ids: Iterable[str],
    *,
    now: float,
    grace_s: float,
) -> int:
    """Delete the stored manifests no retained save has: those of dropped saves
    (expired or failed) at once, and any other older than `grace_s` (a save
    whose sandbox is no longer held at all, decision 061; a seed never used);
    returns how many. The grace keeps a manifest stored just before its save
    says so (or its sandbox is created) as it keeps chunks. One listing of what
    is stored, however many saves the log has dropped since."""
    stored = await store.stored_manifest_times()
    retained = set(retained_save_ids)
    cutoff = now - grace_s
    doomed = {i for i, stored_at in stored.items() if stored_at < cutoff}
    doomed |= stored.keys() & set(dropped_save_ids)
    deleted = 0
    for save_id in sorted(doomed - retained):
        if await store.delete_manifest(save_id):
            deleted += 1
    return deleted


async def collect_garbage(
    store: SaveStore,
    retained_save_ids: Iterable[str],
    *,
    now: float,
    grace_s: float = 3600.0,
    may_delete: Callable[[], bool] | None = None,
) -> GcStats:
    """Delete unreferenced chunks older than `grace_s`.

    `may_delete` is asked once what to delete is known, right before deleting:
    where the exclusion with verification is a claim held across processes
    (the saver's), a collector that lost it while loading manifests stops there.

    Raises:
        GcAborted: a retained save's manifest could not be loaded, or `may_delete`
            said no; nothing was deleted (never delete on incomplete knowledge).
    """
    if grace_s < 0:
        raise ValueError(f"grace_s must not be negative, not {grace_s}")
    save_ids = sorted(set(retained_save_ids))
    stored = await store.stored_chunks()
    retained: list[Manifest] = []

    async def load(save_id: str) -> None:
        try:
            retained.append(await store.get_manifest(save_id))
        except (MissingManifest, CorruptManifest) as err:
            raise GcAborted(f"garbage collection aborted, nothing deleted: {err}") from err

    await for_each(save_ids, load, concurrency=8)
    doomed = collectable(stored, retained, now=now, grace_s=grace_s)
    if doomed and may_delete is not None and not may_delete():
        raise GcAborted("garbage collection aborted, nothing deleted: no longer allowed to")
    deleted = await store.delete_chunks(doomed) if doomed else 0
    referenced: set[str] = set()
    for manifest in retained:
        referenced |= manifest.digests
    return GcStats(
        stored_chunks=len(stored),
        retained_saves=len(retained),
        referenced_chunks=len(referenced),
        deleted_chunks=deleted,
    )
