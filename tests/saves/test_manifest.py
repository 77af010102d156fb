"""Manifest encoding and soundness: pure, no server."""

from __future__ import annotations

import msgspec
import pytest
from sandhold.saves import CorruptManifest, Entry, Manifest, decode_manifest, encode_manifest
from sandhold.saves.manifest import entry_problems

D1 = "1" * 64
D2 = "2" * 64


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
        xattrs: dict[str, bytes] = {}

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
        entries=[FutureEntry(path=b"a", kind="file", mode=0o644, xattrs={"user.x": b"1"})],
        encryption="aes",
    )
    import zlib

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
    ]
    assert entry_problems(manifest(entries)) == []
