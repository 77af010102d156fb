"""Materialising a save into a directory.

Everything is written into a hidden sibling of the destination and renamed
into place only when complete: a missing or corrupt chunk aborts the restore
and leaves no destination at all. Chunks are fetched once per digest (a file
of zeros costs one fetch), at most `concurrency` at a time, so memory stays
around `concurrency * chunk_size`; each is hash-checked before it is written.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import stat
from collections import defaultdict
from pathlib import Path

import msgspec
from sandhold.saves._bounded import for_each
from sandhold.saves.errors import CorruptChunk, CorruptManifest, RestoreError
from sandhold.saves.manifest import Entry, Manifest, chunk_lengths, entry_problems
from sandhold.saves.store import Progress, SaveStore

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class RestoreStats(msgspec.Struct, frozen=True, kw_only=True):
    files: int
    dirs: int
    symlinks: int
    restored_bytes: int  # sum of file sizes
    fetched_chunks: int  # distinct chunks fetched
    fetched_bytes: int


class _Target(msgspec.Struct, frozen=True):
    path: bytes
    offset: int
    length: int


async def restore(
    store: SaveStore,
    manifest: Manifest,
    dest: Path,
    *,
    concurrency: int = 32,
    progress: Progress | None = None,
) -> RestoreStats:
    """Write the save's tree to `dest`: directories, files, symlinks, modes, times.

    Owners are restored too when running as root and the manifest knows them.

    Args:
        store: where the chunks are.
        manifest: the save to restore.
        dest: must not exist, or be an empty directory.
        concurrency: chunks in flight.
        progress: called as `progress(done_bytes, total_bytes)` after each chunk written.

    Raises:
        RestoreError: `dest` exists and is not an empty directory.
        CorruptManifest: the manifest names paths outside `dest` or an impossible tree.
        MissingChunk, CorruptChunk: a chunk is not stored or not what it should be;
            nothing is left at `dest`.
    """
    dest = Path(os.path.abspath(dest))
    _check_dest(dest)
    problems = entry_problems(manifest)
    if problems:
        raise CorruptManifest(f"save {manifest.save_id} cannot be restored: {problems[0]}")
    staging = dest.parent / f".{dest.name}.restoring-{secrets.token_hex(4)}"
    os.mkdir(staging, 0o700)
    try:
        stats = await _restore_into(store, manifest, os.fsencode(staging), concurrency, progress)
        _check_dest(dest)  # still absent or empty: rename replaces an empty directory only
        os.rename(staging, dest)
    except BaseException:
        _remove_tree(staging)
        raise
    return stats


async def _restore_into(
    store: SaveStore,
    manifest: Manifest,
    root: bytes,
    concurrency: int,
    progress: Progress | None,
) -> RestoreStats:
    by_kind: dict[str, list[Entry]] = defaultdict(list)
    for entry in manifest.entries:
        by_kind[entry.kind].append(entry)
    dirs = sorted(by_kind["dir"], key=lambda e: e.path.count(b"/"))
    for entry in dirs:
        os.mkdir(_join(root, entry.path), 0o700)
    targets: dict[str, list[_Target]] = defaultdict(list)
    for entry in by_kind["file"]:
        fd = os.open(_join(root, entry.path), _CREATE, 0o600)
        os.close(fd)
        offset = 0
        for digest, length in zip(
            entry.chunks, chunk_lengths(entry, manifest.chunk_size), strict=True
        ):
            targets[digest].append(_Target(entry.path, offset, length))
            offset += length
    total = manifest.total_bytes
    done = fetched_bytes = 0

    async def fill(digest: str) -> None:
        nonlocal done, fetched_bytes
        data = await store.get_chunk(digest)
        wanted = targets[digest][0].length
        if len(data) != wanted:
            raise CorruptChunk(digest, f"{len(data)} bytes where the manifest needs {wanted}")
        fetched_bytes += len(data)
        # Writing is blocking file I/O: off the event loop, which keeps fetching.
        await asyncio.to_thread(_write_all, root, data, targets[digest])
        done += len(data) * len(targets[digest])
        if progress is not None:
            progress(done, total)

    await for_each(list(targets), fill, concurrency=concurrency)
    for entry in by_kind["symlink"]:
        os.symlink(entry.target, _join(root, entry.path))
    is_root = os.geteuid() == 0
    for entry in by_kind["file"] + by_kind["symlink"]:
        _set_attributes(_join(root, entry.path), entry, is_root)
    # Deepest directories last-written first: setting a child's times changes nothing
    # in its parent, and a read-only directory is made so only after its contents.
    for entry in reversed(dirs):
        _set_attributes(_join(root, entry.path), entry, is_root)
    if manifest.root is not None:
        _set_attributes(root, manifest.root, is_root)
    else:
        os.chmod(root, 0o755)
    return RestoreStats(
        files=len(by_kind["file"]),
        dirs=len(dirs),
        symlinks=len(by_kind["symlink"]),
        restored_bytes=total,
        fetched_chunks=len(targets),
        fetched_bytes=fetched_bytes,
    )


def _join(root: bytes, rel: bytes) -> bytes:
    return root + b"/" + rel if rel else root


def _write_all(root: bytes, data: bytes, targets: list[_Target]) -> None:
    for target in targets:
        fd = os.open(_join(root, target.path), os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            view = memoryview(data)
            offset = target.offset
            while view:
                written = os.pwrite(fd, view, offset)
                view = view[written:]
                offset += written
        finally:
            os.close(fd)


def _set_attributes(path: bytes, entry: Entry, is_root: bool) -> None:
    link = entry.kind == "symlink"
    if is_root and entry.uid >= 0 and entry.gid >= 0:
        os.chown(path, entry.uid, entry.gid, follow_symlinks=False)
    if not link:  # Linux has no mode for a symlink; chown first, as it clears setuid bits
        os.chmod(path, entry.mode)
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
