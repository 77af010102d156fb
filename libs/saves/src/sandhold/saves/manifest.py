"""What a save holds: one manifest per save, naming content-addressed chunks.

A manifest is immutable once stored. It is encoded as msgpack (bytes stay
bytes, so non-UTF-8 file names survive) and zlib-compressed. Evolution follows
the events' rules: new fields only with defaults, no field changes type, and
decoding ignores fields it does not know.
"""

from __future__ import annotations

import zlib
from typing import Literal

import msgspec
from sandhold.saves.chunking import fixed_lengths, max_chunk
from sandhold.saves.errors import CorruptManifest

# "hardlink": another name of an earlier "file" entry's inode (`link_to`).
# "whiteout": overlayfs's mark of a deleted lower name (a 0:0 character device).
EntryKind = Literal["file", "dir", "symlink", "hardlink", "whiteout", "fifo"]

# 2: entries record the carried xattrs (and may use the overlay kinds). The
# additions are new fields with defaults and new kinds, so a format 1 manifest
# decodes and restores as it always did; what the number tells is that an
# entry's empty `xattrs` means "none" rather than "not looked at" (capture
# reads them again for files it reuses from a format 1 save).
# 3: a file's chunks are cut by content and may carry their `lengths`. A reader
# that knows only format 2 would take them for fixed-size pieces: a manifest of
# a format newer than this code is refused, never guessed at.
FORMAT = 3

# A sandbox's user namespace maps ids 0..ID_RANGE-1 to `id_offset + 0 ..`.
ID_RANGE = 65536
# The sandbox's unprivileged user (and group) inside that namespace: commands
# run as it by default, and files seeded from outside (a task's checkout) are its.
SANDBOX_USER_ID = 1000


class Entry(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One name in the workspace.

    `path` is relative to the workspace root, `/`-separated, as the file system
    spells it (bytes); the root itself is `b""`. `chunks` are the sha256 hex
    digests of the file's consecutive pieces: `chunk_size` each (only the last
    may be shorter) unless `lengths` says otherwise. `ctime_ns`, `uid` and
    `gid` were added after the first draft, `link_to` and `xattrs` with the
    overlay kinds, `lengths` with format 3: they have defaults, like every later
    field must.

    `uid`/`gid` are the ids inside the sandbox's namespace when the capture
    was given an `id_offset`, the host's ids otherwise.
    """

    path: bytes
    kind: EntryKind
    mode: int  # st_mode & 0o7777
    size: int = 0
    mtime_ns: int = 0
    ino: int = 0
    target: bytes = b""  # symlinks only
    chunks: list[str] = []
    ctime_ns: int = 0  # catches rewrites that keep size and mtime (cp -p, rsync -t)
    uid: int = -1  # -1: unknown, restore leaves the owner alone
    gid: int = -1
    link_to: bytes = b""  # hardlinks only: the path of the "file" entry holding the inode
    # The extended attributes a save carries (see `xattr_is_carried`), name -> value.
    xattrs: dict[bytes, bytes] = {}
    # Format 3: each chunk's length, where they are not the fixed layout
    # (`chunk_size` each, the last the rest): content-defined cuts (chunking.py).
    lengths: list[int] = []


def same_files(parent: Manifest, current: Manifest) -> bool:
    """Whether a capture (`current`) found every file as `parent` holds it:
    everything a save records of each name (kind, mode, owner, size, times,
    inode, chunks, xattrs, link target), in the same layout and format. Then a
    save would store nothing new (decision 067). Conservative: a name only
    touched (its times moved) counts as a change."""
    return (
        parent.layout == current.layout
        and parent.format == current.format
        and parent.chunk_size == current.chunk_size
        and parent.root == current.root
        and parent.entries == current.entries
    )


# What a manifest's paths are relative to. "workspace": the workspace directory
# (the first saves, task seeds, the process driver). "root": a namespaced
# sandbox's whole persistent layer, one directory per overlay upper ("root"
# for its /, "usr" for /usr, ...), the workspace at WORKSPACE_IN_ROOT.
Layout = Literal["workspace", "root"]
WORKSPACE_IN_ROOT = b"root/workspace"


class Manifest(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A save: every entry of the workspace (or root, see `layout`) when captured."""

    save_id: str
    sandbox_id: str
    parent_id: str | None
    created_at: float
    chunk_size: int
    entries: list[Entry]
    root: Entry | None = None  # the workspace directory itself (mode, times, owner)
    # Fields at their default are left out of the encoding (so an old manifest
    # still re-encodes to its own bytes). A manifest without `format` is
    # therefore format 2, the first so encoded, whatever FORMAT becomes later:
    # this default must stay 2; capture writes FORMAT explicitly.
    format: int = 2
    layout: Layout = "workspace"

    def workspace_entries(self) -> list[Entry]:
        """The entries inside the workspace, with paths relative to it (artifacts)."""
        if self.layout == "workspace":
            return list(self.entries)
        prefix = WORKSPACE_IN_ROOT + b"/"
        return [
            msgspec.structs.replace(
                e, path=e.path[len(prefix) :], link_to=_strip(e.link_to, prefix)
            )
            for e in self.entries
            if e.path.startswith(prefix)
        ]

    @property
    def total_bytes(self) -> int:
        """Sum of the sizes of all files."""
        return sum(e.size for e in self.entries if e.kind == "file")

    @property
    def files(self) -> int:
        """Number of regular files (the `files` of a save record)."""
        return sum(1 for e in self.entries if e.kind == "file")

    @property
    def digests(self) -> set[str]:
        """Every chunk the save needs."""
        return {d for e in self.entries for d in e.chunks}


