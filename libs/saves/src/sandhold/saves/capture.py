"""Capturing a workspace, or an overlay's upper directory, into a manifest and a spool.

Runs while the sandbox's processes are frozen, so it is synchronous (the
caller puts it in a thread) and does as little as it can: it stats every
name but reads only files whose stat differs from the previous manifest's
entry. Every chunk it reads is copied into the spool before it returns; after
the thaw the spool, not the live workspace, is what gets uploaded — that is
what makes the save crash-consistent.

Besides directories, files and symlinks it keeps what an overlayfs upper
layer holds: whiteouts, FIFOs, hard links, and the extended attributes that
mark opaque directories and redirects (see `xattr_is_carried`).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import msgspec
from sandhold.saves._spool import copy_all
from sandhold.saves._xattrs import read_xattrs
from sandhold.saves.chunking import DEFAULT_CHUNK_SIZE, Chunker, recorded_lengths
from sandhold.saves.errors import CaptureError
from sandhold.saves.manifest import (
    FORMAT,
    Entry,
    EntryKind,
    Layout,
    Manifest,
    recorded_id,
    same_files,
)

# Temporary mounts and delivered credentials are never saved (top-level names).
DEFAULT_EXCLUDE: frozenset[bytes] = frozenset({b"tmp", b"run", b".sandhold-credentials"})
# A file whose ctime is this close to (or after) the previous capture may have
# been written again within the same timestamp tick after it: read it again
# rather than trust an unchanged stat (git's "racy clean" problem).
RACY_WINDOW_S = 1.0

_SPOOL_TMP_SUFFIX = ".part"


class Capture(msgspec.Struct, frozen=True, kw_only=True):
    """A captured save: its manifest and the chunks read this time (in the spool)."""

    manifest: Manifest
    new_chunks: dict[str, Path]  # digest -> spool file, for every chunk read this time
    scanned_files: int  # regular files seen
    changed_files: int  # regular files read (their stat differed from the previous save)
    changed_bytes: int  # bytes read
    # With `defer_hashing`: (index in manifest.entries, whole-file copy in the spool)
    # for each changed file; `finish_capture` turns them into chunks after the thaw.
    pending: list[tuple[int, str]] = []


def capture(
    workspace: Path,
    *,
    save_id: str,
    sandbox_id: str,
    previous: Manifest | None,
    spool: Path,
    now: float,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    exclude: frozenset[bytes] = DEFAULT_EXCLUDE,
    defer_hashing: bool = False,
    id_offset: int = 0,
    layout: Layout = "workspace",
) -> Capture:
    """Walk `workspace` (never following symlinks) into a manifest.

    With `defer_hashing` a changed file is only copied whole into the spool (a
    kernel-side copy) and hashed later by `finish_capture`: the part that must
    happen while the sandbox is frozen shrinks to a stat walk plus a copy.

    Args:
        workspace: the directory to save.
        save_id: id of this save; `previous.save_id` becomes its parent.
        sandbox_id: the sandbox the workspace belongs to.
        previous: the last save whose chunks are all stored (the last completed
            one). Unchanged files reuse its chunk lists without being read.
        spool: a local directory outside the workspace; chunks read are
            written there as `<digest>` (skipped when already present).
        now: this host's wall-clock time of the capture (processes frozen).
        chunk_size: the average chunk length cuts aim at (see chunking.py); a
            previous save with another size lends no unchanged files.
        exclude: top-level names never saved.
        id_offset: the host id that the sandbox's user namespace maps its id 0
            to. Owners are recorded as `host id - id_offset`, so the save
            restores onto a namespace with another offset; an id outside the
            namespace's range is recorded as unknown (-1). 0 records host ids.
        layout: what `workspace` is (see `Manifest.layout`); a previous save of
            another layout names the parent but lends no unchanged files.

    Raises:
        CaptureError: a file or directory could not be read, or the spool is
            inside the workspace.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, not {chunk_size}")
    if id_offset < 0:
        raise ValueError(f"id_offset must not be negative, not {id_offset}")
    root = os.fsencode(os.path.abspath(workspace))
    spool_path = Path(os.path.abspath(spool))
    if (os.fsencode(spool_path) + b"/").startswith(root + b"/"):
        raise CaptureError(f"spool {spool_path} is inside the workspace {workspace}")
    spool_path.mkdir(parents=True, exist_ok=True)
    reusable = previous if previous is not None and previous.layout == layout else None
    walker = _Walker(root, spool_path, chunk_size, exclude, reusable)
    walker.defer = defer_hashing
    walker.id_offset = id_offset
    root_entry = walker.root_entry()
    walker.walk()
    manifest = Manifest(
        save_id=save_id,
        sandbox_id=sandbox_id,
        parent_id=previous.save_id if previous else None,
        created_at=now,
        chunk_size=chunk_size,
        entries=walker.entries,
        root=root_entry,
        layout=layout,
        format=FORMAT,
    )
    return Capture(
        manifest=manifest,
        new_chunks=walker.new_chunks,
        scanned_files=walker.scanned_files,
        changed_files=walker.changed_files,
        changed_bytes=walker.changed_bytes,
        pending=walker.pending,
    )


