"""Fixtures for the save store: a `SaveStore` on the test's own SAVES stream."""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import pytest
from sandhold.bus.names import Names
from sandhold.saves import SaveStore
from sandhold.saves.manifest import xattr_is_carried


@pytest.fixture
async def store(nc: nats.NATS, names: Names) -> AsyncIterator[SaveStore]:
    js = nc.jetstream()
    yield SaveStore(nc, names)
    # The shared fixture leaves the SAVES stream behind; these tests put
    # hundreds of MiB in it, so drop it here.
    with contextlib.suppress(Exception):
        await js.delete_stream(names.saves_stream)


@pytest.fixture
def spool(tmp_path: Path) -> Path:
    path = tmp_path / "spool"
    path.mkdir()
    return path


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    path = tmp_path / "workspace"
    path.mkdir()
    return path


def tree(root: Path) -> dict[bytes, tuple[object, ...]]:
    """Everything a restore must reproduce, by relative path (bytes), root included.

    Besides kind, mode, content and mtime: the carried xattrs, and for a name
    sharing its inode with others in the tree the first of those names (so a
    hard link broken into copies, or linked where it was not, shows).
    """
    root_b = os.fsencode(root)
    st = os.lstat(root_b)
    found: dict[bytes, tuple[object, ...]] = {
        b"": ("dir", stat.S_IMODE(st.st_mode), st.st_mtime_ns, carried_xattrs(root_b))
    }
    inodes: dict[int, list[bytes]] = {}
    for dirpath, dirnames, filenames in os.walk(root_b):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root_b)
            st = os.lstat(path)
            mode = stat.S_IMODE(st.st_mode)
            xattrs = carried_xattrs(path)
            if stat.S_ISLNK(st.st_mode):
                found[rel] = ("symlink", os.readlink(path), st.st_mtime_ns, xattrs)
            elif stat.S_ISDIR(st.st_mode):
                found[rel] = ("dir", mode, st.st_mtime_ns, xattrs)
            elif stat.S_ISREG(st.st_mode):
                with open(path, "rb") as f:
                    digest = hashlib.file_digest(f, "sha256").hexdigest()
                found[rel] = ("file", mode, st.st_size, digest, st.st_mtime_ns, xattrs)
                inodes.setdefault(st.st_ino, []).append(rel)
            elif stat.S_ISCHR(st.st_mode):
                found[rel] = ("chr", mode, st.st_rdev, st.st_mtime_ns, xattrs)
            elif stat.S_ISFIFO(st.st_mode):
                found[rel] = ("fifo", mode, st.st_mtime_ns, xattrs)
            else:
                found[rel] = ("other", mode)
    for names in inodes.values():
        if len(names) > 1:
            for rel in names:
                found[rel] += ("linked with", min(names))
    return found


def carried_xattrs(path: bytes) -> list[tuple[bytes, bytes]]:
    """The xattrs of `path` a save carries, sorted."""
    names = sorted(os.fsencode(n) for n in os.listxattr(path, follow_symlinks=False))
    return [(n, os.getxattr(path, n, follow_symlinks=False)) for n in names if xattr_is_carried(n)]


def write(path: Path | bytes, data: bytes, mode: int = 0o644) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.chmod(path, mode)