def _strip(path: bytes, prefix: bytes) -> bytes:
    return path[len(prefix) :] if path.startswith(prefix) else path


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Manifest)


def encode_manifest(manifest: Manifest) -> bytes:
    """msgpack, then zlib: deterministic for equal manifests."""
    return zlib.compress(_encoder.encode(manifest), 6)


def decode_manifest(data: bytes) -> Manifest:
    """Raises `CorruptManifest` when `data` is not an encoded manifest."""
    try:
        return _decoder.decode(zlib.decompress(data))
    except (zlib.error, msgspec.DecodeError) as err:
        raise CorruptManifest(f"not a decodable manifest: {err}") from err


def xattr_is_carried(name: bytes) -> bool:
    """Whether a save records and restores the extended attribute `name`.

    Overlayfs's own attributes (`trusted.overlay.*`, and `user.overlay.*` for
    an overlay mounted in a user namespace) are part of the upper layer: an
    opaque directory, a redirect, an origin. Ordinary `user.*` attributes are
    the sandbox's data. `security.*` never travels: it holds file capabilities
    and LSM labels, and a capability set inside one sandbox must not be granted
    to a binary in another one (nor can a label from one host be trusted on
    another). `system.*` (POSIX ACLs) holds raw host ids that no `id_offset`
    translates, and other `trusted.*` belong to the host, not the sandbox.
    """
    return name.startswith((b"trusted.overlay.", b"user."))


def recorded_id(host_id: int, id_offset: int) -> int:
    """The id a capture records for a host id: inside the namespace, or -1 if outside it."""
    if id_offset == 0:
        return host_id
    inside = host_id - id_offset
    return inside if 0 <= inside < ID_RANGE else -1


def host_id(recorded: int, id_offset: int) -> int:
    """The host id a restore gives a recorded id; -1 (leave it alone) when unknown.

    With an offset, a recorded id beyond the namespace's range (a save captured
    without an offset) is unknown too: adding the offset would hand the file to
    an id of the next sandbox's range.
    """
    if recorded < 0 or (id_offset > 0 and recorded >= ID_RANGE):
        return -1
    return recorded + id_offset


def chunk_lengths(entry: Entry, chunk_size: int) -> list[int]:
    """The length each of a file's chunks must have."""
    if entry.lengths:
        return list(entry.lengths)
    return fixed_lengths(len(entry.chunks), entry.size, chunk_size)


