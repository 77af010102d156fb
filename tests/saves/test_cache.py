"""The host's chunk cache, through real restores from a real store: a second
restore of a save is served from the cache, a cached copy gone bad is fetched
again, and the cache stays within its limit when a restore is larger than it."""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from pathlib import Path

import pytest
from sandhold.saves import Capture, ChunkCache, SaveStore, capture, restore, store_capture
from sandhold.saves.cache import HEADER, OFFER_BYTES
from sandhold.saves.capture import RACY_WINDOW_S

from tests.saves.conftest import tree, write
from tests.saves.test_restore import MiB, save


def _random_files(root: Path, count: int, size: int) -> None:
    for i in range(count):
        write(root / f"f{i}", os.urandom(size))


def _cached_files(directory: Path) -> list[Path]:
    return [p for sub in directory.iterdir() for p in sub.iterdir()]


async def test_a_second_restore_of_a_save_comes_from_the_cache(
    store: SaveStore, workspace: Path, spool: Path, tmp_path: Path
) -> None:
    _random_files(workspace, 6, 300_000)
    saved = await save(store, workspace, spool, "sv-cache-1")
    cache = ChunkCache(tmp_path / "cache", limit_bytes=64 * MiB)

    first = await restore(store, saved.manifest, tmp_path / "one", cache=cache)
    chunks = len(saved.manifest.digests)
    assert (first.cache_hits, first.fetched_chunks) == (0, chunks)
    assert cache.stats().chunks == chunks and cache.stats().bytes == first.fetched_bytes

    second = await restore(store, saved.manifest, tmp_path / "two", cache=cache)
    assert (second.cache_hits, second.fetched_chunks, second.fetched_bytes) == (chunks, 0, 0)
    assert second.cached_bytes == first.fetched_bytes
    assert tree(tmp_path / "two") == tree(workspace)
    assert cache.stats().hits == chunks and cache.stats().hit_ratio == pytest.approx(0.5)

    # what the cache holds outlives the process that filled it
    reopened = ChunkCache(tmp_path / "cache", limit_bytes=64 * MiB)
    assert reopened.stats().chunks == chunks


async def _two_files_restored_once(
    store: SaveStore, workspace: Path, spool: Path, tmp_path: Path, save_id: str
) -> tuple[Capture, ChunkCache]:
    """Files `a` and `b` saved, and restored once through a new cache (which now holds them)."""
    write(workspace / "a", os.urandom(100_000))
    write(workspace / "b", os.urandom(100_000))
    saved = await save(store, workspace, spool, save_id)
    cache = ChunkCache(tmp_path / "cache", limit_bytes=64 * MiB)
    await restore(store, saved.manifest, tmp_path / "one", cache=cache)
    return saved, cache


async def test_a_corrupted_cached_chunk_is_fetched_again(
    store: SaveStore, workspace: Path, spool: Path, tmp_path: Path
) -> None:
    saved, cache = await _two_files_restored_once(store, workspace, spool, tmp_path, "sv-cache-2")

    victim = next(e.chunks for e in saved.manifest.entries if e.path == b"a")[0]
    [copy] = [p for p in _cached_files(tmp_path / "cache") if p.name == victim]
    damaged = bytearray(copy.read_bytes())
    damaged[10] ^= 0xFF  # same size, one bit pattern off
    copy.write_bytes(bytes(damaged))

    again = await restore(store, saved.manifest, tmp_path / "two", cache=cache)
    chunks = len(saved.manifest.digests)
    assert (again.cache_hits, again.fetched_chunks) == (chunks - 1, 1)
    assert (tmp_path / "two" / "a").read_bytes() == (workspace / "a").read_bytes()
    assert cache.stats().corrupt == 1
    assert hashlib.sha256(copy.read_bytes()[HEADER:]).hexdigest() == victim  # kept anew, good


async def test_a_restore_larger_than_the_cache_leaves_it_within_its_limit(
    store: SaveStore, workspace: Path, spool: Path, tmp_path: Path
) -> None:
    _random_files(workspace, 12, 256 * 1024)  # ~3 MiB of distinct chunks
    saved = await save(store, workspace, spool, "sv-cache-3")
    limit = 1 * MiB
    cache = ChunkCache(tmp_path / "cache", limit_bytes=limit)

    stats = await restore(store, saved.manifest, tmp_path / "one", cache=cache)
    assert tree(tmp_path / "one") == tree(workspace)
    held = cache.stats()
    assert 0 < held.bytes <= limit and held.evictions > 0
    on_disk = _cached_files(tmp_path / "cache")
    assert sum(p.stat().st_size - HEADER for p in on_disk) == held.bytes
    assert held.chunks + held.evictions == stats.fetched_chunks

    # the least recently used went: what is left is the last restored, and a
    # restart with a smaller limit evicts down to it
    smaller = ChunkCache(tmp_path / "cache", limit_bytes=limit // 2)
    assert 0 < smaller.stats().bytes <= limit // 2


def test_a_negative_limit_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="must not be negative"):
        ChunkCache(tmp_path / "cache", limit_bytes=-1)


