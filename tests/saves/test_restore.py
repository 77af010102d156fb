"""Capture, upload, restore: the restored tree equals the original, or nothing is restored."""

from __future__ import annotations

import hashlib
import os
import stat
import time
from pathlib import Path

import nats
import pytest
from sandhold.bus.names import Names
from sandhold.saves import (
    Capture,
    CorruptChunk,
    CorruptManifest,
    Entry,
    Manifest,
    MissingChunk,
    RestoreError,
    SaveStore,
    capture,
    decode_manifest,
    restore,
)
from sandhold.saves.capture import RACY_WINDOW_S

from tests.saves.conftest import tree, write

MiB = 1024 * 1024


def build_workspace(root: Path) -> None:
    """Everything a workspace can hold that a save must keep."""
    (root / "src" / "pkg" / "deep").mkdir(parents=True)
    write(root / "src" / "pkg" / "mod.py", b"print('hi')\n")
    write(root / "src" / "pkg" / "deep" / "data.bin", os.urandom(300_000))
    write(root / "run.sh", b"#!/bin/sh\necho run\n", mode=0o755)
    write(root / "secret", b"only me", mode=0o600)
    write(root / "empty", b"")
    write(root / "same-a", b"duplicate content " * 1000)
    write(root / "same-b", b"duplicate content " * 1000)
    big = bytearray(20 * MiB)  # mostly zeros with some random blocks
    for offset in (0, 3 * MiB + 12345, 19 * MiB):
        big[offset : offset + 100_000] = os.urandom(100_000)
    write(root / "big.img", bytes(big))
    (root / "empty-dir" / "nested-empty").mkdir(parents=True)
    os.mkdir(os.fsencode(root) + b"/caf\xe9-\xff")  # not UTF-8
    write(os.fsencode(root) + b"/caf\xe9-\xff/r\xe9sum\xe9.txt", b"latin-1 name")
    os.symlink("src/pkg/mod.py", root / "link-rel")
    os.symlink("../nowhere", root / "src" / "dangling")
    os.symlink(os.fsencode(root) + b"/caf\xe9-\xff", os.fsencode(root) + b"/link-\xfe")
    os.chmod(root / "src" / "pkg", 0o750)
    os.chmod(root / "empty-dir", 0o555)  # read-only: restored after its contents
    os.utime(root / "src" / "pkg" / "mod.py", ns=(1_500_000_000_000_000_000,) * 2)
    os.utime(root / "link-rel", ns=(1_400_000_000_000_000_000,) * 2, follow_symlinks=False)


async def save(store: SaveStore, workspace: Path, spool: Path, save_id: str) -> Capture:
    result = capture(
        workspace,
        save_id=save_id,
        sandbox_id="sb-1",
        previous=None,
        spool=spool,
        now=time.time() + RACY_WINDOW_S,
    )
    await store.upload(result.new_chunks)
    await store.put_manifest(result.manifest)
    return result


async def test_restore_reproduces_the_tree(
    store: SaveStore, workspace: Path, spool: Path, tmp_path: Path
) -> None:
    build_workspace(workspace)
    os.chmod(workspace, 0o711)
    saved = await save(store, workspace, spool, "sv-0000000000000001")
    assert await store.verify(saved.manifest, recheck=saved.new_chunks) == []

    manifest = await store.get_manifest("sv-0000000000000001")
    dest = tmp_path / "restored"
    seen: list[tuple[int, int]] = []
    stats = await restore(
        store, manifest, dest, progress=lambda done, total: seen.append((done, total))
    )
    assert tree(dest) == tree(workspace)
    assert stats.restored_bytes == manifest.total_bytes
    assert seen[-1] == (manifest.total_bytes, manifest.total_bytes)
    assert stats.fetched_chunks == len(manifest.digests)  # a zero chunk is fetched once
    assert [p for p in os.listdir(tmp_path) if p.startswith(".restored")] == []


async def test_restore_into_an_empty_directory_but_not_a_full_one(
    store: SaveStore, workspace: Path, spool: Path, tmp_path: Path
) -> None:
    write(workspace / "f", b"content")
    saved = await save(store, workspace, spool, "sv-2")
    empty = tmp_path / "empty"
    empty.mkdir()
    await restore(store, saved.manifest, empty)
    assert (empty / "f").read_bytes() == b"content"
    with pytest.raises(RestoreError, match="not an empty directory"):
        await restore(store, saved.manifest, empty)


