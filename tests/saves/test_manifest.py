"""Manifest encoding and soundness: pure, no server."""

from __future__ import annotations

import zlib
from pathlib import Path

import msgspec
import pytest
from sandhold.saves import CorruptManifest, Entry, Manifest, decode_manifest, encode_manifest
from sandhold.saves.manifest import FORMAT, entry_problems

D1 = "1" * 64
D2 = "2" * 64
# A manifest encoded before hard links, whiteouts, FIFOs and xattrs existed.
GOLDEN_FORMAT1 = Path(__file__).parent / "golden" / "manifest-format1.bin"


def manifest(entries: list[Entry], *, chunk_size: int = 4) -> Manifest:
    return Manifest(
        save_id="sv-0000000000000001",
        sandbox_id="sb-1",
        parent_id=None,
        created_at=1700000000.25,
        chunk_size=chunk_size,
        entries=entries,
    )


def test_round_trip_keeps_non_utf8_names_and_targets() -> None:
    m = manifest(
        [
            Entry(path=b"caf\xe9", kind="dir", mode=0o755),
            Entry(path=b"caf\xe9/\xff.bin", kind="file", mode=0o600, size=5, chunks=[D1, D2]),
            Entry(path=b"link", kind="symlink", mode=0o777, target=b"caf\xe9/\xff.bin"),
        ]
    )
    back = decode_manifest(encode_manifest(m))
    assert back == m
    assert back.files == 1
    assert back.total_bytes == 5
    assert back.digests == {D1, D2}
    assert encode_manifest(back) == encode_manifest(m)  # deterministic: re-puts are identical


def test_old_readers_skip_new_fields() -> None:
    class FutureEntry(Entry, kw_only=True):
        acl: dict[str, bytes] = {}

    class FutureManifest(msgspec.Struct, kw_only=True):
        save_id: str
        sandbox_id: str
        parent_id: str | None
        created_at: float
        chunk_size: int
        entries: list[FutureEntry]
        encryption: str = "none"

    future = FutureManifest(
        save_id="sv-1",
        sandbox_id="sb",
        parent_id=None,
        created_at=1.0,
        chunk_size=4,
        entries=[FutureEntry(path=b"a", kind="file", mode=0o644, acl={"user::": b"rw"})],
        encryption="aes",
    )
    back = decode_manifest(zlib.compress(msgspec.msgpack.encode(future)))
    assert back.entries == [Entry(path=b"a", kind="file", mode=0o644)]


def test_garbage_is_a_corrupt_manifest() -> None:
    with pytest.raises(CorruptManifest):
        decode_manifest(b"not zlib")


@pytest.mark.parametrize(
    "entries, problem",
    [
        ([Entry(path=b"../etc", kind="dir", mode=0o755)], "not a clean relative path"),
        ([Entry(path=b"/etc", kind="dir", mode=0o755)], "not a clean relative path"),
        ([Entry(path=b"a//b", kind="dir", mode=0o755)], "not a clean relative path"),
        (
            [
                Entry(path=b"a", kind="symlink", mode=0o777, target=b"/etc"),
                Entry(path=b"a/passwd", kind="file", mode=0o644),
            ],
            "parent is not a directory",
        ),
        (
            [Entry(path=b"a", kind="dir", mode=0o755), Entry(path=b"a", kind="dir", mode=0o755)],
            "named twice",
        ),
        ([Entry(path=b"f", kind="file", mode=0o644, size=9, chunks=[D1])], "need 3 chunks"),
        # Content-defined cuts (format 3): chunk_size 4 is their average, 12 the longest.
        (
            [Entry(path=b"f", kind="file", mode=0o644, size=9, chunks=[D1, D2], lengths=[9])],
            "2 chunks with 1 lengths",
        ),
        (
            [Entry(path=b"f", kind="file", mode=0o644, size=9, chunks=[D1, D2], lengths=[4, 4])],
            "add up to 8, not 9",
        ),
        (
            [Entry(path=b"f", kind="file", mode=0o644, size=13, chunks=[D1], lengths=[13])],
            "outside 1..12",
        ),
        (
            [Entry(path=b"f", kind="file", mode=0o644, size=9, chunks=[D1, D2], lengths=[0, 9])],
            "outside 1..12",
        ),
        ([Entry(path=b"d", kind="dir", mode=0o755, lengths=[4])], "with content"),
    ],
)
def test_unsafe_or_impossible_trees_are_reported(entries: list[Entry], problem: str) -> None:
    problems = entry_problems(manifest(entries))
    assert any(problem in p for p in problems), problems


def test_a_sound_tree_has_no_problems() -> None:
    entries = [
        Entry(path=b"d", kind="dir", mode=0o755),
        Entry(path=b"d/f", kind="file", mode=0o644, size=8, chunks=[D1, D2]),
        Entry(path=b"d/empty", kind="file", mode=0o644),
        Entry(path=b"d/cut", kind="file", mode=0o644, size=13, chunks=[D1, D2], lengths=[11, 2]),
    ]
    assert entry_problems(manifest(entries)) == []


