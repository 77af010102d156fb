"""The save store against a real nats-server: chunks, manifests, presence, verification."""

from __future__ import annotations

import hashlib
import os
import time

import nats
import pytest
from sandhold.bus.names import Names
from sandhold.saves import (
    CorruptChunk,
    CorruptManifest,
    Entry,
    Manifest,
    ManifestConflict,
    MissingChunk,
    MissingManifest,
    SaveStore,
    SaveStoreError,
)
from sandhold.saves.store import MANIFEST_PART_BYTES


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def one_file_manifest(save_id: str, *pieces: bytes, chunk_size: int = 4096) -> Manifest:
    return Manifest(
        save_id=save_id,
        sandbox_id="sb-1",
        parent_id=None,
        created_at=time.time(),
        chunk_size=chunk_size,
        entries=[
            Entry(
                path=b"f",
                kind="file",
                mode=0o644,
                size=sum(len(p) for p in pieces),
                chunks=[sha(p) for p in pieces],
            )
        ],
    )


async def test_a_chunk_is_stored_once(store: SaveStore) -> None:
    data = os.urandom(1000)
    assert await store.put_chunk(sha(data), data) is True
    assert await store.put_chunk(sha(data), data) is False  # refused by the server: 10071
    assert await store.get_chunk(sha(data)) == data


async def test_a_chunk_larger_than_a_message_is_refused_clearly(store: SaveStore) -> None:
    data = os.urandom(2 * 1024 * 1024)
    with pytest.raises(SaveStoreError, match="max payload"):
        await store.put_chunk(sha(data), data)


async def test_a_chunk_must_match_its_name(store: SaveStore) -> None:
    with pytest.raises(CorruptChunk):
        await store.put_chunk(sha(b"a"), b"b")
    with pytest.raises(ValueError):
        await store.put_chunk("*", b"b")  # would otherwise become a wildcard subject
    with pytest.raises(MissingChunk):
        await store.get_chunk(sha(b"never stored"))


async def test_a_corrupted_chunk_is_detected_on_read(
    store: SaveStore, nc: nats.NATS, names: Names
) -> None:
    data = b"good"
    await store.put_chunk(sha(data), data)
    await nc.jetstream().publish(names.chunk(sha(data)), b"evil")  # replaces it
    with pytest.raises(CorruptChunk):
        await store.get_chunk(sha(data))


async def test_missing_finds_absent_digests(store: SaveStore) -> None:
    present = [os.urandom(16) for _ in range(30)]
    for data in present:
        await store.put_chunk(sha(data), data)
    absent = {sha(os.urandom(16)) for _ in range(17)}
    many = {sha(d) for d in present[:3]} | absent  # large next to the store: listed
    assert await store.missing(many) == absent
    few = {sha(d) for d in present[:2]} | set(list(absent)[:3])  # few: probed one by one
    assert await store.missing(few) == set(list(absent)[:3])
    assert await store.missing([]) == set()
    assert await store.missing({sha(d) for d in present}) == set()


async def test_upload_sends_only_what_is_missing(store: SaveStore, tmp_path) -> None:
    spool = {}
    for i in range(10):
        data = os.urandom(2000 + i)
        (tmp_path / sha(data)).write_bytes(data)
        spool[sha(data)] = tmp_path / sha(data)
    first_five = dict(list(spool.items())[:5])
    seen: list[tuple[int, int]] = []
    stats = await store.upload(first_five, progress=lambda done, total: seen.append((done, total)))
    assert stats.uploaded_chunks == 5 and stats.skipped_chunks == 0
    assert seen[-1] == (stats.uploaded_bytes, stats.uploaded_bytes)
    for path in first_five.values():
        path.unlink()  # stored ones are never read again: gone from the spool is fine
    stats = await store.upload(spool)
    assert (stats.uploaded_chunks, stats.skipped_chunks) == (5, 5)
    assert stats.skipped_bytes == 0  # their spool files are gone: unknown size
    assert await store.missing(spool) == set()


async def test_manifests_are_immutable(store: SaveStore) -> None:
    m = one_file_manifest("sv-0000000000000001", b"abc")
    size, digest = await store.put_manifest(m)
    assert size > 0 and len(digest) == 64
    assert await store.put_manifest(m) == (size, digest)  # an identical re-put is fine
    assert await store.get_manifest(m.save_id) == m
    assert await store.get_manifest(m.save_id, digest=digest) == m
    other = one_file_manifest("sv-0000000000000001", b"abd")
    with pytest.raises(ManifestConflict):
        await store.put_manifest(other)
    assert await store.delete_manifest(m.save_id) is True
    assert await store.delete_manifest(m.save_id) is False
    with pytest.raises(MissingManifest):
        await store.get_manifest(m.save_id)


