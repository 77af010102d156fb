"""A disk quota for a sandbox's persistent layer: a file system of its own.

The host's file system is rarely mounted with project quotas (and cannot be
remounted from here), so a sandbox that asks for a disk limit gets its
``fs`` directory (upper layers and overlayfs's work dirs, which must share a
file system) on an ext4 image of exactly that size, loop-mounted by the
host's root. The image is sparse: it costs the host what the sandbox wrote.
A write past the limit fails with ENOSPC inside, ``df /`` inside shows the
limit, and a command that fails on a full disk ends ``resource_exhausted``
(``exhausted``). Saves read the upper layer through the mount as before.

Needs ``mkfs.ext4`` (e2fsprogs) and loop devices; without them the host
reports ``disk_quota: false`` and is never chosen for such a sandbox.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from pathlib import Path

IMAGE = "disk.img"
MIN_BYTES = 64 << 20
# ext4 keeps a few clusters back for its own metadata (at most 2% of the file
# system, or 16 MiB) and reports what is left after a refused write as a
# little free space: "full" is measured with that margin.
_FULL_MARGIN_MAX = 16 << 20
_MOUNT_OPTIONS = "loop,nodev,nosuid,noatime"
_lock = threading.Lock()


class DiskUnavailable(RuntimeError):
    """The host cannot give this sandbox a disk of its own; the message says why."""


def problem() -> str | None:
    """Why this host cannot enforce disk quotas, or None when it can."""
    if shutil.which("mkfs.ext4") is None:
        return "no disk quota: mkfs.ext4 is not installed (Debian/Ubuntu: apt install e2fsprogs)"
    if not Path("/dev/loop-control").exists():
        return "no disk quota: no loop devices (/dev/loop-control is missing)"
    if os.geteuid() != 0:
        return "no disk quota: loop mounts need the host's root"
    return None


def attach(sandbox_dir: Path, fs_dir: Path, size_bytes: int) -> None:
    """Mount the sandbox's disk on ``fs_dir``, making the image first; safe to repeat."""
    image = sandbox_dir / IMAGE
    with _lock:
        if fs_dir.is_mount():
            return
        if not image.exists():
            if fs_dir.is_dir() and any(fs_dir.iterdir()):
                # Never hide files written without a quota under a new, empty disk.
                raise DiskUnavailable(f"{fs_dir} already holds files without a disk quota")
            _make_image(image, size_bytes)
        fs_dir.mkdir(parents=True, exist_ok=True)
        _run(["mount", "-t", "ext4", "-o", _MOUNT_OPTIONS, str(image), str(fs_dir)], "mount")


def attach_existing(sandbox_dir: Path, fs_dir: Path) -> None:
    """Mount the disk if the sandbox has one (after a host reboot, say)."""
    if (sandbox_dir / IMAGE).exists() and not fs_dir.is_mount():
        attach(sandbox_dir, fs_dir, 0)


def detach(fs_dir: Path) -> None:
    """Unmount the sandbox's disk (the loop device goes with it); safe to repeat."""
    with _lock:
        if fs_dir.is_mount():
            # Lazy: a process that still holds the mount (a box being torn
            # down) keeps it until it lets go; the host's view is gone now.
            _run(["umount", "-l", str(fs_dir)], "umount")


def exhausted(fs_dir: str) -> str | None:
    """How the disk mounted at ``fs_dir`` is full, or None when it is not."""
    try:
        st = os.statvfs(fs_dir)
    except OSError:
        return None
    total, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    if st.f_files and st.f_favail == 0:
        return f"disk quota reached: no inodes left ({st.f_files} in all)"
    if total and free <= min(total // 50, _FULL_MARGIN_MAX):
        used_mib, total_mib = (total - free) >> 20, total >> 20
        return f"disk quota reached: {used_mib} of {total_mib} MiB of the persistent layer used"
    return None


def _make_image(image: Path, size_bytes: int) -> None:
    tmp = image.with_name(f".{image.name}.tmp")
    with open(tmp, "wb") as f:
        f.truncate(size_bytes)
    # No blocks reserved for root (the sandbox's root is a user here), and the
    # inode tables initialised lazily, so making a disk of any size is instant.
    argv = ["mkfs.ext4", "-q", "-F", "-m", "0", "-E", "lazy_itable_init=1,lazy_journal_init=1"]
    try:
        _run([*argv, str(tmp)], "mkfs.ext4")
        os.replace(tmp, image)
    finally:
        tmp.unlink(missing_ok=True)


def _run(argv: list[str], what: str) -> None:
    try:
        done = subprocess.run(argv, capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise DiskUnavailable(f"{what} failed: {err}") from err
    if done.returncode != 0:
        said = done.stderr.decode(errors="replace").strip() or f"exit {done.returncode}"
        raise DiskUnavailable(f"{what} failed: {said}")
