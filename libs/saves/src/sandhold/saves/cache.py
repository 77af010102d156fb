"""A host's local cache of chunks, bounded, least recently used evicted first.

A restore takes what the cache holds and fetches only the rest; every chunk a
restore fetched is kept here for the next one (a sandbox recovered on a host
that ran it before, a task's seed restored again). The cache is never a save:
a save counts only once its chunks are stored away from the host, and nothing
here is trusted without its hash: a cached copy that no longer hashes to its
name is dropped and fetched again.

One directory of files named by digest (`<first two hex digits>/<digest>`);
the order of use is kept in memory and in the files' mtimes, so it survives a
restart of the host-agent. Thread-safe: a restore reads in a worker thread and
keeps from its writer thread.

Each file is a header (`MAGIC`, then the XXH3-128 of the chunk) and the chunk.
Its SHA-256 was checked before it was kept (it is the chunk's name); on use
the XXH3 is what is checked, at several GiB/s where SHA-256 here manages one:
a warm restore is bound by it (decision 046). XXH3-128 catches a torn write,
a flipped bit or a truncated file as surely; it is not meant to resist a
forger, and nothing but the host-agent (root, outside every sandbox) can
write here.
"""

from __future__ import annotations

import contextlib
import os
import queue
import secrets
import threading
import time
from collections import OrderedDict
from pathlib import Path

import xxhash
from sandhold.domain.host import ChunkCacheStats

# What a host keeps unless told otherwise (`--chunk-cache`): a few restores of a
# typical workspace, a small part of a host's disk.
DEFAULT_CACHE_BYTES = 2 * 1024**3

# Chunks offered (`offer`) and not yet written, at most: beyond it an offer is
# dropped (the cache is a help, never a cost the save waits for).
OFFER_BYTES = 64 * 1024**2
# The offer thread ends after this long with nothing to do (started again on demand).
_OFFER_IDLE_S = 5.0

MAGIC = b"shc1"  # a cached chunk, format 1 (files without it are from before: dropped)
HEADER = len(MAGIC) + 16

# A cached copy's mtime is its last use, kept to this precision (see `read`).
_USE_STAMP_NS = 60 * 10**9


