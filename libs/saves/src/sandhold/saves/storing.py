"""Storing a capture: one pass over what changed, cut, hashed and sent as it is read.

A deferred capture (see `capture`) leaves a whole-file copy of each changed
file in the spool. Writing those copies out again as chunk files and reading
them back to upload would cross the data three times; here a worker thread
cuts and hashes each copy a few chunks at a time while the chunks before are
already on their way (`SaveStore.upload_stream`), so each byte is read once,
hashed once and sent once, and the hashing hides behind the upload.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator, Iterator

import msgspec
from sandhold.saves.cache import ChunkCache
from sandhold.saves.capture import Capture, with_chunks
from sandhold.saves.chunking import Chunker
from sandhold.saves.store import Progress, SaveStore, UploadStats, file_size

# Chunks cut per hop into the worker thread: enough to make the hop cheap,
# few enough that the first ones leave while the thread works on the next.
_BATCH = 8


async def store_capture(
    store: SaveStore,
    captured: Capture,
    *,
    concurrency: int = 32,
    progress: Progress | None = None,
    cache: ChunkCache | None = None,
) -> tuple[Capture, UploadStats]:
    """Upload every chunk the capture read and finish its manifest.

    The chunk files a capture spooled go first (`SaveStore.upload`), then the
    deferred copies are cut, hashed and sent in one pass and removed. Returns
    the capture with every entry's chunks filled in (nothing pending) and what
    was sent. The manifest itself is not stored here: `put_manifest` it next.
    Each chunk stored is offered to the host's `cache` (kept in the cache's own
    thread, or dropped when it is behind: a save never waits for it).
    """
    offer = cache.offer if cache is not None else None
    spooled_bytes = sum(file_size(path) for path in captured.new_chunks.values())
    pending_bytes = sum(captured.manifest.entries[i].size for i, _ in captured.pending)
    total = spooled_bytes + pending_bytes

    def shifted(offset: int) -> Progress | None:
        if progress is None:
            return None
        report = progress
        return lambda done, _total: report(offset + done, total)

    spooled = await store.upload(
        captured.new_chunks, concurrency=concurrency, progress=shifted(0), sent=offer
    )
    chunker = Chunker(captured.manifest.chunk_size)
    cuts: dict[int, tuple[list[str], list[int]]] = {}

    async def pieces() -> AsyncIterator[tuple[str, bytes]]:
        for index, copy in captured.pending:
            chunks: list[str] = []
            lengths: list[int] = []
            source = _Source(copy, chunker)
            try:
                while batch := await asyncio.to_thread(source.take, _BATCH):
                    for digest, data in batch:
                        chunks.append(digest)
                        lengths.append(len(data))
                        if offer is not None:
                            offer(digest, data)
                        yield digest, data
            finally:
                source.close()
            cuts[index] = (chunks, lengths)

    # Content-defined cuts are at least a quarter of the average long.
    at_most = len(captured.pending) + pending_bytes // max(1, chunker.average // 4)
    streamed = await store.upload_stream(
        pieces(),
        at_most=at_most,
        total_bytes=pending_bytes,
        concurrency=concurrency,
        progress=shifted(spooled_bytes),
    )
    entries = list(captured.manifest.entries)
    chunk_size = captured.manifest.chunk_size
    for index, copy in captured.pending:
        entries[index] = with_chunks(entries[index], *cuts[index], chunk_size)
        os.unlink(copy)
    finished = msgspec.structs.replace(
        captured,
        manifest=msgspec.structs.replace(captured.manifest, entries=entries),
        pending=[],
    )
    return finished, _sum(spooled, streamed)


class _Source:
    """One spool copy, cut in a worker thread a batch at a time.

    Its descriptor is closed only between batches: closed while a cancelled
    batch still reads in its thread, the number could be reused (a socket's)
    and read from.
    """

    def __init__(self, copy: str, chunker: Chunker) -> None:
        self._fd = os.open(copy, os.O_RDONLY | os.O_CLOEXEC)
        self._cut: Iterator[tuple[str, memoryview]] = chunker.cut(self._fd)
        self._lock = threading.Lock()

    def take(self, count: int) -> list[tuple[str, bytes]]:
        """The next chunks, copied out (the cutter reuses its buffer)."""
        taken: list[tuple[str, bytes]] = []
        with self._lock:
            for digest, view in self._cut:
                taken.append((digest, bytes(view)))
                if len(taken) == count:
                    break
        return taken

    def close(self) -> None:
        with self._lock:  # at most one batch's wait
            os.close(self._fd)


def _sum(a: UploadStats, b: UploadStats) -> UploadStats:
    return UploadStats(
        uploaded_chunks=a.uploaded_chunks + b.uploaded_chunks,
        uploaded_bytes=a.uploaded_bytes + b.uploaded_bytes,
        skipped_chunks=a.skipped_chunks + b.skipped_chunks,
        skipped_bytes=a.skipped_bytes + b.skipped_bytes,
    )