class _Differs(Exception):
    """A probe met a file that a capture would have to read (`holds`)."""


def holds(
    workspace: Path,
    previous: Manifest,
    *,
    exclude: frozenset[bytes] = DEFAULT_EXCLUDE,
    id_offset: int = 0,
    layout: Layout = "workspace",
) -> bool:
    """Whether a capture now would find every file as `previous` holds it
    (`same_files`: a scheduled save would end unchanged, decision 067), found
    with a stat walk alone: nothing is read or copied, and the walk stops at
    the first file whose stat differs from its entry or lies in the racy
    window. The same walker as `capture`'s makes the same entries, so the two
    cannot disagree about what "unchanged" is (decision 078).

    Raises:
        CaptureError: a directory could not be listed or a link read.
    """
    if previous.layout != layout:
        return False
    walker = _Walker(
        os.fsencode(os.path.abspath(workspace)),
        Path("/nonexistent"),  # never written: a file to read ends the probe
        previous.chunk_size,
        exclude,
        previous,
    )
    walker.probe = True
    walker.id_offset = id_offset
    try:
        root_entry = walker.root_entry()
        walker.walk()
    except _Differs:
        return False
    found = msgspec.structs.replace(
        previous, entries=walker.entries, root=root_entry, format=FORMAT
    )
    return same_files(previous, found)


def finish_capture(captured: Capture, spool: Path) -> Capture:
    """Chunk and hash the files a deferred capture copied; the copies are removed.

    Runs after the thaw: what it reads are the spool's copies, taken while the
    sandbox was frozen, so the save stays crash-consistent.
    """
    if not captured.pending:
        return captured
    spool_path = Path(os.path.abspath(spool))
    writer = _Walker(b"/", spool_path, captured.manifest.chunk_size, frozenset(), None)
    writer.new_chunks = dict(captured.new_chunks)
    entries = list(captured.manifest.entries)
    for index, copy in captured.pending:
        fd = os.open(copy, os.O_RDONLY | os.O_CLOEXEC)
        try:
            chunks, lengths = writer._chunk_fd(fd)
        finally:
            os.close(fd)
        entries[index] = with_chunks(entries[index], chunks, lengths, captured.manifest.chunk_size)
        os.unlink(copy)
    manifest = msgspec.structs.replace(captured.manifest, entries=entries)
    return msgspec.structs.replace(
        captured, manifest=manifest, new_chunks=writer.new_chunks, pending=[]
    )


def with_chunks(entry: Entry, chunks: list[str], lengths: list[int], chunk_size: int) -> Entry:
    """A deferred file's entry once its copy is cut."""
    recorded = recorded_lengths(lengths, entry.size, chunk_size)
    return msgspec.structs.replace(entry, chunks=chunks, lengths=recorded)


def _same_stat(old: Entry, st: os.stat_result, racy_before_ns: int) -> bool:
    return (
        old.kind == "file"
        and old.size == st.st_size
        and old.mtime_ns == st.st_mtime_ns
        and old.ctime_ns == st.st_ctime_ns
        and old.ino == st.st_ino
        and old.mode == stat.S_IMODE(st.st_mode)
        and old.ctime_ns < racy_before_ns
    )


