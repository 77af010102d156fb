"""The local spool's file work: clearing it, copying a file into it."""

from __future__ import annotations

import errno
import os
from pathlib import Path


def clear_spool(spool: Path, keep: set[str]) -> int:
    """Remove every spool file except the chunks in `keep`; returns how many were removed.

    Call it once the chunks of a save are stored (keep nothing) or to drop a
    failed save's leftovers (keep what a retry will upload).
    """
    removed = 0
    try:
        names = os.listdir(spool)
    except FileNotFoundError:
        return 0
    for name in names:
        if name in keep:
            continue
        try:
            os.unlink(os.path.join(spool, name))
            removed += 1
        except FileNotFoundError:
            pass
    return removed


def copy_all(src: int, dst: int) -> int:
    """Copy src to dst from their current offsets; copy_file_range, else read/write."""
    total = 0
    try:
        while n := os.copy_file_range(src, dst, 1 << 30):
            total += n
        return total
    except OSError as err:
        if err.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
            raise
    while piece := os.read(src, 1 << 20):
        view = memoryview(piece)
        while view:
            view = view[os.write(dst, view) :]
        total += len(piece)
    return total
