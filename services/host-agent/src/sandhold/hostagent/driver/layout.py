"""Where a host's sandboxes and commands live on disk.

The directory tree is the driver's only durable state: a supervisor writes into
it while the agent is down, and the next agent reads it back (``adopt_all``).
"""

from __future__ import annotations

import array
import fcntl
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path
from typing import TypeVar

# Ids become path components and cgroup names, so they must not be able to
# climb out of their directory or collide with our own file names.
_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def check_id(kind: str, value: str) -> str:
    """Return ``value`` if it is safe as a single path component, else raise ValueError."""
    if not _ID_PATTERN.fullmatch(value) or ".." in value:
        raise ValueError(f"invalid {kind} {value!r}: use letters, digits, '.', '_' and '-'")
    return value


T = TypeVar("T")

# ioctl(2) numbers of the inode flags (linux/fs.h, 64-bit), and the flag
# that marks a directory as the top of a hierarchy (ext2/3/4).
_FS_IOC_GETFLAGS = 0x80086601
_FS_IOC_SETFLAGS = 0x40086602
FS_TOPDIR_FL = 0x00020000


def inode_flags(path: Path) -> int | None:
    """The inode flags of ``path`` (what ``lsattr`` shows), None where the
    filesystem has none."""
    return _with_flags(path, lambda _fd, flags: flags)


def spread_subdirectories(path: Path) -> bool:
    """Mark ``path`` a top directory (``chattr +T``), so ext4 places each new
    directory in it in a block group of its own choosing rather than in the
    parent's: a sandbox's command directories (nine inodes each, made and
    removed by the thousand) then do not crowd one group. On an ext4 without a
    journal, allocating an inode passes over every inode its group freed in the
    last minute or more (``recently_deleted``), so with every command in one
    group each new file cost ~0.7 ms of CPU (decision 090). Other filesystems
    have no such flag: nothing is changed there. Whether the flag is set (False
    also for a directory that is not there)."""

    def set_topdir(fd: int, flags: int) -> bool:
        if not flags & FS_TOPDIR_FL:
            fcntl.ioctl(fd, _FS_IOC_SETFLAGS, array.array("i", [flags | FS_TOPDIR_FL]), True)
        return True

    return bool(_with_flags(path, set_topdir))


def _with_flags(path: Path, use: Callable[[int, int], T]) -> T | None:
    """``use(fd, flags)`` on the directory opened once; None where it cannot be
    opened or a flag cannot be read or set."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        flags = array.array("i", [0])
        fcntl.ioctl(fd, _FS_IOC_GETFLAGS, flags, True)
        return use(fd, flags[0])
    except OSError:
        return None
    finally:
        os.close(fd)


@dataclass(frozen=True)
class CommandPaths:
    """The files of one command: ``<root>/sandboxes/<sandbox>/commands/<command>/``.
    Each path is made once (a handle looks at them on every ring)."""

    directory: Path

    @cached_property
    def spec(self) -> Path:
        return self.directory / "spec.json"

    @cached_property
    def stdout(self) -> Path:
        return self.directory / "stdout"

    @cached_property
    def stderr(self) -> Path:
        return self.directory / "stderr"

    @cached_property
    def pid(self) -> Path:
        """The command's own pid (its process group id too)."""
        return self.directory / "pid"

    @cached_property
    def supervisor(self) -> Path:
        """Identity of the supervisor process, so liveness survives pid reuse."""
        return self.directory / "supervisor.json"

    @cached_property
    def interrupt(self) -> Path:
        """Written before SIGUSR1 when the caller wants a grace other than the spec's."""
        return self.directory / "interrupt.json"

    @cached_property
    def exit(self) -> Path:
        return self.directory / "exit.json"

    @cached_property
    def reported(self) -> Path:
        return self.directory / "reported"

    @cached_property
    def log(self) -> Path:
        """The supervisor's own stderr (tracebacks), never the command's."""
        return self.directory / "supervisor.log"

    def stream(self, name: str) -> Path:
        if name == "stdout":
            return self.stdout
        if name == "stderr":
            return self.stderr
        raise ValueError(f"unknown stream {name!r}")


@lru_cache(maxsize=4096)
def _sandbox_dir(root: Path, sandbox_id: str) -> Path:
    # (Made a few times for every command a sandbox runs, the same each time.)
    return root / "sandboxes" / check_id("sandbox id", sandbox_id)


@dataclass(frozen=True)
class HostLayout:
    """The tree under a host root, e.g. ``<data>/hosts/<host-id>``."""

    root: Path

    def sandbox_dir(self, sandbox_id: str) -> Path:
        return _sandbox_dir(self.root, sandbox_id)

    def workspace(self, sandbox_id: str) -> Path:
        return self.sandbox_dir(sandbox_id) / "workspace"

    def commands_dir(self, sandbox_id: str) -> Path:
        return self.sandbox_dir(sandbox_id) / "commands"

    def make_commands_dir(self, sandbox_id: str) -> None:
        """The sandbox's commands directory, its command directories spread over
        the disk (`spread_subdirectories`); safe to repeat."""
        directory = self.commands_dir(sandbox_id)
        directory.mkdir(parents=True, exist_ok=True)
        spread_subdirectories(directory)

    def command(self, sandbox_id: str, command_id: str) -> CommandPaths:
        return CommandPaths(self.commands_dir(sandbox_id) / check_id("command id", command_id))

    def sandbox_ids(self) -> list[str]:
        base = self.root / "sandboxes"
        try:
            entries = os.scandir(base)
        except FileNotFoundError:
            return []
        with entries:
            return sorted(entry.name for entry in entries if entry.is_dir())

    def command_ids(self, sandbox_id: str) -> list[str]:
        try:
            entries = os.scandir(self.commands_dir(sandbox_id))
        except FileNotFoundError:
            return []
        with entries:
            return sorted(entry.name for entry in entries if entry.is_dir())