@pytest.mark.parametrize("damage", ["missing", "corrupt", "short"])
async def test_a_bad_chunk_aborts_and_leaves_nothing(
    store: SaveStore,
    nc: nats.NATS,
    names: Names,
    workspace: Path,
    spool: Path,
    tmp_path: Path,
    damage: str,
) -> None:
    build_workspace(workspace)
    saved = await save(store, workspace, spool, "sv-3")
    victim = hashlib.sha256((workspace / "secret").read_bytes()).hexdigest()
    if damage == "missing":
        await store.delete_chunks([victim])
    elif damage == "corrupt":
        await nc.jetstream().publish(names.chunk(victim), b"only mE")  # same size, wrong bytes
    else:  # stopped by the length check on the way in, then fetched alone, named
        await nc.jetstream().publish(names.chunk(victim), b"only")
    dest = tmp_path / "restored"
    expected = MissingChunk if damage == "missing" else CorruptChunk
    with pytest.raises(expected, match=victim):
        await restore(store, saved.manifest, dest)
    assert not dest.exists()
    assert sorted(os.listdir(tmp_path)) == ["spool", "workspace"]  # no staging left behind


async def test_a_manifest_escaping_the_destination_is_refused(
    store: SaveStore, tmp_path: Path
) -> None:
    evil = Manifest(
        save_id="sv-evil",
        sandbox_id="sb",
        parent_id=None,
        created_at=0.0,
        chunk_size=4,
        entries=[
            Entry(path=b"a", kind="symlink", mode=0o777, target=str(tmp_path).encode()),
            Entry(path=b"a/pwned", kind="file", mode=0o644),
        ],
    )
    with pytest.raises(CorruptManifest, match="parent is not a directory"):
        await restore(store, evil, tmp_path / "dest")
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "dest").exists()


async def test_a_restore_never_sets_setuid_or_setgid_bits(store: SaveStore, tmp_path: Path) -> None:
    planted = Manifest(
        save_id="sv-planted",
        sandbox_id="sb",
        parent_id=None,
        created_at=0.0,
        chunk_size=4,
        entries=[
            Entry(path=b"shared", kind="dir", mode=0o3775, uid=0, gid=0),  # setgid + sticky
            Entry(path=b"shared/su", kind="file", mode=0o6755, uid=0, gid=0),  # setuid root
        ],
    )
    dest = tmp_path / "dest"
    await restore(store, planted, dest)
    su = (dest / "shared" / "su").stat()
    assert stat.S_IMODE(su.st_mode) == 0o755  # the rest of the mode as recorded
    assert stat.S_IMODE((dest / "shared").stat().st_mode) == 0o1775  # sticky is no grant


async def test_an_old_format_manifest_restores_as_before(store: SaveStore, tmp_path: Path) -> None:
    golden = Path(__file__).parent / "golden" / "manifest-format1.bin"
    old = decode_manifest(golden.read_bytes())
    content = b"hello, old save\n"  # what src/hello.txt held, in chunks of 8
    for piece in (content[:8], content[8:]):
        await store.put_chunk(hashlib.sha256(piece).hexdigest(), piece)
    dest = tmp_path / "restored"
    stats = await restore(store, old, dest)

    assert (dest / "src" / "hello.txt").read_bytes() == content
    assert os.readlink(dest / "link") == "src/hello.txt"
    assert sorted(os.listdir(os.fsencode(dest))) == [b"caf\xe9", b"link", b"src"]
    hello = os.stat(dest / "src" / "hello.txt")
    assert (hello.st_uid, hello.st_gid, stat.S_IMODE(hello.st_mode)) == (1000, 1000, 0o644)
    assert hello.st_mtime_ns == 1_600_000_000_123_456_789 + 4
    cafe = os.stat(os.fsencode(dest) + b"/caf\xe9")
    assert (cafe.st_uid, cafe.st_gid, cafe.st_size) == (1001, 1002, 0)
    assert stat.S_IMODE(os.stat(dest).st_mode) == 0o711
    assert (stats.files, stats.dirs, stats.symlinks, stats.hardlinks) == (2, 1, 1, 0)