async def test_a_manifest_larger_than_a_message_is_split(
    store: SaveStore, nc: nats.NATS, names: Names
) -> None:
    # 40k files with one random chunk each: far over the 1 MiB max payload.
    entries = [
        Entry(
            path=b"node_modules/pkg%05d/index.js" % i,
            kind="file",
            mode=0o644,
            size=100,
            chunks=[os.urandom(32).hex()],
        )
        for i in range(40_000)
    ]
    m = Manifest(
        save_id="sv-big",
        sandbox_id="sb",
        parent_id=None,
        created_at=1.0,
        chunk_size=4096,
        entries=[Entry(path=b"node_modules", kind="dir", mode=0o755), *entries],
    )
    size, digest = await store.put_manifest(m)
    assert size > 2 * MANIFEST_PART_BYTES
    assert await store.put_manifest(m) == (size, digest)
    assert await store.get_manifest("sv-big") == m
    assert await store.stored_manifests() == {"sv-big"}  # its parts are not saves of their own
    # A lost part makes the manifest incomplete, never a shorter tree.
    await nc.jetstream().purge_stream(names.saves_stream, subject=names.manifest("sv-big~1"))
    with pytest.raises(MissingManifest, match="part 1"):
        await store.get_manifest("sv-big")
    assert await store.delete_manifest("sv-big")
    info = await nc.jetstream().stream_info(names.saves_stream, subjects_filter=names.manifest("*"))
    assert not info.state.subjects


async def test_verify_passes_a_good_save_and_names_what_is_wrong(
    store: SaveStore, nc: nats.NATS, names: Names
) -> None:
    a, b = os.urandom(4096), os.urandom(100)
    m = one_file_manifest("sv-0000000000000002", a, b)
    for piece in (a, b):
        await store.put_chunk(sha(piece), piece)
    assert await store.verify(m, recheck=[sha(a), sha(b)]) != []  # manifest not stored yet
    await store.put_manifest(m)
    assert await store.verify(m, recheck=[sha(a), sha(b)]) == []

    await nc.jetstream().publish(names.chunk(sha(b)), b"x" * 100)  # corrupted in the store
    problems = await store.verify(m, recheck=[sha(b)])
    assert len(problems) == 1 and "corrupt" in problems[0]
    assert await store.verify(m) == []  # presence alone does not see it: recheck does

    await store.delete_chunks([sha(a)])
    problems = await store.verify(m)
    assert problems == [f"chunk {sha(a)} is not stored (needed by 'f')"]

    await store.delete_manifest(m.save_id)
    problems = await store.verify(m)
    assert any("manifest of save sv-0000000000000002" in p for p in problems)


async def test_stored_chunks_lists_every_chunk_with_its_time(store: SaveStore) -> None:
    assert await store.stored_chunks() == {}
    before = time.time()
    pieces = [os.urandom(64) for _ in range(50)]
    for piece in pieces:
        await store.put_chunk(sha(piece), piece)
    await store.put_manifest(one_file_manifest("sv-3", pieces[0]))  # not a chunk
    stored = await store.stored_chunks()
    assert set(stored) == {sha(p) for p in pieces}
    assert all(before - 1 <= t <= time.time() + 1 for t in stored.values())
    assert await store.delete_chunks([sha(p) for p in pieces[:10]]) == 10
    assert len(await store.stored_chunks()) == 40


async def test_a_manifest_written_over_is_not_the_one_its_save_recorded(
    store: SaveStore, nc: nats.NATS, names: Names
) -> None:
    """The store's own writes are fenced (expected sequence 0), but a writer
    with the right to the subject could replace a manifest with a plain
    publish: a reader given the digest its save recorded refuses that one."""
    m = one_file_manifest("sv-0000000000000002", b"mine")
    _, recorded = await store.put_manifest(m)
    await nc.jetstream().purge_stream(names.saves_stream, subject=names.manifest(m.save_id))
    planted = one_file_manifest("sv-0000000000000002", b"planted")
    _, other = await store.put_manifest(planted)
    assert other != recorded
    assert await store.get_manifest(m.save_id) == planted  # without the digest: taken
    with pytest.raises(CorruptManifest, match="not the one its save recorded"):
        await store.get_manifest(m.save_id, digest=recorded)
