"""Deferred hashing: only a stat walk and a copy happen while frozen."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from sandhold.saves import capture, finish_capture


def _fill(workspace: Path) -> None:
    (workspace / "d").mkdir()
    (workspace / "d" / "big").write_bytes(os.urandom(700 * 1024))
    (workspace / "small").write_bytes(b"hello\n")
    (workspace / "empty").write_bytes(b"")
    os.symlink("small", workspace / "link")
    # A directory's own names come before its subdirectories', so this one holds the content.
    os.link(workspace / "d" / "big", workspace / "e-big-again")
    os.setxattr(workspace / "small", "user.note", b"x")
    os.mkfifo(workspace / "fifo")
    os.mknod(workspace / "whiteout", stat.S_IFCHR, os.makedev(0, 0))


def test_deferred_capture_gives_the_same_save(tmp_path: Path) -> None:
    workspace = tmp_path / "ws"
    workspace.mkdir()
    _fill(workspace)
    direct = capture(
        workspace, save_id="a", sandbox_id="s", previous=None, spool=tmp_path / "spool-a", now=1.0
    )
    deferred = capture(
        workspace,
        save_id="a",
        sandbox_id="s",
        previous=None,
        spool=tmp_path / "spool-b",
        now=1.0,
        defer_hashing=True,
    )
    assert deferred.pending and all(not e.chunks for e in deferred.manifest.entries)
    kinds = {e.path: e.kind for e in deferred.manifest.entries}
    assert kinds[b"d/big"] == "hardlink" and kinds[b"whiteout"] == "whiteout"
    finished = finish_capture(deferred, tmp_path / "spool-b")
    assert finished.pending == []
    assert finished.manifest == direct.manifest
    assert set(finished.new_chunks) == set(direct.new_chunks)
    assert not [p for p in os.listdir(tmp_path / "spool-b") if p.startswith("copy-")]
    for digest, path in finished.new_chunks.items():
        assert path.read_bytes() == direct.new_chunks[digest].read_bytes()


def test_what_is_hashed_is_the_copy_taken_at_capture_time(tmp_path: Path) -> None:
    workspace = tmp_path / "ws"
    workspace.mkdir()
    (workspace / "f").write_bytes(b"at capture")
    deferred = capture(
        workspace,
        save_id="a",
        sandbox_id="s",
        previous=None,
        spool=tmp_path / "spool",
        now=1.0,
        defer_hashing=True,
    )
    (workspace / "f").write_bytes(b"written after the thaw")
    finished = finish_capture(deferred, tmp_path / "spool")
    [entry] = [e for e in finished.manifest.entries if e.path == b"f"]
    [digest] = entry.chunks
    assert finished.new_chunks[digest].read_bytes() == b"at capture"
