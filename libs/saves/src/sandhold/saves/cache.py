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
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import threading
from collections import OrderedDict
from pathlib import Path

from sandhold.domain.host import ChunkCacheStats

# What a host keeps unless told otherwise (`--chunk-cache`): a few restores of a
# typical workspace, a small part of a host's disk.
DEFAULT_CACHE_BYTES = 2 * 1024**3


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
                    found.append((st.st_mtime_ns, path.name, st.st_size))
        for _, digest, size in sorted(found):
            self._sizes[digest] = size
            self._bytes += size

    def _path(self, digest: str) -> Path:
        return self._dir / digest[:2] / digest

    def read(self, digest: str) -> bytes | None:
        """The chunk if the cache holds it and it still hashes to `digest`; a
        copy that does not is dropped (and fetched again by the caller)."""
        with self._lock:
            held = digest in self._sizes
            if not held:
                self._misses += 1
                return None
        path = self._path(digest)
        try:
            data = path.read_bytes()
        except OSError:
            data = None
        if data is None or hashlib.sha256(data).hexdigest() != digest:
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
        with contextlib.suppress(OSError):
            os.utime(path)  # the order of use, for the next start
        return data

    def keep(self, digest: str, data: bytes) -> None:
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
            tmp.write_bytes(data)
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
