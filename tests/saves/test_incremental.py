"""Incremental saves: unchanged content is neither read nor sent twice."""

from __future__ import annotations

import os
import time
from pathlib import Path

from sandhold.saves import (
    DEFAULT_CHUNK_SIZE,
    SaveStore,
    capture,
    clear_spool,
    restore,
    same_files,
)
from sandhold.saves.capture import RACY_WINDOW_S

from tests.saves.conftest import tree, write

MiB = 1024 * 1024


def later() -> float:
    # The capture moment, after the racy window of the files' last writes.
    return time.time() + RACY_WINDOW_S + 1


async def test_second_save_sends_only_the_change(
    store: SaveStore, workspace: Path, spool: Path, tmp_path: Path
) -> None:
    for i in range(100):
        write(workspace / f"f{i:03d}", os.urandom(MiB))

    first = capture(
        workspace, save_id="sv-1", sandbox_id="sb", previous=None, spool=spool, now=later()
    )
    up = await store.upload(first.new_chunks)
    await store.put_manifest(first.manifest)
    assert first.changed_files == 100 and first.changed_bytes == 100 * MiB
    assert up.uploaded_bytes == 100 * MiB and up.skipped_chunks == 0
    clear_spool(spool, keep=set())

    second = capture(
        workspace,
        save_id="sv-2",
        sandbox_id="sb",
        previous=first.manifest,
        spool=spool,
        now=later(),
    )
    assert second.changed_files == 0 and second.changed_bytes == 0
    up = await store.upload(second.new_chunks)
    assert up.uploaded_bytes == 0 and up.uploaded_chunks == 0
    await store.put_manifest(second.manifest)
    assert await store.verify(second.manifest) == []

    write(workspace / "f042", os.urandom(MiB))
    third = capture(
        workspace,
        save_id="sv-3",
        sandbox_id="sb",
        previous=second.manifest,
        spool=spool,
        now=later(),
    )
    assert third.changed_files == 1 and third.changed_bytes == MiB
    up = await store.upload(third.new_chunks)
    assert MiB <= up.uploaded_bytes <= MiB + DEFAULT_CHUNK_SIZE
    await store.put_manifest(third.manifest)
    assert await store.verify(third.manifest, recheck=third.new_chunks) == []

    dest = tmp_path / "restored"
    restored = await restore(store, await store.get_manifest("sv-3"), dest)
    assert tree(dest) == tree(workspace)

    # The first save after a recovery reads nothing that was restored (new
    # inodes and ctimes are in the local manifest), yet sees an immediate write.
    write(dest / "f007", b"changed right after the restore")
    fourth = capture(
        dest,
        save_id="sv-4",
        sandbox_id="sb",
        previous=restored.local_manifest,
        spool=spool,
        now=time.time(),
    )
    assert (fourth.changed_files, fourth.scanned_files) == (1, 100)
    assert fourth.manifest.parent_id == "sv-3"


async def test_identical_content_is_uploaded_once(
    store: SaveStore, workspace: Path, spool: Path
) -> None:
    data = os.urandom(5 * DEFAULT_CHUNK_SIZE)
    write(workspace / "a", data)
    (workspace / "sub").mkdir()
    write(workspace / "sub" / "b", data)
    result = capture(
        workspace, save_id="sv-1", sandbox_id="sb", previous=None, spool=spool, now=later()
    )
    assert result.changed_bytes == 2 * len(data)
    up = await store.upload(result.new_chunks)
    [chunks] = {tuple(e.chunks) for e in result.manifest.entries if e.kind == "file"}
    assert len(chunks) >= 2 and len(set(chunks)) == len(chunks)
    assert (up.uploaded_chunks, up.uploaded_bytes) == (len(chunks), len(data))

    # Another sandbox with the same content stores nothing new either.
    other = tmp_path_other = spool.parent / "other"
    other.mkdir()
    write(other / "c", data)
    result = capture(
        other,
        save_id="sv-9",
        sandbox_id="sb-2",
        previous=None,
        spool=tmp_path_other.parent / "spool-2",
        now=later(),
    )
    up = await store.upload(result.new_chunks)
    assert up.uploaded_bytes == 0 and up.skipped_bytes == len(data)


async def test_a_capture_right_after_a_restore_is_the_same_files(
    store: SaveStore, workspace: Path, spool: Path, tmp_path: Path
) -> None:
    """The restore's local manifest is what a capture of the restored tree
    records — the root directory and modes included (a setuid bit does not
    survive a restore) — so the first scheduled save after a recovery can end
    unchanged (decision 067)."""
    write(workspace / "a", os.urandom(1000))
    (workspace / "d").mkdir()
    write(workspace / "d" / "tool", b"#!/bin/sh\n")
    os.chmod(workspace / "d" / "tool", 0o4755)
    os.chmod(workspace, 0o750)
    saved = capture(
        workspace, save_id="sv-1", sandbox_id="sb", previous=None, spool=spool, now=later()
    )
    await store.upload(saved.new_chunks)
    await store.put_manifest(saved.manifest)
    clear_spool(spool, keep=set())

    dest = tmp_path / "restored"
    restored = await restore(store, await store.get_manifest("sv-1"), dest)
    again = capture(
        dest,
        save_id="sv-2",
        sandbox_id="sb",
        previous=restored.local_manifest,
        spool=spool,
        now=later(),
        defer_hashing=True,
    )
    assert again.changed_files == 0
    assert same_files(restored.local_manifest, again.manifest)