def expected_chunk_count(size: int, chunk_size: int) -> int:
    return -(-size // chunk_size)


def entry_problems(manifest: Manifest) -> list[str]:
    """What makes a manifest impossible to restore safely; empty when it is sound.

    Paths must be relative, without `.`/`..`/empty components, unique, and
    inside a directory the manifest names — so no entry can land outside the
    destination or beneath a symlink. File sizes must match their chunk counts.
    Only files have chunks; a hardlink names an earlier file entry; only
    carried xattrs appear, never on a hardlink (its inode's are the file's).
    """
    problems: list[str] = []
    if manifest.chunk_size <= 0:
        return [f"chunk_size {manifest.chunk_size} is not positive"]
    if manifest.format > FORMAT:
        return [f"format {manifest.format} is newer than this sandhold knows ({FORMAT})"]
    dirs: set[bytes] = {b""}
    seen: set[bytes] = set()
    if manifest.root is not None and (manifest.root.kind != "dir" or manifest.root.path):
        problems.append("the root entry is not the directory itself")
    problems.extend(_kind_problems([manifest.root] if manifest.root else []))
    problems.extend(_kind_problems(manifest.entries))
    for entry in sorted(manifest.entries, key=lambda e: e.path.count(b"/")):
        shown = entry.path.decode(errors="backslashreplace")
        parts = entry.path.split(b"/")
        if entry.path.startswith(b"/") or any(p in (b"", b".", b"..") for p in parts):
            problems.append(f"{shown!r}: not a clean relative path")
            continue
        if b"\0" in entry.path:
            problems.append(f"{shown!r}: contains a NUL byte")
            continue
        if entry.path in seen:
            problems.append(f"{shown!r}: named twice")
            continue
        seen.add(entry.path)
        parent = entry.path.rpartition(b"/")[0]
        if parent not in dirs:
            problems.append(f"{shown!r}: its parent is not a directory of the save")
        if entry.kind == "dir":
            dirs.add(entry.path)
        elif entry.kind == "file" and entry.lengths:
            problems.extend(_length_problems(shown, entry, manifest.chunk_size))
        elif entry.kind == "file":
            want = expected_chunk_count(entry.size, manifest.chunk_size)
            if len(entry.chunks) != want:
                problems.append(
                    f"{shown!r}: {entry.size} bytes need {want} chunks, the manifest names "
                    f"{len(entry.chunks)}"
                )
        elif entry.kind == "symlink" and not entry.target:
            problems.append(f"{shown!r}: a symlink without a target")
    return problems


def _length_problems(shown: str, entry: Entry, chunk_size: int) -> list[str]:
    """Content-defined lengths: one per chunk, adding up to the size, none empty
    or longer than a cut can be (a restore holds a chunk in memory)."""
    longest = max_chunk(chunk_size)
    if len(entry.lengths) != len(entry.chunks):
        return [f"{shown!r}: {len(entry.chunks)} chunks with {len(entry.lengths)} lengths"]
    if sum(entry.lengths) != entry.size:
        return [f"{shown!r}: chunk lengths add up to {sum(entry.lengths)}, not {entry.size}"]
    if any(not 0 < length <= longest for length in entry.lengths):
        return [f"{shown!r}: a chunk length outside 1..{longest}"]
    return []


def _kind_problems(entries: list[Entry]) -> list[str]:
    """What each entry's kind rules out, in manifest order (a link's file comes first)."""
    problems: list[str] = []
    files: set[bytes] = set()
    for entry in entries:
        shown = entry.path.decode(errors="backslashreplace")
        if entry.kind != "file" and (entry.chunks or entry.size or entry.lengths):
            problems.append(f"{shown!r}: a {entry.kind} with content (only files have chunks)")
        if entry.kind != "symlink" and entry.target:
            problems.append(f"{shown!r}: a {entry.kind} with a symlink target")
        if entry.kind == "hardlink":
            if entry.link_to not in files:
                to = entry.link_to.decode(errors="backslashreplace")
                problems.append(f"{shown!r}: a hardlink to {to!r}, not an earlier file entry")
            if entry.xattrs:
                problems.append(f"{shown!r}: a hardlink with xattrs (they are its file's)")
        elif entry.link_to:
            problems.append(f"{shown!r}: a {entry.kind} with a hardlink's link_to")
        for name in entry.xattrs:
            if not xattr_is_carried(name):
                attr = name.decode(errors="backslashreplace")
                problems.append(f"{shown!r}: xattr {attr!r} is not one a save may carry")
        if entry.kind == "file":
            files.add(entry.path)
    return problems