class ChunkCache:
    def __init__(self, directory: Path, limit_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        if limit_bytes < 0:
            raise ValueError(f"a cache limit must not be negative, not {limit_bytes}")
        self._dir = Path(directory)
        self._limit = limit_bytes
        self._lock = threading.Lock()
        self._sizes: OrderedDict[str, int] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._hits = self._misses = self._evictions = self._corrupt = 0
        self._offered: queue.SimpleQueue[tuple[str, bytes]] = queue.SimpleQueue()
        self._offered_bytes = 0  # offered and not yet kept (or dropped)
        self._settled = threading.Condition(self._lock)
        self._offer_thread: threading.Thread | None = None
        self._dir.mkdir(parents=True, exist_ok=True)
        self._load()
        with self._lock:
            evicted = self._evict()  # a smaller limit than the last run's
        self._unlink(evicted)

    def _load(self) -> None:
        found: list[tuple[int, str, int]] = []
        for sub in self._dir.iterdir():
            if not sub.is_dir():
                continue
            for path in sub.iterdir():
                if path.name.startswith("."):  # a write that never finished
                    with contextlib.suppress(OSError):
                        path.unlink()
                    continue
                with contextlib.suppress(OSError):
                    st = path.stat()
                    if st.st_size < HEADER or _magic(path) != MAGIC:
                        path.unlink()  # an older format's copy: fetched again when needed
                        continue
                    found.append((st.st_mtime_ns, path.name, st.st_size - HEADER))
        for _, digest, size in sorted(found):
            self._sizes[digest] = size
            self._bytes += size

    def _path(self, digest: str) -> Path:
        return self._dir / digest[:2] / digest

    def lookup(self, digests: list[str]) -> tuple[list[str], list[str]]:
        """Which of `digests` the cache holds (to `read`), and which it does
        not (counted as misses now: they are fetched without asking again)."""
        with self._lock:
            held = [d for d in digests if d in self._sizes]
            missing = [d for d in digests if d not in self._sizes]
            self._misses += len(missing)
        return held, missing

    def read(self, digest: str, into: bytearray | None = None) -> memoryview | None:
        """The chunk if the cache holds it and it is still what was kept; a
        copy that is not is dropped (and fetched again by the caller).

        With `into`, the chunk is read into that buffer when it fits (the view
        returned is valid until the buffer's next use): a restore copying
        thousands of chunks then allocates (and faults in) no memory per chunk.
        """
        with self._lock:
            held = digest in self._sizes
            if not held:
                self._misses += 1
                return None
        path = self._path(digest)
        mtime_ns = 0
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                st = os.fstat(fd)
                mtime_ns = st.st_mtime_ns
                data = _read_all(fd, st.st_size, into)
            finally:
                os.close(fd)
        except OSError:
            data = None
        chunk = _checked(data) if data is not None else None
        if chunk is None:
            with self._lock:
                self._forget(digest)
                self._misses += 1
                if data is not None:
                    self._corrupt += 1
            with contextlib.suppress(OSError):
                path.unlink()
            return None
        with self._lock:
            self._hits += 1
            if digest in self._sizes:
                self._sizes.move_to_end(digest)
        if time.time_ns() - mtime_ns > _USE_STAMP_NS:
            # The order of use, for the next start. Coarse on purpose: stamping every
            # read would write an inode per chunk, thousands for one restore.
            with contextlib.suppress(OSError):
                os.utime(path)
        return chunk

    def keep(self, digest: str, data: bytes | memoryview) -> None:
        """Keep a chunk whose hash the caller has checked. Not synced: a copy
        lost or torn by a crash is caught by its hash on use."""
        size = len(data)
        with self._lock:
            if digest in self._sizes:
                self._sizes.move_to_end(digest)
                return
            if size > self._limit:
                return
        path = self._path(digest)
        tmp = path.parent / f".{digest}.{secrets.token_hex(4)}"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                _write_all(fd, MAGIC + xxhash.xxh3_128_digest(data), data)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink()
            return  # a full disk costs a fetch next time, never the restore
        with self._lock:
            if digest not in self._sizes:
                self._sizes[digest] = size
                self._bytes += size
            evicted = self._evict()
        self._unlink(evicted)

    def offer(self, digest: str, data: bytes) -> None:
        """Keep a chunk this host uploaded (its hash the caller's), in the cache's
        own thread: never waits, and drops the offer when `OFFER_BYTES` are
        already waiting to be written."""
        with self._lock:
            if digest in self._sizes or len(data) > self._limit:
                return
            if self._offered_bytes + len(data) > OFFER_BYTES:
                return
            self._offered_bytes += len(data)
            self._offered.put((digest, data))
            if self._offer_thread is None:
                self._offer_thread = threading.Thread(
                    target=self._keep_offered, name="chunk-cache-offers", daemon=True
                )
                self._offer_thread.start()

    def settle(self, timeout: float) -> bool:
        """Wait until every chunk offered so far is kept (or dropped); False if
        `timeout` passed first."""
        with self._settled:
            return self._settled.wait_for(lambda: self._offered_bytes == 0, timeout)

    def _keep_offered(self) -> None:
        while True:
            try:
                digest, data = self._offered.get(timeout=_OFFER_IDLE_S)
            except queue.Empty:
                with self._lock:
                    if self._offered.empty():
                        self._offer_thread = None
                        return
                continue
            try:
                self.keep(digest, data)
            except Exception:  # noqa: BLE001 - a cache write never fails anything
                pass
            finally:
                with self._settled:
                    self._offered_bytes -= len(data)
                    self._settled.notify_all()

    def _forget(self, digest: str) -> None:
        size = self._sizes.pop(digest, None)
        if size is not None:
            self._bytes -= size

    def _evict(self) -> list[str]:
        """Under the lock: the least recently used go until the rest fits. Their
        files are unlinked by the caller once the lock is released (`stats` is
        read on an event loop, which must not wait for a busy disk)."""
        evicted = []
        while self._bytes > self._limit and self._sizes:
            digest, size = self._sizes.popitem(last=False)
            self._bytes -= size
            self._evictions += 1
            evicted.append(digest)
        return evicted

    def _unlink(self, digests: list[str]) -> None:
        for digest in digests:
            with contextlib.suppress(OSError):
                self._path(digest).unlink()

    def stats(self) -> ChunkCacheStats:
        with self._lock:
            asked = self._hits + self._misses
            return ChunkCacheStats(
                hit_ratio=round(self._hits / asked, 4) if asked else None,
                bytes=self._bytes,
                limit_bytes=self._limit,
                chunks=len(self._sizes),
                hits=self._hits,
                misses=self._misses,
                evictions=self._evictions,
                corrupt=self._corrupt,
            )


def _read_all(fd: int, size: int, into: bytearray | None = None) -> bytes | memoryview:
    """The file's bytes (one read as a rule), in `into` when they fit there."""
    if into is not None and size < len(into):
        view = memoryview(into)
        got = 0
        while got < len(view) and (n := os.readv(fd, [view[got:]])):  # to the end
            got += n
        if got < len(view):
            return view[:got]
        os.lseek(fd, 0, os.SEEK_SET)  # it grew past the buffer meanwhile: read it whole
    data = os.read(fd, size + 1)  # one read for a whole chunk, as a rule
    if len(data) <= size:
        parts = [data]
        while part := os.read(fd, 1 << 20):
            parts.append(part)
        data = b"".join(parts)
    return data


def _magic(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read(len(MAGIC))


def _checked(data: bytes | memoryview) -> memoryview | None:
    """The chunk in a cache file, if its header says it is intact."""
    view = memoryview(data)
    if len(view) < HEADER or view[: len(MAGIC)] != MAGIC:
        return None
    chunk = view[HEADER:]
    if xxhash.xxh3_128_digest(chunk) != view[len(MAGIC) : HEADER]:
        return None
    return chunk


def _write_all(fd: int, *parts: bytes | memoryview) -> None:
    for part in parts:
        view = memoryview(part)
        while view:
            view = view[os.write(fd, view) :]