def test_a_manifest_of_a_newer_format_is_refused_not_guessed_at() -> None:
    entries = [Entry(path=b"f", kind="file", mode=0o644, size=8, chunks=[D1, D2])]
    newer = msgspec.structs.replace(manifest(entries), format=FORMAT + 1)
    assert entry_problems(newer) == [
        f"format {FORMAT + 1} is newer than this sandhold knows ({FORMAT})"
    ]


def test_an_old_manifest_decodes_and_encodes_to_the_same_bytes() -> None:
    stored = GOLDEN_FORMAT1.read_bytes()
    old = decode_manifest(stored)
    assert [(e.path, e.kind) for e in old.entries] == [
        (b"caf\xe9", "file"),
        (b"link", "symlink"),
        (b"src", "dir"),
        (b"src/hello.txt", "file"),
    ]
    assert all(e.link_to == b"" and e.xattrs == {} for e in old.entries)
    assert entry_problems(old) == []
    # New fields are omitted at their defaults: an old save re-encodes unchanged.
    assert encode_manifest(old) == stored


def test_new_kinds_and_xattrs_round_trip() -> None:
    m = manifest(
        [
            Entry(path=b"d", kind="dir", mode=0o755, xattrs={b"trusted.overlay.opaque": b"y"}),
            Entry(path=b"d/f", kind="file", mode=0o644, size=5, chunks=[D1, D2]),
            Entry(path=b"d/g", kind="hardlink", mode=0o644, link_to=b"d/f"),
            Entry(path=b"gone", kind="whiteout", mode=0, uid=0, gid=0),
            Entry(path=b"pipe", kind="fifo", mode=0o600, xattrs={b"user.\xff": b"\x00"}),
        ]
    )
    assert entry_problems(m) == []
    assert decode_manifest(encode_manifest(m)) == m
    assert m.files == 1 and m.total_bytes == 5


@pytest.mark.parametrize(
    "entries, problem",
    [
        (
            [Entry(path=b"gone", kind="whiteout", mode=0, size=3, chunks=[D1])],
            "a whiteout with content",
        ),
        ([Entry(path=b"p", kind="fifo", mode=0o600, size=1)], "a fifo with content"),
        ([Entry(path=b"../gone", kind="whiteout", mode=0)], "not a clean relative path"),
        ([Entry(path=b"w", kind="whiteout", mode=0, target=b"x")], "with a symlink target"),
        (
            [Entry(path=b"b", kind="hardlink", mode=0o644, link_to=b"a")],
            "not an earlier file entry",
        ),
        (  # a link must come after its file, so restore can create them in order
            [
                Entry(path=b"b", kind="hardlink", mode=0o644, link_to=b"a"),
                Entry(path=b"a", kind="file", mode=0o644),
            ],
            "not an earlier file entry",
        ),
        (
            [
                Entry(path=b"d", kind="dir", mode=0o755),
                Entry(path=b"b", kind="hardlink", mode=0o755, link_to=b"d"),
            ],
            "not an earlier file entry",
        ),
        (
            [
                Entry(path=b"a", kind="file", mode=0o644),
                Entry(path=b"b", kind="hardlink", mode=0o644, link_to=b"../../etc/passwd"),
            ],
            "not an earlier file entry",
        ),
        (
            [
                Entry(path=b"a", kind="file", mode=0o644),
                Entry(path=b"b", kind="hardlink", mode=0o644, link_to=b"a", chunks=[D1]),
            ],
            "a hardlink with content",
        ),
        (
            [
                Entry(path=b"a", kind="file", mode=0o644),
                Entry(
                    path=b"b", kind="hardlink", mode=0o644, link_to=b"a", xattrs={b"user.x": b""}
                ),
            ],
            "a hardlink with xattrs",
        ),
        (
            [
                Entry(path=b"a", kind="file", mode=0o644),
                Entry(path=b"b", kind="file", mode=0o644, link_to=b"a"),
            ],
            "a file with a hardlink's link_to",
        ),
        (
            [Entry(path=b"f", kind="file", mode=0o755, xattrs={b"security.capability": b"x"})],
            "xattr 'security.capability' is not one a save may carry",
        ),
        (
            [Entry(path=b"d", kind="dir", mode=0o755, xattrs={b"system.posix_acl_access": b""})],
            "xattr 'system.posix_acl_access' is not one",
        ),
        (
            [Entry(path=b"f", kind="file", mode=0o644, xattrs={b"trusted.other": b""})],
            "xattr 'trusted.other' is not one",
        ),
    ],
)
def test_malformed_overlay_entries_are_reported(entries: list[Entry], problem: str) -> None:
    problems = entry_problems(manifest(entries))
    assert any(problem in p for p in problems), problems


def test_the_root_entry_is_checked_too() -> None:
    bad_root = Entry(path=b"", kind="dir", mode=0o755, xattrs={b"security.selinux": b"x"})
    m = msgspec.structs.replace(manifest([]), root=bad_root)
    assert any("'security.selinux' is not one" in p for p in entry_problems(m))
    m = msgspec.structs.replace(manifest([]), root=Entry(path=b"", kind="whiteout", mode=0))
    assert "the root entry is not the directory itself" in entry_problems(m)
