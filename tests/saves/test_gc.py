"""Garbage collection against a real store."""

from __future__ import annotations

import hashlib
import os
import time

import nats
import pytest
from sandhold.bus.names import Names
from sandhold.saves import (
    Entry,
    GcAborted,
    Manifest,
    SaveStore,
    collect_garbage,
    delete_unretained_manifests,
)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def manifest_of(save_id: str, *pieces: bytes) -> Manifest:
    return Manifest(
        save_id=save_id,
        sandbox_id="sb",
        parent_id=None,
        created_at=time.time(),
        chunk_size=4096,
        entries=[
            Entry(path=b"f%d" % i, kind="file", mode=0o644, size=len(p), chunks=[sha(p)])
            for i, p in enumerate(pieces)
        ],
    )


async def test_gc_deletes_only_old_unreferenced_chunks(store: SaveStore) -> None:
    needed, old_garbage, fresh = os.urandom(100), os.urandom(100), os.urandom(100)
    for piece in (needed, old_garbage):
        await store.put_chunk(sha(piece), piece)
    await store.put_manifest(manifest_of("sv-kept", needed))
    before = await store.stored_chunks()
    await store.put_chunk(sha(fresh), fresh)  # a save in flight, stored after the others
    stored_at = (await store.stored_chunks())[sha(fresh)]
    assert stored_at > max(before.values())
    # The clock (`now`) is set, not waited for: an hour after a moment between
    # the old chunks and the in-flight one, with an hour's grace.
    between = (max(before.values()) + stored_at) / 2
    stats = await collect_garbage(store, ["sv-kept"], now=between + 3600, grace_s=3600)
    assert stats.deleted_chunks == 1
    assert set(await store.stored_chunks()) == {sha(needed), sha(fresh)}
    # Once the in-flight chunk is old too, and still unnamed, it goes.
    stats = await collect_garbage(store, ["sv-kept"], now=stored_at + 7200, grace_s=3600)
    assert set(await store.stored_chunks()) == {sha(needed)}
    assert stats.retained_saves == 1 and stats.referenced_chunks == 1


async def test_gc_aborts_when_a_retained_manifest_is_missing(store: SaveStore) -> None:
    old = os.urandom(100)
    await store.put_chunk(sha(old), old)
    await store.put_manifest(manifest_of("sv-a"))
    with pytest.raises(GcAborted, match="sv-gone"):
        await collect_garbage(store, ["sv-a", "sv-gone"], now=time.time() + 1e6)
    assert set(await store.stored_chunks()) == {sha(old)}  # nothing deleted


async def test_gc_that_may_no_longer_delete_deletes_nothing(store: SaveStore) -> None:
    # A saver whose store claim lapsed while it loaded manifests: the twin that
    # took it over may be verifying a save that needs these very chunks.
    old = os.urandom(100)
    await store.put_chunk(sha(old), old)
    asked: list[bool] = []

    def may_delete() -> bool:
        asked.append(True)
        return False

    with pytest.raises(GcAborted, match="no longer allowed"):
        await collect_garbage(store, [], now=time.time() + 1e6, grace_s=0, may_delete=may_delete)
    assert asked == [True]
    assert set(await store.stored_chunks()) == {sha(old)}
    stats = await collect_garbage(
        store, [], now=time.time() + 1e6, grace_s=0, may_delete=lambda: True
    )
    assert stats.deleted_chunks == 1


class _CountingDeletes(SaveStore):
    """The real store, counting the manifest deletes it is asked for."""

    asked: list[str]

    async def delete_manifest(self, save_id: str) -> bool:
        self.asked.append(save_id)
        return await super().delete_manifest(save_id)


async def test_manifests_no_retained_save_has_are_deleted_dropped_ones_at_once(
    store: SaveStore, nc: nats.NATS, names: Names
) -> None:
    """Dropped saves' manifests go at once; any other no retained save has goes
    once older than the grace (its sandbox forgotten, decision 061); a
    retained one is kept whatever else says it was dropped. Manifests gone at an
    earlier collection (or never stored) are not deleted again."""
    counting = _CountingDeletes(nc, names)
    counting.asked = []
    big = [os.urandom(64) for _ in range(3)]
    for save_id in ("sv-dropped", "sv-kept", "sv-old", "sv-unheld"):
        await store.put_manifest(manifest_of(save_id, *big))
    assert await store.delete_manifest("sv-old")  # collected before
    dropped = ["sv-dropped", "sv-old", "sv-never-stored", "sv-kept"]
    assert await store.stored_manifests() == {"sv-dropped", "sv-kept", "sv-unheld"}
    now = time.time()
    # Within the grace, only the dropped one goes:
    kept = ["sv-kept"]
    assert await delete_unretained_manifests(counting, dropped, kept, now=now, grace_s=60) == 1
    assert counting.asked == ["sv-dropped"]
    assert await store.stored_manifests() == {"sv-kept", "sv-unheld"}
    # Past it, the one no save retains goes too; the retained one stays:
    later = now + 120
    assert await delete_unretained_manifests(counting, dropped, kept, now=later, grace_s=60) == 1
    assert counting.asked == ["sv-dropped", "sv-unheld"]
    assert await store.stored_manifests() == {"sv-kept"}
    assert await delete_unretained_manifests(counting, dropped, kept, now=later, grace_s=60) == 0
    assert counting.asked == ["sv-dropped", "sv-unheld"]  # nothing asked the third time
