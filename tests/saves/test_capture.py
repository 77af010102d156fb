"""Capturing a workspace: what is read, what is reused, what is never saved. No server."""

from __future__ import annotations

import hashlib
import os
import socket
import time
from pathlib import Path

import pytest
from sandhold.saves import CaptureError, capture, clear_spool
from sandhold.saves.capture import RACY_WINDOW_S

from tests.saves.conftest import write

CHUNK = 64 * 1024


def later() -> float:
    """A capture time well after the files were written (see the racy-window rule)."""
    return time.time() + RACY_WINDOW_S + 1


def test_excluded_top_level_names_are_never_saved(workspace: Path, spool: Path) -> None:
    for name in ("tmp", "run", ".sandhold-credentials", "src"):
        (workspace / name).mkdir()
        write(workspace / name / "secret", b"x")
    (workspace / "src" / "tmp").mkdir()  # only top-level names are excluded
    result = capture(
        workspace, save_id="sv-1", sandbox_id="sb", previous=None, spool=spool, now=later()
    )
    paths = {e.path for e in result.manifest.entries}
    assert paths == {b"src", b"src/secret", b"src/tmp"}


def test_chunks_are_spooled_and_hashed(workspace: Path, spool: Path) -> None:
    data = os.urandom(CHUNK * 2 + 100)
    write(workspace / "f", data)
    write(workspace / "copy", data)
    write(workspace / "empty", b"")
    result = capture(
        workspace,
        save_id="sv-1",
        sandbox_id="sb",
        previous=None,
        spool=spool,
        now=later(),
        chunk_size=CHUNK,
    )
    by_path = {e.path: e for e in result.manifest.entries}
    pieces = [data[:CHUNK], data[CHUNK : 2 * CHUNK], data[2 * CHUNK :]]
    assert by_path[b"f"].chunks == [hashlib.sha256(p).hexdigest() for p in pieces]
    assert by_path[b"copy"].chunks == by_path[b"f"].chunks
    assert by_path[b"empty"].chunks == [] and by_path[b"empty"].size == 0
    assert set(result.new_chunks) == set(by_path[b"f"].chunks)
    for digest, path in result.new_chunks.items():
        assert hashlib.sha256(path.read_bytes()).hexdigest() == digest
    assert result.scanned_files == result.changed_files == 3
    assert result.changed_bytes == 2 * len(data)
    assert sorted(os.listdir(spool)) == sorted(result.new_chunks)  # no leftovers


def test_unchanged_files_are_not_read_again(workspace: Path, spool: Path) -> None:
    write(workspace / "a", os.urandom(1000))
    write(workspace / "b", os.urandom(1000))
    first = capture(
        workspace, save_id="sv-1", sandbox_id="sb", previous=None, spool=spool, now=later()
    )
    clear_spool(spool, keep=set())
    second = capture(
        workspace,
        save_id="sv-2",
        sandbox_id="sb",
        previous=first.manifest,
        spool=spool,
        now=later(),
    )
    assert second.changed_files == 0 and second.new_chunks == {} and os.listdir(spool) == []
    assert second.manifest.entries == first.manifest.entries
    assert second.manifest.parent_id == "sv-1"
    os.chmod(workspace / "a", 0o600)  # a mode change is a change too
    third = capture(
        workspace,
        save_id="sv-3",
        sandbox_id="sb",
        previous=second.manifest,
        spool=spool,
        now=later(),
    )
    assert third.changed_files == 1


def test_a_rewrite_that_keeps_size_and_mtime_is_seen(workspace: Path, spool: Path) -> None:
    path = workspace / "f"
    write(path, b"one")
    first = capture(
        workspace, save_id="sv-1", sandbox_id="sb", previous=None, spool=spool, now=later()
    )
    before = os.stat(path)
    with open(path, "r+b") as f:  # same inode, same size
        f.write(b"two")
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # as `cp -p` would
    second = capture(
        workspace,
        save_id="sv-2",
        sandbox_id="sb",
        previous=first.manifest,
        spool=spool,
        now=later(),
    )
    assert second.changed_files == 1
    assert second.manifest.entries[0].chunks == [hashlib.sha256(b"two").hexdigest()]


def test_files_changed_near_the_previous_capture_are_read_again(
    workspace: Path, spool: Path
) -> None:
    write(workspace / "f", b"fresh")
    # Captured right after the write: a later write in the same timestamp tick
    # could leave the stat unchanged, so the next capture must not trust it.
    first = capture(
        workspace, save_id="sv-1", sandbox_id="sb", previous=None, spool=spool, now=time.time()
    )
    second = capture(
        workspace,
        save_id="sv-2",
        sandbox_id="sb",
        previous=first.manifest,
        spool=spool,
        now=later(),
    )
    assert second.changed_files == 1


def test_special_files_are_skipped_and_symlinks_not_followed(
    workspace: Path, spool: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    write(outside / "big", b"x" * 1000)
    os.symlink(outside, workspace / "link-to-dir")
    os.symlink("missing", workspace / "dangling")
    os.mkfifo(workspace / "fifo")
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(workspace / "sock"))
        result = capture(
            workspace, save_id="sv-1", sandbox_id="sb", previous=None, spool=spool, now=later()
        )
    kinds = {e.path: (e.kind, e.target) for e in result.manifest.entries}
    assert kinds == {
        b"dangling": ("symlink", b"missing"),
        b"link-to-dir": ("symlink", os.fsencode(outside)),
    }
    assert result.scanned_files == 0


def test_spool_inside_the_workspace_is_refused(workspace: Path) -> None:
    with pytest.raises(CaptureError, match="inside the workspace"):
        capture(
            workspace,
            save_id="sv-1",
            sandbox_id="sb",
            previous=None,
            spool=workspace / "spool",
            now=later(),
        )


def test_clear_spool_keeps_what_it_is_told(spool: Path) -> None:
    for name in ("a" * 64, "b" * 64, "c" * 64 + ".part"):
        write(spool / name, b"x")
    assert clear_spool(spool, keep={"a" * 64}) == 2
    assert os.listdir(spool) == ["a" * 64]