class _Walker:
    def __init__(
        self,
        root: bytes,
        spool: Path,
        chunk_size: int,
        exclude: frozenset[bytes],
        previous: Manifest | None,
    ) -> None:
        self.root = root
        self.spool = spool
        self.spool_b = os.fsencode(spool)
        self.chunk_size = chunk_size
        self.exclude = exclude
        usable = previous is not None and previous.chunk_size == chunk_size
        self.previous = {e.path: e for e in previous.entries} if usable and previous else {}
        self.racy_before_ns = (
            int((previous.created_at - RACY_WINDOW_S) * 1e9) if usable and previous else 0
        )
        self.entries: list[Entry] = []
        self.new_chunks: dict[str, Path] = {}
        self.scanned_files = 0
        self.changed_files = 0
        self.changed_bytes = 0
        self._chunker = Chunker(chunk_size)
        self.defer = False
        self.probe = False  # `holds`: a file to read means a change; stop there
        self.pending: list[tuple[int, str]] = []
        self.id_offset = 0
        self.previous_has_xattrs = usable and previous is not None and previous.format >= 2
        # (st_dev, st_ino) -> path of the first file entry of a multiply linked inode
        self.linked: dict[tuple[int, int], bytes] = {}

    def root_entry(self) -> Entry:
        try:
            st = os.stat(self.root)
        except OSError as err:
            raise CaptureError(
                f"cannot read the workspace {os.fsdecode(self.root)}: {err}"
            ) from err
        if not stat.S_ISDIR(st.st_mode):
            raise CaptureError(f"workspace {os.fsdecode(self.root)} is not a directory")
        return self._entry(b"", "dir", st)

    def walk(self) -> None:
        # Depth first, names sorted: parents come before their children and
        # equal trees give equal manifests.
        stack: list[bytes] = [b""]
        while stack:
            rel_dir = stack.pop()
            children = self._scan(rel_dir)
            subdirs: list[bytes] = []
            for name, st in children:
                rel = rel_dir + b"/" + name if rel_dir else name
                mode = st.st_mode
                if stat.S_ISDIR(mode):
                    self.entries.append(self._entry(rel, "dir", st))
                    subdirs.append(rel)
                elif stat.S_ISREG(mode):
                    self._file(rel, st)
                elif stat.S_ISLNK(mode):
                    self._symlink(rel, st)
                elif stat.S_ISCHR(mode) and st.st_rdev == 0:
                    self.entries.append(self._entry(rel, "whiteout", st))
                elif stat.S_ISFIFO(mode):
                    self.entries.append(self._entry(rel, "fifo", st))
                # Sockets and every other device node are skipped: a socket is
                # live state of a process, and a device node is a door into
                # the host that a sandbox must never carry to another one.
            stack.extend(reversed(subdirs))

    def _abs(self, rel: bytes) -> bytes:
        return self.root + b"/" + rel if rel else self.root

    def _scan(self, rel_dir: bytes) -> list[tuple[bytes, os.stat_result]]:
        found: list[tuple[bytes, os.stat_result]] = []
        try:
            with os.scandir(self._abs(rel_dir)) as it:
                for dirent in it:
                    if not rel_dir and dirent.name in self.exclude:
                        continue
                    try:
                        found.append((dirent.name, dirent.stat(follow_symlinks=False)))
                    except FileNotFoundError:
                        continue  # gone since the listing
        except FileNotFoundError:
            return []
        except OSError as err:
            raise CaptureError(f"cannot list {os.fsdecode(self._abs(rel_dir))}: {err}") from err
        found.sort(key=lambda pair: pair[0])
        return found

    def _symlink(self, rel: bytes, st: os.stat_result) -> None:
        try:
            target = os.readlink(self._abs(rel))
        except FileNotFoundError:
            return
        except OSError as err:
            raise CaptureError(
                f"cannot read the link {os.fsdecode(self._abs(rel))}: {err}"
            ) from err
        self.entries.append(self._entry(rel, "symlink", st, target=target))

    def _file(self, rel: bytes, st: os.stat_result) -> None:
        self.scanned_files += 1
        first = self.linked.get((st.st_dev, st.st_ino)) if st.st_nlink > 1 else None
        if first is not None:
            # Another name of an inode already saved: the content is the first's.
            link = Entry(path=rel, kind="hardlink", mode=stat.S_IMODE(st.st_mode), link_to=first)
            self.entries.append(link)
            return
        old = self.previous.get(rel)
        if old is not None and _same_stat(old, st, self.racy_before_ns):
            self._remember_links(rel, st)
            self.entries.append(self._reused(old, rel, st))
            return
        if self.probe:
            raise _Differs(rel)
        if self.defer:
            copied = self._copy(rel)
            if copied is None:
                return
            copy, size, st = copied
            self.pending.append((len(self.entries), copy))
            self.changed_files += 1
            self.changed_bytes += size
            self._remember_links(rel, st)
            self.entries.append(self._entry(rel, "file", st, size=size))
            return
        read = self._read(rel)
        if read is None:
            return
        chunks, lengths, st = read
        size = sum(lengths)
        self.changed_files += 1
        self.changed_bytes += size
        self._remember_links(rel, st)
        entry = self._entry(rel, "file", st, size=size)
        self.entries.append(with_chunks(entry, chunks, lengths, self.chunk_size))

    def _reused(self, old: Entry, rel: bytes, st: os.stat_result) -> Entry:
        """An unchanged file's entry. Owners come from this stat (the previous save
        may have been taken with another offset); xattrs are read again when the
        previous save did not record them."""
        uid = recorded_id(st.st_uid, self.id_offset)
        gid = recorded_id(st.st_gid, self.id_offset)
        xattrs = old.xattrs if self.previous_has_xattrs else read_xattrs(self._abs(rel))
        if (uid, gid, xattrs) == (old.uid, old.gid, old.xattrs):
            return old
        return msgspec.structs.replace(old, uid=uid, gid=gid, xattrs=xattrs)

    def _remember_links(self, rel: bytes, st: os.stat_result) -> None:
        if st.st_nlink > 1:
            self.linked.setdefault((st.st_dev, st.st_ino), rel)

    def _entry(
        self,
        rel: bytes,
        kind: EntryKind,
        st: os.stat_result,
        *,
        size: int = 0,
        chunks: list[str] | None = None,
        target: bytes = b"",
    ) -> Entry:
        return Entry(
            path=rel,
            kind=kind,
            mode=stat.S_IMODE(st.st_mode),
            size=size,
            mtime_ns=st.st_mtime_ns,
            ino=st.st_ino,
            target=target,
            chunks=chunks or [],
            ctime_ns=st.st_ctime_ns,
            uid=recorded_id(st.st_uid, self.id_offset),
            gid=recorded_id(st.st_gid, self.id_offset),
            xattrs=read_xattrs(self._abs(rel)),
        )

    def _read(self, rel: bytes) -> tuple[list[str], list[int], os.stat_result] | None:
        path = self._abs(rel)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as err:
            if err.errno in (errno.ENOENT, errno.ELOOP):
                return None  # gone or replaced by a symlink since the listing
            raise CaptureError(f"cannot read {os.fsdecode(path)}: {err}") from err
        try:
            st = os.fstat(fd)
            chunks, lengths = self._chunk_fd(fd)
            return chunks, lengths, st
        except OSError as err:
            raise CaptureError(f"cannot read {os.fsdecode(path)}: {err}") from err
        finally:
            os.close(fd)

    def _chunk_fd(self, fd: int) -> tuple[list[str], list[int]]:
        """Cut what `fd` holds into the spool: each chunk's digest and length."""
        chunks: list[str] = []
        lengths: list[int] = []
        for digest, piece in self._chunker.cut(fd):
            chunks.append(digest)
            lengths.append(len(piece))
            if digest not in self.new_chunks:
                self.new_chunks[digest] = self._spool(digest, piece)
        return chunks, lengths

    def _copy(self, rel: bytes) -> tuple[str, int, os.stat_result] | None:
        """A whole-file copy into the spool, done by the kernel where it can."""
        path = self._abs(rel)
        try:
            src = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as err:
            if err.errno in (errno.ENOENT, errno.ELOOP):
                return None
            raise CaptureError(f"cannot read {os.fsdecode(path)}: {err}") from err
        copy = os.path.join(os.fsdecode(self.spool_b), f"copy-{len(self.pending)}")
        try:
            st = os.fstat(src)
            dst = os.open(copy, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                size = copy_all(src, dst)
            finally:
                os.close(dst)
            return copy, size, st
        except OSError as err:
            raise CaptureError(f"cannot copy {os.fsdecode(path)} to the spool: {err}") from err
        finally:
            os.close(src)

    def _spool(self, digest: str, piece: memoryview) -> Path:
        final = self.spool / digest
        final_b = self.spool_b + b"/" + digest.encode()
        if os.path.exists(final_b):
            return final
        # Written aside and renamed, so `<digest>` in the spool is always whole.
        part = final_b + _SPOOL_TMP_SUFFIX.encode()
        try:
            fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                view = piece
                while view:
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
            os.replace(part, final_b)
        except OSError as err:
            raise CaptureError(f"cannot write the spool {self.spool}: {err}") from err
        return final
