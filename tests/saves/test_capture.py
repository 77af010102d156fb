"""Capturing a workspace: what is read, what is reused, what is never saved. No server."""

from __future__ import annotations

import hashlib
import itertools
import os
import socket
import stat
import time
from pathlib import Path

import msgspec
import pytest
from sandhold.saves import CaptureError, capture, clear_spool, same_files
from sandhold.saves.capture import RACY_WINDOW_S
from sandhold.saves.manifest import FORMAT, chunk_lengths

from tests.saves.conftest import write

CHUNK = 64 * 1024
# cap_net_raw+ep as `setcap` writes it (VFS_CAP_REVISION_2).
FILE_CAPABILITY = bytes.fromhex("0100000200200000000000000000000000000000")


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
    lengths = chunk_lengths(by_path[b"f"], CHUNK)
    assert sum(lengths) == len(data) and all(CHUNK // 4 <= n <= 3 * CHUNK for n in lengths[:-1])
    ends = list(itertools.accumulate(lengths))
    pieces = [data[end - n : end] for n, end in zip(lengths, ends, strict=True)]
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


def test_sockets_and_devices_are_skipped_whiteouts_and_fifos_kept(
    workspace: Path, spool: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    write(outside / "big", b"x" * 1000)
    os.symlink(outside, workspace / "link-to-dir")
    os.symlink("missing", workspace / "dangling")
    os.mkfifo(workspace / "fifo")
    os.mknod(workspace / "whiteout", stat.S_IFCHR, os.makedev(0, 0))
    os.mknod(workspace / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    os.mknod(workspace / "loop", stat.S_IFBLK | 0o660, os.makedev(7, 0))
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(workspace / "sock"))
        result = capture(
            workspace, save_id="sv-1", sandbox_id="sb", previous=None, spool=spool, now=later()
        )
    kinds = {e.path: (e.kind, e.target) for e in result.manifest.entries}
    assert kinds == {
        b"dangling": ("symlink", b"missing"),
        b"fifo": ("fifo", b""),
        b"link-to-dir": ("symlink", os.fsencode(outside)),
        b"whiteout": ("whiteout", b""),
    }
    assert result.scanned_files == 0


def test_owners_are_recorded_inside_the_namespace(workspace: Path, spool: Path) -> None:
    offset = 1_000_000 + 2 * 65536
    for name, uid, gid in [
        ("root-owned", offset, offset),
        ("user", offset + 1000, offset + 1001),
        ("last", offset + 65535, offset + 65535),
        ("host", 4242, offset + 7),  # not an id of this namespace: unknown
        ("next-sandbox", offset + 65536, offset - 1),
    ]:
        write(workspace / name, b"x")
        os.chown(workspace / name, uid, gid)
    os.chown(workspace, offset, offset)

    def owners(id_offset: int) -> dict[bytes, tuple[int, int]]:
        result = capture(
            workspace,
            save_id="sv-1",
            sandbox_id="sb",
            previous=None,
            spool=spool,
            now=later(),
            id_offset=id_offset,
        )
        assert result.manifest.root is not None
        root = result.manifest.root
        return {e.path: (e.uid, e.gid) for e in result.manifest.entries} | {
            b"": (root.uid, root.gid)
        }

    assert owners(offset) == {
        b"": (0, 0),
        b"root-owned": (0, 0),
        b"user": (1000, 1001),
        b"last": (65535, 65535),
        b"host": (-1, 7),
        b"next-sandbox": (-1, -1),
    }
    assert owners(0) == {  # the default records host ids, as before
        b"": (offset, offset),
        b"root-owned": (offset, offset),
        b"user": (offset + 1000, offset + 1001),
        b"last": (offset + 65535, offset + 65535),
        b"host": (4242, offset + 7),
        b"next-sandbox": (offset + 65536, offset - 1),
    }


def test_only_overlay_and_user_xattrs_are_recorded(workspace: Path, spool: Path) -> None:
    write(workspace / "tool", b"#!/bin/sh\n", mode=0o755)
    os.setxattr(workspace / "tool", "user.note", b"mine")
    os.setxattr(workspace / "tool", "trusted.overlay.origin", b"\x00\xfb")
    os.setxattr(workspace / "tool", "trusted.other", b"host's")
    # A file capability (cap_net_raw+ep): it must not travel to another sandbox.
    os.setxattr(workspace / "tool", "security.capability", FILE_CAPABILITY)
    (workspace / "d").mkdir()
    os.setxattr(workspace / "d", "trusted.overlay.opaque", b"y")
    os.symlink("tool", workspace / "link")
    os.setxattr(workspace / "link", "trusted.overlay.redirect", b"/x", follow_symlinks=False)
    result = capture(
        workspace, save_id="sv-1", sandbox_id="sb", previous=None, spool=spool, now=later()
    )
    assert {e.path: e.xattrs for e in result.manifest.entries} == {
        b"d": {b"trusted.overlay.opaque": b"y"},
        b"link": {b"trusted.overlay.redirect": b"/x"},
        b"tool": {b"trusted.overlay.origin": b"\x00\xfb", b"user.note": b"mine"},
    }


def test_a_reused_file_gets_this_captures_owners_and_an_old_saves_missing_xattrs(
    workspace: Path, spool: Path
) -> None:
    offset = 1_000_000 + 65536
    write(workspace / "f", b"unchanged")
    os.chown(workspace / "f", offset + 1000, offset + 1000)
    os.setxattr(workspace / "f", "user.note", b"kept")
    first = capture(
        workspace, save_id="sv-1", sandbox_id="sb", previous=None, spool=spool, now=later()
    )
    assert first.manifest.format == FORMAT
    (f,) = first.manifest.entries
    # As a save from before xattrs (format 1) recorded the same file, host ids and all.
    old = msgspec.structs.replace(
        first.manifest, format=1, entries=[msgspec.structs.replace(f, xattrs={})]
    )
    second = capture(
        workspace,
        save_id="sv-2",
        sandbox_id="sb",
        previous=old,
        spool=spool,
        now=later(),
        id_offset=offset,
    )
    assert second.changed_files == 0  # content not read again
    (f,) = second.manifest.entries
    assert (f.uid, f.gid, f.xattrs) == (1000, 1000, {b"user.note": b"kept"})


def test_hard_links_are_saved_once_and_stay_incremental(workspace: Path, spool: Path) -> None:
    (workspace / "d").mkdir()
    write(workspace / "b", b"shared content")
    os.link(workspace / "b", workspace / "a")
    os.link(workspace / "b", workspace / "d" / "c")
    write(workspace / "alone", b"alone")
    os.link(workspace / "alone", workspace.parent / "outside-link")  # nlink 2, one name inside
    first = capture(
        workspace, save_id="sv-1", sandbox_id="sb", previous=None, spool=spool, now=later()
    )
    by_path = {e.path: e for e in first.manifest.entries}
    assert by_path[b"a"].kind == "file" and by_path[b"a"].size == len(b"shared content")
    assert (by_path[b"b"].kind, by_path[b"b"].link_to) == ("hardlink", b"a")
    assert (by_path[b"d/c"].kind, by_path[b"d/c"].link_to) == ("hardlink", b"a")
    assert by_path[b"b"].chunks == [] and by_path[b"b"].size == 0
    assert by_path[b"alone"].kind == "file"
    assert first.changed_files == 2 and first.manifest.files == 2
    clear_spool(spool, keep=set())

    second = capture(
        workspace,
        save_id="sv-2",
        sandbox_id="sb",
        previous=first.manifest,
        spool=spool,
        now=later(),
    )
    assert second.changed_files == 0 and second.new_chunks == {}
    assert second.manifest.entries == first.manifest.entries

    os.unlink(workspace / "a")  # "b" now holds the content; "d/c" links to it
    write(workspace / "d" / "c", b"changed through a link")
    third = capture(
        workspace,
        save_id="sv-3",
        sandbox_id="sb",
        previous=second.manifest,
        spool=spool,
        now=later(),
    )
    by_path = {e.path: e for e in third.manifest.entries}
    assert (by_path[b"b"].kind, by_path[b"d/c"].link_to) == ("file", b"b")
    assert by_path[b"b"].chunks == [hashlib.sha256(b"changed through a link").hexdigest()]
    assert third.changed_files == 1


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


def test_an_insertion_changes_only_the_chunks_around_it(workspace: Path, spool: Path) -> None:
    """Content-defined cuts: 100 bytes inserted in the middle of a 8 MiB file
    leave every chunk before and after the edit as it was (fixed-size pieces
    would all change from the insertion on)."""
    data = os.urandom(8 * 1024 * 1024)
    write(workspace / "big", data)
    before = capture(
        workspace, save_id="sv-1", sandbox_id="sb", previous=None, spool=spool, now=later()
    )
    middle = len(data) // 2
    write(workspace / "big", data[:middle] + os.urandom(100) + data[middle:])
    after = capture(
        workspace,
        save_id="sv-2",
        sandbox_id="sb",
        previous=before.manifest,
        spool=spool,
        now=later(),
    )
    [old] = before.manifest.entries
    [new] = after.manifest.entries
    assert new.size == len(data) + 100 and after.changed_files == 1
    changed = set(new.chunks) - set(old.chunks)
    assert 1 <= len(changed) <= 3, (len(changed), len(new.chunks))
    assert len(new.chunks) >= 16  # about 8 MiB / (256 KiB + 64 KiB): many chunks kept


def test_same_files_holds_only_when_a_save_would_store_nothing_new(
    workspace: Path, spool: Path
) -> None:
    """Decision 067: a scheduled save whose capture is `same_files` as its
    parent's stores nothing. Any change a save records makes it a save."""
    write(workspace / "a", os.urandom(1000))
    (workspace / "d").mkdir()
    write(workspace / "d" / "b", b"b")
    parent = capture(
        workspace, save_id="sv-1", sandbox_id="sb", previous=None, spool=spool, now=later()
    ).manifest
    clear_spool(spool, keep=set())

    def again(n: int) -> bool:
        """A capture now, as a host takes it (hashing deferred), is the parent's."""
        current = capture(
            workspace,
            save_id=f"sv-{n}",
            sandbox_id="sb",
            previous=parent,
            spool=spool.parent / f"spool-{n}",
            now=later(),
            defer_hashing=True,
        ).manifest
        return same_files(parent, current)

    assert again(2)
    changes = [
        lambda: os.utime(workspace / "a", ns=(0, 1)),  # only its times
        lambda: os.chmod(workspace / "d" / "b", 0o600),
        lambda: (workspace / "d" / "b").unlink(),
        lambda: (workspace / "e").mkdir(),
        lambda: write(workspace / "a", os.urandom(1000)),
        lambda: os.symlink("a", workspace / "l"),
    ]
    for n, change in enumerate(changes, start=3):
        change()
        assert not again(n), f"change {n - 3} went unseen"
        parent = capture(
            workspace, save_id="sv-p", sandbox_id="sb", previous=parent, spool=spool, now=later()
        ).manifest
        clear_spool(spool, keep=set())
        assert again(100 + n)
    for other in ({"layout": "root"}, {"format": FORMAT - 1}, {"chunk_size": CHUNK * 2}):
        assert not same_files(msgspec.structs.replace(parent, **other), parent)
