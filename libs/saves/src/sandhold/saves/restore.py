"""Materialising a save into a directory.

Everything is written into a hidden sibling of the destination and renamed
into place only when complete: a missing or corrupt chunk aborts the restore
and leaves no destination at all. Chunks are fetched once per digest (a file
of zeros costs one fetch), at most `concurrency` at a time, and handed to one
writer thread that hash-checks each before writing it; memory stays around
`2 * concurrency` average chunks.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import secrets
import shutil
import stat
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import msgspec
from sandhold.saves._bounded import for_each_sized
from sandhold.saves._xattrs import write_xattrs
from sandhold.saves.cache import HEADER, ChunkCache
from sandhold.saves.capture import RACY_WINDOW_S
from sandhold.saves.chunking import DEFAULT_CHUNK_SIZE, max_chunk
from sandhold.saves.errors import CorruptChunk, CorruptManifest, RestoreError
from sandhold.saves.manifest import (
    Entry,
    Manifest,
    chunk_lengths,
    entry_problems,
    host_id,
    recorded_id,
)
from sandhold.saves.store import Progress, SaveStore, check_chunk

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class RestoreStats(msgspec.Struct, frozen=True, kw_only=True):
    files: int
    dirs: int
    symlinks: int
    restored_bytes: int  # sum of file sizes
    fetched_chunks: int  # distinct chunks fetched from the store
    fetched_bytes: int
    # The save as it now sits on this host (new inodes and ctimes). Pass it as
    # `previous` to the first capture after the restore, so that capture reads
    # only what changed since, not the whole workspace again. Local: never store it.
    local_manifest: Manifest
    cache_hits: int = 0  # distinct chunks the host's cache had (not fetched)
    cached_bytes: int = 0
    hardlinks: int = 0  # names that share an earlier file's inode
    whiteouts: int = 0
    fifos: int = 0


class _Target(msgspec.Struct, frozen=True):
    path: bytes
    offset: int
    length: int


# The writer reports back at least this often (chunks), and whenever it is idle.
_REPORT_EVERY = 16
# Files the writer keeps open between chunks.
_OPEN_FILES = 64
# File timestamps come from a coarse clock (one tick is at most 10 ms on Linux).
_TIMESTAMP_TICK_NS = 25_000_000


async def restore(
    store: SaveStore,
    manifest: Manifest,
    dest: Path,
    *,
    concurrency: int = 32,
    progress: Progress | None = None,
    id_offset: int = 0,
    cache: ChunkCache | None = None,
) -> RestoreStats:
    """Write the save's tree to `dest`: directories, files, symlinks, modes, times.

    Also what an overlay upper layer holds: hard links (names sharing one
    inode again), whiteouts, FIFOs and the carried extended attributes.
    Owners are restored too when running as root and the manifest knows them.

    Args:
        store: where the chunks are.
        manifest: the save to restore.
        dest: must not exist, or be an empty directory.
        concurrency: chunks in flight (chunks under 64 KiB: eight times as many).
        progress: called as `progress(done_bytes, total_bytes)` after each chunk written.
        id_offset: the host id the target sandbox's user namespace maps its id 0
            to; owners become `recorded id + id_offset`. A recorded id outside
            the namespace's range is then left alone. 0 restores ids as recorded.
        cache: the host's chunk cache: what it holds is not fetched, and what
            is fetched is kept there (`ChunkCache`).

    Raises:
        RestoreError: `dest` exists and is not an empty directory, or the file
            system there refuses a whiteout, FIFO, hard link or xattr.
        CorruptManifest: the manifest names paths outside `dest` or an impossible tree.
        MissingChunk, CorruptChunk: a chunk is not stored or not what it should be;
            nothing is left at `dest`.
    """
    if id_offset < 0:
        raise ValueError(f"id_offset must not be negative, not {id_offset}")
    dest = Path(os.path.abspath(dest))
    _check_dest(dest)
    problems = entry_problems(manifest)
    if problems:
        raise CorruptManifest(f"save {manifest.save_id} cannot be restored: {problems[0]}")
    staging = dest.parent / f".{dest.name}.restoring-{secrets.token_hex(4)}"
    os.mkdir(staging, 0o700)
    root = os.fsencode(staging)
    # Whole-tree file system work runs in a thread: a caller's event loop keeps
    # renewing leases and answering while a big workspace is laid out.
    try:
        targets = await asyncio.to_thread(_create_tree, root, manifest)
        total = manifest.total_bytes
        filled = await _fill(store, root, targets, total, concurrency, progress, cache)
        await asyncio.to_thread(_finish_tree, root, manifest, id_offset)
        local = await asyncio.to_thread(_local_manifest, root, manifest, id_offset)
        _check_dest(dest)  # still absent or empty: rename replaces an empty directory only
        os.rename(staging, dest)
    except BaseException:
        _remove_tree(staging)
        raise
    if local.root is not None:
        root_entry = _as_restored(local.root, os.fsencode(dest), id_offset)
        local = msgspec.structs.replace(local, root=root_entry)
    await _after_last_timestamp(local)
    kinds = Counter(e.kind for e in manifest.entries)
    return RestoreStats(
        files=local.files,
        dirs=kinds["dir"],
        symlinks=kinds["symlink"],
        restored_bytes=manifest.total_bytes,
        fetched_chunks=len(targets) - filled.cache_hits,
        fetched_bytes=filled.fetched_bytes,
        cache_hits=filled.cache_hits,
        cached_bytes=filled.cached_bytes,
        local_manifest=local,
        hardlinks=kinds["hardlink"],
        whiteouts=kinds["whiteout"],
        fifos=kinds["fifo"],
    )


def _create_tree(root: bytes, manifest: Manifest) -> dict[str, list[_Target]]:
    """Directories, empty files (private modes for now), hard links, whiteouts and
    FIFOs; where each chunk goes."""
    dirs = [e for e in manifest.entries if e.kind == "dir"]
    for entry in sorted(dirs, key=lambda e: e.path.count(b"/")):
        os.mkdir(_join(root, entry.path), 0o700)
    targets: dict[str, list[_Target]] = defaultdict(list)
    for entry in manifest.entries:
        if entry.kind != "file":
            continue
        os.close(os.open(_join(root, entry.path), _CREATE, 0o600))
        offset = 0
        for digest, length in zip(
            entry.chunks, chunk_lengths(entry, manifest.chunk_size), strict=True
        ):
            targets[digest].append(_Target(entry.path, offset, length))
            offset += length
    for entry in manifest.entries:
        if entry.kind in ("hardlink", "whiteout", "fifo"):
            _make_node(root, entry)
    return targets


def _make_node(root: bytes, entry: Entry) -> None:
    """A hard link to its (already created) file, a whiteout or a FIFO."""
    path = _join(root, entry.path)
    try:
        if entry.kind == "hardlink":
            os.link(_join(root, entry.link_to), path, follow_symlinks=False)
        elif entry.kind == "whiteout":  # overlayfs's mark: a character device 0:0
            os.mknod(path, stat.S_IFCHR | entry.mode, os.makedev(0, 0))
        else:
            os.mkfifo(path, 0o600)
    except OSError as err:
        raise RestoreError(
            f"cannot create the {entry.kind} {os.fsdecode(path)} in the restore destination: {err}"
        ) from err


class _Filled(msgspec.Struct):
    fetched_bytes: int = 0
    cache_hits: int = 0
    cached_bytes: int = 0


async def _fill(
    store: SaveStore,
    root: bytes,
    targets: dict[str, list[_Target]],
    total: int,
    concurrency: int,
    progress: Progress | None,
    cache: ChunkCache | None,
) -> _Filled:
    """Write every distinct chunk wherever it goes: what the host's cache holds
    is copied from there by a few threads, while the rest is fetched alongside;
    a cached copy gone bad is fetched after."""
    budget = 2 * concurrency * DEFAULT_CHUNK_SIZE
    writer = _Writer(root, asyncio.get_running_loop(), budget, total, progress, cache)
    filled = _Filled()
    held, missing = cache.lookup(list(targets)) if cache is not None else ([], list(targets))
    stop = threading.Event()  # a failure elsewhere: the cache threads stop too

    async def from_cache() -> list[str]:
        if cache is None or not held:
            return []
        slices = _slices(held, _CACHE_THREADS)
        results = await asyncio.gather(
            *(
                asyncio.to_thread(_copy_from_cache, cache, root, targets, part, stop, writer)
                for part in slices
            )
        )
        for _, hits, hit_bytes in results:
            filled.cache_hits += hits
            filled.cached_bytes += hit_bytes
        return [digest for gone_bad, _, _ in results for digest in gone_bad]

    cached = asyncio.ensure_future(from_cache())
    fetched = asyncio.ensure_future(_fetch(store, targets, missing, concurrency, writer, filled))
    both: list[asyncio.Future[Any]] = [cached, fetched]
    try:
        await asyncio.wait(both, return_when=asyncio.FIRST_EXCEPTION)
        for task in both:
            if task.done():
                task.result()  # the first failure, raised here
        gone_bad = await cached
        await fetched
        await _fetch(store, targets, gone_bad, concurrency, writer, filled)
    except BaseException:
        stop.set()
        for task in both:
            task.cancel()
        await asyncio.gather(*both, return_exceptions=True)
        await writer.close(raise_error=False)  # the first failure is this one
        raise
    await writer.close()
    return filled


# Threads copying cached chunks into place: each reads, hashes and writes, and
# hashing is the cost (the GIL is released for all three); more than the
# machine's cores only adds switching.
_CACHE_THREADS = max(1, min(4, os.cpu_count() or 1))
# Each one's read buffer: a cache file of the largest chunk of the default size.
_CACHE_BUFFER = max_chunk(DEFAULT_CHUNK_SIZE) + HEADER + 1


def _slices(digests: list[str], parts: int) -> list[list[str]]:
    """Contiguous runs (a file's chunks are next to each other: a thread keeps
    writing the same few files)."""
    size = -(-len(digests) // parts)
    return [digests[i : i + size] for i in range(0, len(digests), size)]


def _copy_from_cache(
    cache: ChunkCache,
    root: bytes,
    targets: dict[str, list[_Target]],
    digests: list[str],
    stop: threading.Event,
    writer: _Writer,
) -> tuple[list[str], int, int]:
    """In a thread: each chunk read from the cache (hash-checked there) and
    written where it goes. Returns the chunks whose cached copy was gone or bad
    (to fetch), the hits and their bytes."""
    fds: dict[bytes, int] = {}
    gone_bad: list[str] = []
    hits = hit_bytes = written = 0
    # One buffer for every chunk this thread copies (a chunk larger than it gets
    # its own): no memory allocated and faulted in per chunk.
    buffer = bytearray(_CACHE_BUFFER)
    try:
        for digest in digests:
            if stop.is_set():
                break
            places = targets[digest]
            data = cache.read(digest, into=buffer)
            if data is None or len(data) != places[0].length:
                gone_bad.append(digest)  # the fetch reports a wrong length
                continue
            _write_all(root, data, places, fds)
            hits += 1
            hit_bytes += len(data)
            written += len(data) * len(places)
            if hits % _REPORT_EVERY == 0:
                writer.written_elsewhere(written)
                written = 0
    finally:
        for fd in fds.values():
            os.close(fd)
        writer.written_elsewhere(written)
    return gone_bad, hits, hit_bytes


async def _fetch(
    store: SaveStore,
    targets: dict[str, list[_Target]],
    digests: list[str],
    concurrency: int,
    writer: _Writer,
    filled: _Filled,
) -> None:
    """Fetch each chunk once and hand it to the writer thread, which hash-checks
    it, keeps it in the cache and writes it everywhere it goes. Fetching never
    waits for a write, only for room: at most `2 * concurrency` average chunks'
    worth of bytes are fetched and not yet written.

    Fetched on a connection of their own first (`get_chunks`, decision 101:
    a third of nats-py's CPU per chunk, which on two cores is the writer's);
    whatever that did not hand over is fetched one by one after."""
    sizes = [targets[d][0].length for d in digests]
    reserved: set[int] = set()  # room taken for these (given back if not handed over)

    async def room(index: int) -> None:
        await writer.wait_for_room(sizes[index])
        reserved.add(index)

    def take(index: int, data: bytes) -> None:
        if len(data) != sizes[index]:
            raise ValueError("a wrong length")  # (fetched again below, which says so)
        digest = digests[index]
        filled.fetched_bytes += len(data)
        writer.put(digest, data, targets[digest])

    left = await store.get_chunks(digests, take=take, before=room, in_flight=concurrency)
    for index in left:
        if index in reserved:
            writer.give_back(sizes[index])
    digests = [digests[index] for index in left]

    async def fill(digest: str) -> None:
        wanted = targets[digest][0].length
        await writer.wait_for_room(wanted)
        data = await store.get_chunk(digest, verify=False)
        if len(data) != wanted:
            raise CorruptChunk(digest, f"{len(data)} bytes where the manifest needs {wanted}")
        filled.fetched_bytes += len(data)
        writer.put(digest, data, targets[digest])

    if digests:
        await for_each_sized(
            [(d, targets[d][0].length) for d in digests], fill, concurrency=concurrency
        )


class _Writer:
    """One thread that checks and writes fetched chunks, in the order they came.

    One thread, not a pool: the file writes and the hashing release the GIL,
    and one thread hands back the GIL far less often than a pool would (with
    a thread hop per chunk, the event loop spent its time waiting for it).
    It reports back in batches: room freed, bytes done, or the first error,
    which stops the fetching.
    """

    def __init__(
        self,
        root: bytes,
        loop: asyncio.AbstractEventLoop,
        budget: int,
        total: int,
        progress: Progress | None,
        cache: ChunkCache | None = None,
    ) -> None:
        self._root = root
        self._cache = cache
        self._loop = loop
        self._budget = self._free = budget  # bytes fetched and not yet written
        self._freed = asyncio.Event()
        self._progress = progress
        self._total = total
        self._done = 0
        self._error: BaseException | None = None
        self._queue: queue.SimpleQueue[tuple[str, bytes, list[_Target]] | None] = (
            queue.SimpleQueue()
        )
        self._finished = loop.create_future()
        self._thread = threading.Thread(target=self._run, name="restore-writer", daemon=True)
        self._thread.start()

    async def wait_for_room(self, size: int) -> None:
        """Wait until `size` more bytes fit (a chunk larger than the whole
        budget waits until nothing else is outstanding)."""
        while self._error is None and self._free < min(size, self._budget):
            self._freed.clear()
            await self._freed.wait()
        if self._error is not None:
            raise self._error
        self._free -= size

    def give_back(self, size: int) -> None:
        """Room taken for a chunk that will not be put after all."""
        self._free += size
        self._freed.set()

    def put(self, digest: str, data: bytes, targets: list[_Target]) -> None:
        self._queue.put((digest, data, targets))

    def written_elsewhere(self, written: int) -> None:
        """From any thread: bytes another thread wrote (progress counts them)."""
        if written:
            self._loop.call_soon_threadsafe(self._report, 0, written, None)

    async def close(self, *, raise_error: bool = True) -> None:
        """Wait for every chunk handed over to be written; raise the first failure."""
        self._queue.put(None)
        await asyncio.shield(self._finished)
        if self._error is not None and raise_error:
            raise self._error

    def _run(self) -> None:
        fds: dict[bytes, int] = {}
        written = freed = count = 0
        failed: BaseException | None = None
        try:
            while (item := self._queue.get()) is not None:
                digest, data, places = item
                if failed is None:
                    try:
                        check_chunk(digest, data)
                        if self._cache is not None:
                            with contextlib.suppress(Exception):  # never fails a restore
                                self._cache.keep(digest, data)
                        _write_all(self._root, data, places, fds)
                        written += len(data) * len(places)
                    except BaseException as err:  # handed to the loop, raised there
                        failed = err
                freed += len(data)
                count += 1
                if self._queue.empty() or count >= _REPORT_EVERY:
                    self._loop.call_soon_threadsafe(self._report, freed, written, failed)
                    freed = written = count = 0
        finally:
            for fd in fds.values():
                os.close(fd)
            self._loop.call_soon_threadsafe(self._report, freed, written, failed, True)

    def _report(
        self, freed: int, written: int, failed: BaseException | None, last: bool = False
    ) -> None:
        if failed is not None and self._error is None:
            self._error = failed
        self._free += freed
        self._freed.set()
        self._done += written
        if self._progress is not None and written:
            self._progress(self._done, self._total)
        if last and not self._finished.done():
            self._finished.set_result(None)


def _finish_tree(root: bytes, manifest: Manifest, id_offset: int) -> None:
    """Symlinks, then xattrs, owners, modes and times, deepest directories first."""
    for entry in manifest.entries:
        if entry.kind == "symlink":
            os.symlink(entry.target, _join(root, entry.path))
    is_root = os.geteuid() == 0
    for entry in manifest.entries:
        # A hardlink's inode is its file's: it gets its attributes once, from there.
        if entry.kind not in ("dir", "hardlink"):
            _set_attributes(_join(root, entry.path), entry, is_root, id_offset)
    # Directories last (their contents no longer change, so their mtimes hold),
    # children before parents (a read-only parent is made so after its children).
    dirs = [e for e in manifest.entries if e.kind == "dir"]
    for entry in sorted(dirs, key=lambda e: e.path.count(b"/"), reverse=True):
        _set_attributes(_join(root, entry.path), entry, is_root, id_offset)
    if manifest.root is not None:
        _set_attributes(root, manifest.root, is_root, id_offset)
    else:
        os.chmod(root, 0o755)


def _local_manifest(root: bytes, manifest: Manifest, id_offset: int) -> Manifest:
    """The restored tree as a capture of it would record it (the next save walks
    against this): each name's inode, ctime, owner and mode as on disk (no
    setuid bit survives a restore). The root directory is stated once it has
    its final name (`_as_restored` after the rename: a rename moves its ctime),
    so that a capture right after the restore is `same_files` as this
    (decision 067)."""
    entries = []
    for entry in manifest.entries:
        if entry.kind == "hardlink":  # no stat of its own: its file's entry has it
            entries.append(entry)
            continue
        entries.append(_as_restored(entry, _join(root, entry.path), id_offset))
    newest = max((e.ctime_ns for e in entries), default=0)
    # `created_at` is what capture's racy-file rule compares ctimes with: set it
    # so that no restored file counts as racy. That is sound because nothing
    # writes to the tree before `restore` returns, and it returns only once the
    # timestamp clock has moved past every ctime recorded here.
    created_at = (newest + _TIMESTAMP_TICK_NS) / 1e9 + RACY_WINDOW_S
    return msgspec.structs.replace(manifest, entries=entries, created_at=created_at)


def _as_restored(entry: Entry, path: bytes, id_offset: int) -> Entry:
    st = os.lstat(path)
    return msgspec.structs.replace(
        entry,
        mode=entry.mode if entry.kind == "symlink" else stat.S_IMODE(st.st_mode),
        ino=st.st_ino,
        ctime_ns=st.st_ctime_ns,
        uid=recorded_id(st.st_uid, id_offset),
        gid=recorded_id(st.st_gid, id_offset),
    )


async def _after_last_timestamp(local: Manifest) -> None:
    root = [local.root] if local.root is not None else []
    newest = max((e.ctime_ns for e in [*local.entries, *root]), default=0)
    while time.time_ns() <= newest + _TIMESTAMP_TICK_NS:
        # Waiting for the clock itself (at most a tick or two), not for a state.
        await asyncio.sleep((newest + _TIMESTAMP_TICK_NS - time.time_ns()) / 1e9 + 0.001)


def _join(root: bytes, rel: bytes) -> bytes:
    return root + b"/" + rel if rel else root


def _write_all(
    root: bytes, data: bytes | memoryview, targets: list[_Target], fds: dict[bytes, int]
) -> None:
    """Write `data` at each target, keeping the files open (`fds`, bounded) for the
    next chunks of the same files."""
    for target in targets:
        fd = fds.get(target.path)
        if fd is None:
            if len(fds) >= _OPEN_FILES:
                os.close(fds.pop(next(iter(fds))))
            path = _join(root, target.path)
            fd = fds[target.path] = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        view = memoryview(data)
        offset = target.offset
        while view:
            written = os.pwrite(fd, view, offset)
            view = view[written:]
            offset += written


def _set_attributes(path: bytes, entry: Entry, is_root: bool, id_offset: int) -> None:
    link = entry.kind == "symlink"
    # Xattrs first: `user.*` needs write access, which a read-only mode would take away.
    write_xattrs(path, entry.xattrs)
    uid, gid = host_id(entry.uid, id_offset), host_id(entry.gid, id_offset)
    if is_root and (uid >= 0 or gid >= 0):  # -1 leaves that one alone
        os.chown(path, uid, gid, follow_symlinks=False)
    if not link:  # Linux has no mode for a symlink; chown first, as it clears setuid bits
        # Never setuid or setgid: a save is data a sandbox wrote (or anyone who
        # could write the save store), not a grant of anyone's identity.
        os.chmod(path, entry.mode & ~(stat.S_ISUID | stat.S_ISGID))
    os.utime(path, ns=(entry.mtime_ns, entry.mtime_ns), follow_symlinks=False)


def _check_dest(dest: Path) -> None:
    try:
        st = os.stat(dest, follow_symlinks=False)
    except FileNotFoundError:
        if not dest.parent.is_dir():
            raise RestoreError(
                f"restore destination's parent {dest.parent} is not a directory"
            ) from None
        return
    if not stat.S_ISDIR(st.st_mode) or os.listdir(dest):
        raise RestoreError(f"restore destination {dest} exists and is not an empty directory")


def _remove_tree(path: Path) -> None:
    """Remove a half-restored tree, read-only directories included, never following links."""
    if not os.path.lexists(path):
        return
    with contextlib.suppress(OSError):
        os.chmod(path, 0o700)
    for dirpath, dirnames, _ in os.walk(path):
        for name in dirnames:
            child = os.path.join(dirpath, name)
            if not os.path.islink(child):
                with contextlib.suppress(OSError):
                    os.chmod(child, 0o700)
    shutil.rmtree(path, ignore_errors=True)
