"""Storing a deferred capture in one pass (cut, hash, send), against a real nats-server."""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sandhold.saves import Capture, Manifest, SaveStore, capture, restore, store_capture
from sandhold.saves.capture import RACY_WINDOW_S
from sandhold.saves.chunking import DEFAULT_CHUNK_SIZE, max_chunk

from tests.saves.conftest import tree, write

MiB = 1024 * 1024


def later() -> float:
    return time.time() + RACY_WINDOW_S + 1


def deferred(
    workspace: Path, spool: Path, save_id: str, previous: Manifest | None = None, now: float = 0.0
) -> Capture:
    """A capture as the host-agent takes one: copies, cut and hashed later."""
    return capture(
        workspace,
        save_id=save_id,
        sandbox_id="sb",
        previous=previous,
        spool=spool,
        now=now or later(),
        defer_hashing=True,
    )


def _fill(workspace: Path) -> None:
    (workspace / "d").mkdir()
    write(workspace / "d" / "big", os.urandom(3 * MiB + 17))
    write(workspace / "small", b"hello\n")
    write(workspace / "empty", b"")
    write(workspace / "twin", (workspace / "d" / "big").read_bytes())  # same content, other name
    os.symlink("small", workspace / "link")
    os.link(workspace / "small", workspace / "e-small-again")


async def test_a_deferred_capture_is_stored_in_one_pass_and_restores_the_same_tree(
    store: SaveStore, workspace: Path, spool: Path, tmp_path: Path
) -> None:
    _fill(workspace)
    now = later()
    direct = capture(
        workspace, save_id="sv-1", sandbox_id="sb", previous=None, spool=tmp_path / "a", now=now
    )
    copied = deferred(workspace, spool, "sv-1", now=now)
    assert copied.pending and not copied.new_chunks
    seen: list[tuple[int, int]] = []
    stored, sent = await store_capture(
        store, copied, progress=lambda done, total: seen.append((done, total))
    )
    # The same manifest as cutting while reading, nothing pending, and nothing
    # left in the spool: no chunk file was written, every copy is gone.
    assert stored.pending == [] and stored.manifest == direct.manifest
    assert os.listdir(spool) == []
    big = (workspace / "d" / "big").stat().st_size
    assert sent.uploaded_bytes == big + len(b"hello\n")  # the twin's chunks went once
    assert sent.uploaded_chunks == len(stored.manifest.digests)
    assert seen[-1][0] == seen[-1][1] == 2 * big + len(b"hello\n")
    await store.put_manifest(stored.manifest)
    assert await store.verify(stored.manifest, recheck=stored.manifest.digests) == []
    dest = tmp_path / "restored"
    await restore(store, stored.manifest, dest)
    assert tree(dest) == tree(workspace)


async def test_an_insertion_uploads_only_the_chunks_around_it(
    store: SaveStore, workspace: Path, spool: Path, tmp_path: Path
) -> None:
    data = os.urandom(8 * MiB)
    write(workspace / "big", data)
    first, _ = await store_capture(store, deferred(workspace, spool, "sv-1"))
    await store.put_manifest(first.manifest)
    middle = len(data) // 2
    write(workspace / "big", data[:middle] + b"inserted line\n" + data[middle:])
    second, sent = await store_capture(store, deferred(workspace, spool, "sv-2", first.manifest))
    assert second.changed_bytes == len(data) + 14  # the file was read whole...
    assert 1 <= sent.uploaded_chunks <= 3  # ...and only the chunks around the edit were new
    assert sent.uploaded_bytes <= 3 * max_chunk(DEFAULT_CHUNK_SIZE)
    assert sent.skipped_bytes == len(data) + 14 - sent.uploaded_bytes
    await store.put_manifest(second.manifest)
    dest = tmp_path / "restored"
    await restore(store, second.manifest, dest)
    assert tree(dest) == tree(workspace)


async def _chunks(*pieces: bytes) -> AsyncIterator[tuple[str, bytes]]:
    for piece in pieces:
        yield hashlib.sha256(piece).hexdigest(), piece


async def test_a_stream_sends_what_the_store_lacks_once_whether_it_lists_or_asks(
    store: SaveStore,
) -> None:
    kept, new, other = os.urandom(1000), os.urandom(2000), os.urandom(3000)
    assert await store.put_chunk(hashlib.sha256(kept).hexdigest(), kept)
    # Few chunks: each is asked about. Many (`at_most`): the store is listed once.
    asked = await store.upload_stream(_chunks(kept, new, new), at_most=3)
    assert (asked.uploaded_chunks, asked.uploaded_bytes) == (1, 2000)
    assert (asked.skipped_chunks, asked.skipped_bytes) == (1, 1000)
    listed = await store.upload_stream(_chunks(kept, new, other, other), at_most=10_000)
    assert (listed.uploaded_chunks, listed.uploaded_bytes) == (1, 3000)
    assert (listed.skipped_chunks, listed.skipped_bytes) == (2, 3000)
    for piece in (kept, new, other):
        assert await store.get_chunk(hashlib.sha256(piece).hexdigest()) == piece


async def test_a_cancelled_store_leaves_no_copy_open(
    store: SaveStore, workspace: Path, spool: Path
) -> None:
    for i in range(4):
        write(workspace / f"f{i}", os.urandom(8 * MiB))
    captured = deferred(workspace, spool, "sv-1")
    before = set(os.listdir("/proc/self/fd"))
    sending = asyncio.Event()
    task = asyncio.create_task(
        store_capture(store, captured, progress=lambda done, total: sending.set())
    )
    await asyncio.wait_for(sending.wait(), 30)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert set(os.listdir("/proc/self/fd")) <= before