async def test_a_cache_whose_directory_went_away_never_fails_a_restore(
    store: SaveStore, workspace: Path, spool: Path, tmp_path: Path
) -> None:
    write(workspace / "a", os.urandom(100_000))
    saved = await save(store, workspace, spool, "sv-cache-4")
    cache = ChunkCache(tmp_path / "cache", limit_bytes=64 * MiB)
    shutil.rmtree(tmp_path / "cache")  # an operator freeing disk space
    stats = await restore(store, saved.manifest, tmp_path / "one", cache=cache)
    assert (tmp_path / "one" / "a").read_bytes() == (workspace / "a").read_bytes()
    assert stats.fetched_chunks == len(saved.manifest.digests)


async def test_a_truncated_cached_chunk_or_one_from_an_older_format_is_fetched_again(
    store: SaveStore, workspace: Path, spool: Path, tmp_path: Path
) -> None:
    saved, cache = await _two_files_restored_once(store, workspace, spool, tmp_path, "sv-cache-5")
    a, b = (next(e.chunks for e in saved.manifest.entries if e.path == n)[0] for n in (b"a", b"b"))
    copies = {p.name: p for p in _cached_files(tmp_path / "cache")}
    with open(copies[a], "r+b") as f:  # a write torn by a crash
        f.truncate(HEADER + 1000)
    copies[b].write_bytes((workspace / "b").read_bytes())  # the format before headers

    again = await restore(store, saved.manifest, tmp_path / "two", cache=cache)
    assert (tmp_path / "two" / "a").read_bytes() == (workspace / "a").read_bytes()
    assert (again.cache_hits, again.fetched_chunks) == (len(saved.manifest.digests) - 2, 2)
    # an older format's copy is not counted as held once the cache is opened again
    copies[b].write_bytes((workspace / "b").read_bytes())
    assert ChunkCache(tmp_path / "cache").stats().chunks == len(saved.manifest.digests) - 1
    assert not copies[b].exists()


@pytest.mark.parametrize("hashing", ["spooled", "deferred"])
async def test_the_chunks_a_host_uploads_serve_its_next_restore(
    store: SaveStore, workspace: Path, spool: Path, tmp_path: Path, hashing: str
) -> None:
    _random_files(workspace, 3, 700_000)
    write(workspace / "twin", (workspace / "f0").read_bytes())
    captured = capture(
        workspace,
        save_id="sv-cache-6",
        sandbox_id="sb-1",
        previous=None,
        spool=spool,
        now=time.time() + RACY_WINDOW_S,
        defer_hashing=hashing == "deferred",
    )
    cache = ChunkCache(tmp_path / "cache", limit_bytes=64 * MiB)
    stored, _ = await store_capture(store, captured, cache=cache)
    await store.put_manifest(stored.manifest)
    assert cache.settle(timeout=30)  # kept in the cache's own thread

    chunks = set(stored.manifest.digests)
    assert {p.name for p in _cached_files(tmp_path / "cache")} == chunks
    restored = await restore(store, stored.manifest, tmp_path / "one", cache=cache)
    assert (restored.cache_hits, restored.fetched_chunks) == (len(chunks), 0)
    assert tree(tmp_path / "one") == tree(workspace)


def test_offers_beyond_what_the_cache_can_write_soon_are_dropped(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path / "cache", limit_bytes=1024 * MiB)
    blob = os.urandom(MiB)
    chunks = [blob + bytes([i]) for i in range(100)]
    offered = {hashlib.sha256(c).hexdigest(): c for c in chunks}
    for digest, chunk in offered.items():  # 100 MiB in a moment, more than OFFER_BYTES
        cache.offer(digest, chunk)
    assert cache.settle(timeout=60)
    held = cache.stats().chunks
    assert OFFER_BYTES // (MiB + 1) <= held < len(offered)
    assert held == len(_cached_files(tmp_path / "cache"))


def test_a_chunk_read_into_a_buffer_is_the_chunk_kept_whatever_the_buffer_size(
    tmp_path: Path,
) -> None:
    cache = ChunkCache(tmp_path / "cache", limit_bytes=64 * MiB)
    chunk = os.urandom(300_000)
    digest = hashlib.sha256(chunk).hexdigest()
    cache.keep(digest, chunk)

    roomy = bytearray(MiB)
    assert cache.read(digest, into=roomy) == chunk
    assert cache.read(digest, into=bytearray(1000)) == chunk  # too small: read on its own
    assert cache.read(digest) == chunk
    # A copy that went bad is dropped however it is read, and not counted as held.
    (copy,) = _cached_files(tmp_path / "cache")
    with open(copy, "r+b") as f:
        f.seek(HEADER + 5)
        f.write(b"\xff" if chunk[5] != 0xFF else b"\x00")
    assert cache.read(digest, into=roomy) is None
    assert not copy.exists()
    stats = cache.stats()
    assert (stats.hits, stats.corrupt, stats.chunks) == (3, 1, 0)
