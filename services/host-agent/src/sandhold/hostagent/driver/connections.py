"""A sandbox's Connections on its host: files on a tmpfs, never on disk.

Each sandbox has one directory, ``<root>/<sandbox id>/``, holding a file per
Connection; a namespaced sandbox sees it read-only at ``/run/connections``
(box.py binds it when the box starts, so the directory is kept and only its
files change: a bind mount follows the directory, not a path). ``root`` is
private to the host's root (0700) and lies on a tmpfs, so a value never
reaches a disk, a save or a Snapshot (the sandbox's own ``/run`` is a tmpfs of
the box's, outside its persistent root). See decision 031.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from pathlib import Path

from sandhold.hostagent.driver.layout import check_id

# tmpfs candidates, in order: every Linux has /dev/shm, most have /run as well.
_TMPFS_CANDIDATES = (Path("/dev/shm"), Path("/run"))


def mount_type(path: Path) -> str:
    """The file system type of the mount `path` lies on ("" if unknown)."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return ""
    best, kind = "", ""
    resolved = str(path.resolve())
    for line in lines:
        fields = line.split()
        if "-" not in fields:
            continue
        mount_point = fields[4].replace("\\040", " ")
        fstype = fields[fields.index("-") + 1]
        inside = resolved == mount_point or resolved.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) >= len(best):
            best, kind = mount_point, fstype
    return kind


def default_root(host_root: Path) -> tuple[Path, bool]:
    """Where this host keeps Connections, and whether that is a tmpfs. One
    directory per host root, so two hosts on one machine never share one."""
    tag = hashlib.sha256(str(host_root.resolve()).encode()).hexdigest()[:16]
    for candidate in _TMPFS_CANDIDATES:
        if (
            candidate.is_dir()
            and os.access(candidate, os.W_OK)
            and mount_type(candidate) == "tmpfs"
        ):
            return candidate / f"sandhold-connections-{tag}", True
    return host_root / "connections", False


class ConnectionFiles:
    """The Connection files of one host's sandboxes."""

    def __init__(self, root: Path, *, on_tmpfs: bool) -> None:
        self.root = root
        self.on_tmpfs = on_tmpfs

    @property
    def problem(self) -> str | None:
        if self.on_tmpfs:
            return None
        return f"no tmpfs found: Connections are kept on disk at {self.root}"

    def directory(self, sandbox_id: str) -> Path:
        return self.root / check_id("sandbox id", sandbox_id)

    def prepare(self, sandbox_id: str, owner: int) -> Path:
        """The sandbox's directory, made if missing, owned by `owner` (the host
        id of the sandbox's root) and readable by every user of the sandbox."""
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)  # however it was made: only the host's root enters
        directory = self.directory(sandbox_id)
        directory.mkdir(mode=0o555, exist_ok=True)
        os.chown(directory, owner, owner)
        os.chmod(directory, 0o555 if owner else 0o500)
        return directory

    def write(self, sandbox_id: str, values: dict[str, str], owner: int) -> None:
        """Make the directory hold exactly `values` (name -> text). Each file is
        replaced whole (a reader sees the old value or the new, never half)."""
        directory = self.prepare(sandbox_id, owner)
        mode = 0o444 if owner else 0o400
        for name, value in values.items():
            check_id("Connection name", name)
            staged = directory / f".{name}.new"
            fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            try:
                os.write(fd, value.encode())
                os.fchown(fd, owner, owner)
                os.fchmod(fd, mode)
            finally:
                os.close(fd)
            os.replace(staged, directory / name)
        for entry in os.scandir(directory):
            if entry.name not in values:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)

    def names(self, sandbox_id: str) -> list[str]:
        try:
            return sorted(os.listdir(self.directory(sandbox_id)))
        except FileNotFoundError:
            return []

    def remove(self, sandbox_id: str) -> None:
        """The sandbox stopped or left this host: its Connections go with it."""
        shutil.rmtree(self.directory(sandbox_id), ignore_errors=True)
