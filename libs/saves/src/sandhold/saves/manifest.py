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
from sandhold.saves.errors import CorruptManifest

EntryKind = Literal["file", "dir", "symlink"]

FORMAT = 1


class Entry(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One name in the workspace.

    `path` is relative to the workspace root, `/`-separated, as the file system
    spells it (bytes); the root itself is `b""`. `chunks` are the sha256 hex
    digests of the file's consecutive `chunk_size` pieces (only the last may be
    shorter). `ctime_ns`, `uid` and `gid` were added after the first draft:
    they have defaults, like every later field must.
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


class Manifest(msgspec.Struct, frozen=True, kw_only=True):
    """A save: every entry of the workspace at the moment it was captured."""

    save_id: str
    sandbox_id: str
    parent_id: str | None
    created_at: float
    chunk_size: int
    entries: list[Entry]
    root: Entry | None = None  # the workspace directory itself (mode, times, owner)
    format: int = FORMAT

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


def chunk_lengths(entry: Entry, chunk_size: int) -> list[int]:
    """The length each of a file's chunks must have."""
    count = len(entry.chunks)
    if count == 0:
        return []
    return [chunk_size] * (count - 1) + [entry.size - chunk_size * (count - 1)]


def expected_chunk_count(size: int, chunk_size: int) -> int:
    return -(-size // chunk_size)


def entry_problems(manifest: Manifest) -> list[str]:
    """What makes a manifest impossible to restore safely; empty when it is sound.

    Paths must be relative, without `.`/`..`/empty components, unique, and
    inside a directory the manifest names — so no entry can land outside the
    destination or beneath a symlink. File sizes must match their chunk counts.
    """
    problems: list[str] = []
    if manifest.chunk_size <= 0:
        return [f"chunk_size {manifest.chunk_size} is not positive"]
    dirs: set[bytes] = {b""}
    seen: set[bytes] = set()
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
