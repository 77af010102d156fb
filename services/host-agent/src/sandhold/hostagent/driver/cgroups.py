"""Control groups for sandboxes: memory limit, OOM attribution, freeze, kill.

Tree: ``<parent>/<host_id>/<sandbox_id>/<command_id>``. The host id is part of
the path so that several agents (and test runs) on one machine never share a
cgroup. Each command has its own child cgroup so that an OOM kill is counted
against the command that suffered it; the sandbox cgroup carries the limit.
On v1 an ended command's empty cgroups are kept as spares for its sandbox's
next commands, renamed (decision 079): removing a memory cgroup costs the
kernel a walk of every mount's object lists under the global cgroup lock.

Three backends behind one Protocol: cgroup v2 (unified, with the memory
controller), cgroup v1 (``memory`` plus ``freezer`` hierarchies), and none.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import signal
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

CgroupKind = Literal["v1", "v2", "none"]

_POLL_S = 0.005
# The scheduling period a CPU limit's quota is a share of (100 ms, the kernel's default).
CPU_PERIOD_US = 100_000


class CgroupError(OSError):
    """A cgroup operation failed or is not available on this host."""


@dataclass(frozen=True)
class CommandCgroup:
    """What a supervisor needs to know about its command's cgroup(s)."""

    procs: list[str]
    oom_file: str | None
    # pids.events of the command's own cgroup: a "max" count above 0 means a
    # fork of the command was refused by the sandbox's process limit.
    pids_file: str | None = None
    # The cgroup.procs files of cgroups that are the command's alone (its final
    # KILL reaches everyone listed there); None: all of ``procs`` are.
    own_procs: list[str] | None = None
    # What ``oom_file`` counted before the command: a spare's count is that of
    # the commands it served before (v1, decision 079).
    oom_kills_before: int = 0


class Cgroups(Protocol):
    kind: CgroupKind
    enforces_memory_limit: bool
    enforces_pids_limit: bool
    can_freeze: bool
    message: str

    enforces_cpu_limit: bool

    def create_sandbox(
        self,
        sandbox_id: str,
        memory_limit_bytes: int | None,
        pids_limit: int | None = None,
        cpu_limit: float | None = None,
    ) -> None: ...
    def create_command(self, sandbox_id: str, command_id: str) -> CommandCgroup: ...
    def oom_kills(self, sandbox_id: str, command_id: str) -> int:
        """What the command's cgroup counts: on v1 also the kills of the commands
        a spare served before (decision 079); a command's own are in its exit."""
        ...

    def pids(self, sandbox_id: str, child: str | None = None) -> list[int]:
        """The processes in the sandbox's cgroups (or in one child cgroup of it)."""
        ...

    def cpu_stat(self, sandbox_id: str) -> dict[str, int]: ...
    def freeze(self, sandbox_id: str, timeout_s: float = 5.0) -> None: ...
    def thaw(self, sandbox_id: str) -> None: ...
    def kill_all(self, sandbox_id: str, timeout_s: float = 5.0) -> None: ...
    def remove(self, sandbox_id: str, timeout_s: float = 5.0) -> None: ...
    def remove_command(self, sandbox_id: str, command_id: str) -> bool:
        """Remove the command's own cgroups once its end is reported (on v1 kept
        as spares for the sandbox's next commands, decision 079); False (left for
        the sandbox's removal) while a process it left behind is in one."""
        ...

    def command_cgroups(self, sandbox_id: str) -> list[str]:
        """The ids of the commands whose own cgroups the sandbox still has."""
        ...

    def remove_host(self) -> None: ...
    def claim_host(self, keep: Collection[str]) -> list[str]:
        """Mark this host's cgroups in use for the rest of the process's life; if
        no other live process had marked them, first remove the empty cgroups of
        sandboxes not in `keep` (the ones the host's layout holds). Returns the
        ids of the sandboxes whose cgroups went."""
        ...


# --- pure helpers -------------------------------------------------------------


@dataclass(frozen=True)
class Mount:
    source: str
    target: Path
    fstype: str
    options: frozenset[str]


def parse_mounts(text: str) -> list[Mount]:
    """Parse ``/proc/self/mounts`` (octal escapes such as ``\\040`` decoded)."""
    mounts = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        target = fields[1].encode().decode("unicode_escape")
        mounts.append(Mount(fields[0], Path(target), fields[2], frozenset(fields[3].split(","))))
    return mounts


def parse_flat_keyed(text: str) -> dict[str, int]:
    """A cgroup "flat keyed" file (``key value`` per line), such as cpu.stat."""
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if value.strip().lstrip("-").isdigit():
            out[key] = int(value)
    return out


def parse_oom_kills(text: str) -> int:
    """The ``oom_kill N`` counter of v1 ``memory.oom_control`` or v2 ``memory.events``."""
    return parse_flat_keyed(text).get("oom_kill", 0)


def parse_pids_max_events(text: str) -> int:
    """The "max" count of a pids.events file: forks refused by a pids.max."""
    return parse_flat_keyed(text).get("max", 0)


def join_self(procs_files: list[str]) -> str | None:
    """Move the calling thread into each cgroup, for what it forks or execs next;
    why not, if it could not (named by the file).

    On v1 it writes "0" to the cgroup's `tasks`: the kernel moves only the
    caller and skips its global threadgroup lock, whose write side waits for an
    RCU grace period — 5–12 ms per launch on this machine, 0.2 ms without
    (decision 052). The callers are single-threaded (a command's child between
    fork and exec, a box's starter), so the thread is the process. v2 has no
    `tasks`: its cgroup.procs takes the pid.
    """
    for procs in procs_files:
        tasks = os.path.join(os.path.dirname(procs), "tasks")
        try:
            try:
                fd, value = os.open(tasks, os.O_WRONLY), b"0"
            except FileNotFoundError:
                fd, value = os.open(procs, os.O_WRONLY), str(os.getpid()).encode()
            try:
                os.write(fd, value)
            finally:
                os.close(fd)
        except OSError as err:
            return f"cannot join cgroup {procs}: {err.strerror}"
    return None


def parse_pids(text: str) -> list[int]:
    return [int(line) for line in text.split()]


def parse_frozen(events: str) -> bool:
    """Whether v2 ``cgroup.events`` says ``frozen 1``."""
    return any(line.split() == ["frozen", "1"] for line in events.splitlines())


def _write(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except OSError as err:
        raise CgroupError(err.errno, f"cannot write {value!r} to {path}: {err.strerror}") from err


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""


def _walk_bottom_up(top: Path) -> Iterator[Path]:
    for current, _dirs, _files in os.walk(top, topdown=False):
        yield Path(current)


def _pids_below(top: Path) -> list[int]:
    pids: list[int] = []
    for directory in _walk_bottom_up(top):
        pids.extend(parse_pids(_read(directory / "cgroup.procs")))
    return sorted(set(pids))


def _rmdir_tree(top: Path, deadline: float) -> None:
    """rmdir a cgroup and its children; cgroupfs refuses while processes remain."""
    while True:
        try:
            for directory in _walk_bottom_up(top):
                directory.rmdir()
            return
        except FileNotFoundError:
            continue
        except OSError as err:
            if err.errno != errno.EBUSY or time.monotonic() > deadline:
                raise CgroupError(err.errno, f"cannot remove cgroup {top}: {err.strerror}") from err
            time.sleep(_POLL_S)


def _rmdir_if_empty(directory: Path) -> bool:
    """rmdir one cgroup (no children); False while a process is in it."""
    try:
        directory.rmdir()
    except FileNotFoundError:
        pass
    except OSError as err:
        if err.errno == errno.EBUSY:
            return False
        raise CgroupError(err.errno, f"cannot remove cgroup {directory}: {err.strerror}") from err
    return True


# How many empty command cgroups a sandbox keeps for its next commands, on v1
# (decision 079). Removing a memory cgroup makes the kernel reparent the
# cgroup's share of every file system's dentry and inode lists, one pair per
# mounted file system (a box has several), under the global cgroup lock: ~3 ms
# of a kernel worker per command at 1,000 boxes, while launches wait for the
# lock. v1 lets a cgroup be renamed within its parent, so an ended command's
# cgroup becomes the next one's instead. v2 has no rename: there they go.
SPARES = 2
_SPARE = "_spare"  # `_`: never a command id (see _children)


def _take_spare(directory: Path) -> bool:
    """Make a command's cgroup by renaming one of its sandbox's spares; False if
    there was none (or the command's own exists already: a relaunch)."""
    for n in range(SPARES):
        try:
            os.rename(directory.parent / f"{_SPARE}{n}", directory)
        except FileNotFoundError:
            continue
        except OSError:
            return False
        return True
    return False


def _retire(directory: Path) -> bool:
    """Keep an ended command's empty cgroup as a spare, or remove it; False while
    a thread is in it (v1 counts threads: `tasks`, as rmdir does, not only the
    processes of `cgroup.procs`). Nothing joins an empty one: a command's
    processes join by its path, by themselves, before their exec, and the
    command has ended."""
    try:
        if (directory / "tasks").read_text().strip():
            return False
    except FileNotFoundError:
        return True  # gone already
    except OSError as err:
        raise CgroupError(err.errno, f"cannot read {directory}: {err.strerror}") from err
    for n in range(SPARES):
        try:
            os.rename(directory, directory.parent / f"{_SPARE}{n}")
        except FileExistsError:
            continue  # that spare is there already
        except FileNotFoundError:
            return True
        except OSError:
            break
        return True
    return _rmdir_if_empty(directory)


def _children(directory: Path) -> list[str]:
    """The child cgroups of a sandbox's that are commands' (not its box's, `_box`)."""
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return []
    return [e.name for e in entries if e.is_dir(follow_symlinks=False) and e.name[:1] != "_"]


def _mkdir(directory: Path, *, parents: bool = False) -> None:
    try:
        directory.mkdir(parents=parents, exist_ok=True)
    except OSError as err:
        hint = ""
        if err.errno in (errno.EBUSY, errno.ENOSPC):
            # What the kernel answers once it has 65,535 cgroups of a controller:
            # typically the empty cgroups of sandboxes whose data dir is gone.
            counts = ", ".join(f"{name} {n}" for name, n in _cgroup_counts().items())
            hint = f": the machine may have no more cgroups ({counts} exist)"
        raise CgroupError(
            err.errno, f"cannot create cgroup {directory}: {err.strerror}{hint}"
        ) from err


def _cgroup_counts() -> dict[str, int]:
    """How many cgroups each controller has (/proc/cgroups), the busiest first."""
    counts = {}
    for line in _read(Path("/proc/cgroups")).splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 3 and fields[2].isdigit():
            counts[fields[0]] = int(fields[2])
    return dict(sorted(counts.items(), key=lambda item: -item[1])[:3])


def _claim(
    previous: int | None, lock_dir: Path, host_dirs: list[Path], keep: Collection[str]
) -> tuple[int, list[str]]:
    """`claim_host` for a backend: a shared flock on `lock_dir` (a cgroupfs
    directory takes one), kept open for the process's life so that it goes with
    the process, however that ends. Cgroups belong to the machine, not to a data
    dir: a data dir thrown away (a bench, a killed test run) leaves its
    sandboxes' cgroups behind for ever, and the kernel allows 65,535 of a
    controller. An exclusive lock first means nobody else uses these cgroups
    now, so an empty one of a sandbox this host does not hold is nobody's. A
    claim made again replaces the `previous` one."""
    if previous is not None:
        os.close(previous)
    _mkdir(lock_dir, parents=True)
    fd = os.open(lock_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # another agent with this host id runs on this machine
        fcntl.flock(fd, fcntl.LOCK_SH)
        return fd, []
    left: dict[str, bool] = {}  # sandbox -> gone from every hierarchy
    try:
        for host in host_dirs:
            for entry in os.scandir(host) if host.is_dir() else ():
                if not entry.is_dir(follow_symlinks=False) or entry.name in keep:
                    continue
                try:
                    _rmdir_tree(Path(entry.path), deadline=0.0)  # busy: it has processes
                    left.setdefault(entry.name, True)
                except CgroupError:
                    left[entry.name] = False
    except BaseException:
        os.close(fd)  # never an exclusive lock left held: the next agent would wait on it
        raise
    removed = [sandbox_id for sandbox_id, gone in left.items() if gone]
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd, sorted(removed)


def _kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _wait_until(condition: Callable[[], bool], deadline: float, what: str) -> None:
    while not condition():
        if time.monotonic() > deadline:
            raise CgroupError(errno.ETIMEDOUT, f"timed out waiting until {what}")
        time.sleep(_POLL_S)


# --- backends -----------------------------------------------------------------


class V1Cgroups:
    """cgroup v1: the memory hierarchy, plus the freezer hierarchy when mounted."""

    kind: CgroupKind = "v1"
    enforces_memory_limit = True
    _claim_fd: int | None = None

    def __init__(
        self,
        memory: Path,
        freezer: Path | None,
        host_id: str,
        parent: str = "sandhold",
        pids: Path | None = None,
        cpu: Path | None = None,
    ) -> None:
        self._memory_host = memory / parent / host_id
        self._freezer_host = None if freezer is None else freezer / parent / host_id
        self._pids_host = None if pids is None else pids / parent / host_id
        self.can_freeze = freezer is not None
        self.enforces_pids_limit = pids is not None
        self._cpu_host = None if cpu is None else cpu / parent / host_id
        self.enforces_cpu_limit = cpu is not None
        self.message = (
            "cgroup v1"
            if freezer is not None
            else "cgroup v1 without the freezer hierarchy: saves pause with SIGSTOP instead"
        )

    def _dirs(self, *parts: str) -> list[Path]:
        hosts = [self._memory_host] + ([self._freezer_host] if self._freezer_host else [])
        hosts += [self._pids_host] if self._pids_host else []
        hosts += [self._cpu_host] if self._cpu_host else []
        return [host.joinpath(*parts) for host in hosts]

    def create_sandbox(
        self,
        sandbox_id: str,
        memory_limit_bytes: int | None,
        pids_limit: int | None = None,
        cpu_limit: float | None = None,
    ) -> None:
        for directory in self._dirs(sandbox_id):
            _mkdir(directory, parents=True)
        if self._cpu_host is not None:
            cpu = self._cpu_host / sandbox_id
            period = int(_read(cpu / "cpu.cfs_period_us").strip() or CPU_PERIOD_US)
            quota = "-1" if cpu_limit is None else str(max(1000, round(cpu_limit * period)))
            _write(cpu / "cpu.cfs_quota_us", quota)
        if self._pids_host is not None:
            _write(
                self._pids_host / sandbox_id / "pids.max",
                "max" if pids_limit is None else str(pids_limit),
            )
        memory = self._memory_host / sandbox_id
        limit = "-1" if memory_limit_bytes is None else str(memory_limit_bytes)
        memsw = memory / "memory.memsw.limit_in_bytes"
        # memsw must stay >= the plain limit, so the order of the two writes
        # depends on whether the limit shrinks or grows.
        try:
            _write(memory / "memory.limit_in_bytes", limit)
            if memsw.exists():
                _write(memsw, limit)
        except CgroupError:
            if not memsw.exists():
                raise
            _write(memsw, limit)
            _write(memory / "memory.limit_in_bytes", limit)

    def create_command(self, sandbox_id: str, command_id: str) -> CommandCgroup:
        # Own cgroups where attribution needs them (OOM kills) or freezing does;
        # in the pids and cpu hierarchies the sandbox's own cgroup (where the
        # limits are) is enough: fewer directories and attaches per command.
        hosts = [self._memory_host] + ([self._freezer_host] if self._freezer_host else [])
        directories = [host / sandbox_id / command_id for host in hosts]
        for directory in directories:
            if not _take_spare(directory):
                _mkdir(directory)
        # A spare (or any cgroup there already, such as a box's `_box` made
        # again) counts the kills of those it served before; a new one reads 0.
        oom_file = directories[0] / "memory.oom_control"
        oom_before = parse_oom_kills(_read(oom_file))
        procs = [str(directory / "cgroup.procs") for directory in directories]
        pids_file = None
        if self._pids_host is not None:
            procs.append(str(self._pids_host / sandbox_id / "cgroup.procs"))
            pids_file = str(self._pids_host / sandbox_id / "pids.events")  # read as a delta
        if self._cpu_host is not None and self._cpu_limited(sandbox_id):
            procs.append(str(self._cpu_host / sandbox_id / "cgroup.procs"))
        return CommandCgroup(
            procs=procs,
            oom_file=str(oom_file),
            pids_file=pids_file,
            own_procs=[str(directory / "cgroup.procs") for directory in directories],
            oom_kills_before=oom_before,
        )

    def _cpu_limited(self, sandbox_id: str) -> bool:
        assert self._cpu_host is not None
        return _read(self._cpu_host / sandbox_id / "cpu.cfs_quota_us").strip() not in ("", "-1")

    def oom_kills(self, sandbox_id: str, command_id: str) -> int:
        return parse_oom_kills(
            _read(self._memory_host / sandbox_id / command_id / "memory.oom_control")
        )

    def pids(self, sandbox_id: str, child: str | None = None) -> list[int]:
        top = self._memory_host / sandbox_id
        return _pids_below(top if child is None else top / child)

    def cpu_stat(self, sandbox_id: str) -> dict[str, int]:
        """The sandbox's cpu.stat (throttling counts); empty without the cpu controller."""
        if self._cpu_host is None:
            return {}
        return parse_flat_keyed(_read(self._cpu_host / sandbox_id / "cpu.stat"))

    def _freezer_state(self, sandbox_id: str) -> Path:
        if self._freezer_host is None:
            raise CgroupError(errno.ENOTSUP, "the cgroup v1 freezer is not mounted")
        return self._freezer_host / sandbox_id / "freezer.state"

    def freeze(self, sandbox_id: str, timeout_s: float = 5.0) -> None:
        state = self._freezer_state(sandbox_id)
        _write(state, "FROZEN")
        # The kernel reports FREEZING until every task has stopped.
        _wait_until(
            lambda: _read(state).strip() == "FROZEN",
            time.monotonic() + timeout_s,
            f"sandbox {sandbox_id} is frozen",
        )

    def thaw(self, sandbox_id: str) -> None:
        _write(self._freezer_state(sandbox_id), "THAWED")

    def kill_all(self, sandbox_id: str, timeout_s: float = 5.0) -> None:
        deadline = time.monotonic() + timeout_s
        while pids := self.pids(sandbox_id):
            # Frozen, nobody can fork a new member between listing and killing.
            frozen = False
            if self.can_freeze:
                try:
                    self.freeze(sandbox_id, timeout_s=1.0)
                    frozen = True
                except CgroupError:
                    pass
            _kill(pids)
            if frozen:
                self.thaw(sandbox_id)
            if time.monotonic() > deadline:
                raise CgroupError(errno.ETIMEDOUT, f"processes of {sandbox_id} survive SIGKILL")
            time.sleep(_POLL_S)

    def remove(self, sandbox_id: str, timeout_s: float = 5.0) -> None:
        deadline = time.monotonic() + timeout_s
        for directory in self._dirs(sandbox_id):
            if directory.exists():
                _rmdir_tree(directory, deadline)

    def remove_command(self, sandbox_id: str, command_id: str) -> bool:
        hosts = [self._memory_host] + ([self._freezer_host] if self._freezer_host else [])
        return all([_retire(host / sandbox_id / command_id) for host in hosts])

    def command_cgroups(self, sandbox_id: str) -> list[str]:
        hosts = [self._memory_host] + ([self._freezer_host] if self._freezer_host else [])
        return sorted({name for host in hosts for name in _children(host / sandbox_id)})

    def remove_host(self) -> None:
        for directory in self._dirs():
            if directory.exists():
                _rmdir_tree(directory, time.monotonic() + 5.0)

    def claim_host(self, keep: Collection[str]) -> list[str]:
        self._claim_fd, removed = _claim(self._claim_fd, self._memory_host, self._dirs(), keep)
        return removed


class V2Cgroups:
    """cgroup v2; detection picks it only with the memory controller available.

    Without that controller (a hybrid host's ``unified`` mount) it still
    freezes and kills, which is how its tests run on v1 machines.
    """

    kind: CgroupKind = "v2"
    can_freeze = True
    _claim_fd: int | None = None

    def __init__(self, mount: Path, host_id: str, parent: str = "sandhold") -> None:
        self._mount = mount
        self._parent = mount / parent
        self._host = self._parent / host_id
        controllers = _read(mount / "cgroup.controllers").split()
        self.enforces_memory_limit = "memory" in controllers
        self.enforces_pids_limit = "pids" in controllers
        self.enforces_cpu_limit = "cpu" in controllers
        self.message = (
            "cgroup v2"
            if self.enforces_memory_limit
            else f"cgroup v2 at {mount} without the memory controller: no memory limit"
        )

    def _enable(self, directory: Path, controller: str) -> None:
        control = directory / "cgroup.subtree_control"
        if controller not in _read(control).split():
            _write(control, f"+{controller}")

    def create_sandbox(
        self,
        sandbox_id: str,
        memory_limit_bytes: int | None,
        pids_limit: int | None = None,
        cpu_limit: float | None = None,
    ) -> None:
        sandbox = self._host / sandbox_id
        _mkdir(sandbox, parents=True)
        # Each level must delegate a controller to the next, down to the command
        # cgroups, which is where memory.events and pids.events must count.
        levels = (self._mount, self._parent, self._host, sandbox)
        if self.enforces_pids_limit:
            for directory in levels:
                self._enable(directory, "pids")
            _write(sandbox / "pids.max", "max" if pids_limit is None else str(pids_limit))
        if self.enforces_cpu_limit:
            for directory in levels:
                self._enable(directory, "cpu")
            quota = "max" if cpu_limit is None else str(max(1000, round(cpu_limit * CPU_PERIOD_US)))
            _write(sandbox / "cpu.max", f"{quota} {CPU_PERIOD_US}")
        if not self.enforces_memory_limit:
            return
        for directory in levels:
            self._enable(directory, "memory")
        _write(
            sandbox / "memory.max", "max" if memory_limit_bytes is None else str(memory_limit_bytes)
        )
        swap = sandbox / "memory.swap.max"
        if swap.exists():
            # v1's memsw limit has the same effect: the limit is not a RAM limit
            # that swap can bypass.
            _write(swap, "max" if memory_limit_bytes is None else "0")

    def create_command(self, sandbox_id: str, command_id: str) -> CommandCgroup:
        directory = self._host / sandbox_id / command_id
        _mkdir(directory)
        oom_file = str(directory / "memory.events") if self.enforces_memory_limit else None
        pids_file = None
        if self.enforces_pids_limit:
            # v2 counts a refused fork where the limit is (the sandbox), and in
            # the forking cgroup's own .local file where the kernel has it.
            local = directory / "pids.events.local"
            pids_file = str(local if local.exists() else self._host / sandbox_id / "pids.events")
        return CommandCgroup([str(directory / "cgroup.procs")], oom_file, pids_file)

    def oom_kills(self, sandbox_id: str, command_id: str) -> int:
        return parse_oom_kills(_read(self._host / sandbox_id / command_id / "memory.events"))

    def pids(self, sandbox_id: str, child: str | None = None) -> list[int]:
        top = self._host / sandbox_id
        return _pids_below(top if child is None else top / child)

    def cpu_stat(self, sandbox_id: str) -> dict[str, int]:
        if not self.enforces_cpu_limit:
            return {}
        return parse_flat_keyed(_read(self._host / sandbox_id / "cpu.stat"))

    def freeze(self, sandbox_id: str, timeout_s: float = 5.0) -> None:
        sandbox = self._host / sandbox_id
        _write(sandbox / "cgroup.freeze", "1")
        _wait_until(
            lambda: parse_frozen(_read(sandbox / "cgroup.events")),
            time.monotonic() + timeout_s,
            f"sandbox {sandbox_id} is frozen",
        )

    def thaw(self, sandbox_id: str) -> None:
        _write(self._host / sandbox_id / "cgroup.freeze", "0")

    def kill_all(self, sandbox_id: str, timeout_s: float = 5.0) -> None:
        sandbox = self._host / sandbox_id
        deadline = time.monotonic() + timeout_s
        while pids := self.pids(sandbox_id):
            if (sandbox / "cgroup.kill").exists():
                _write(sandbox / "cgroup.kill", "1")
            else:
                _kill(pids)
            if time.monotonic() > deadline:
                raise CgroupError(errno.ETIMEDOUT, f"processes of {sandbox_id} survive SIGKILL")
            time.sleep(_POLL_S)

    def remove(self, sandbox_id: str, timeout_s: float = 5.0) -> None:
        sandbox = self._host / sandbox_id
        if sandbox.exists():
            _rmdir_tree(sandbox, time.monotonic() + timeout_s)

    def remove_command(self, sandbox_id: str, command_id: str) -> bool:
        return _rmdir_if_empty(self._host / sandbox_id / command_id)

    def command_cgroups(self, sandbox_id: str) -> list[str]:
        return sorted(_children(self._host / sandbox_id))

    def remove_host(self) -> None:
        if self._host.exists():
            _rmdir_tree(self._host, time.monotonic() + 5.0)

    def claim_host(self, keep: Collection[str]) -> list[str]:
        self._claim_fd, removed = _claim(self._claim_fd, self._host, [self._host], keep)
        return removed


class NoCgroups:
    """No usable cgroup: commands run, but without limit, OOM attribution or freezer."""

    kind: CgroupKind = "none"
    enforces_memory_limit = False
    enforces_pids_limit = False
    enforces_cpu_limit = False
    can_freeze = False

    def __init__(self, message: str) -> None:
        self.message = message

    def create_sandbox(
        self,
        sandbox_id: str,
        memory_limit_bytes: int | None,
        pids_limit: int | None = None,
        cpu_limit: float | None = None,
    ) -> None:
        pass

    def create_command(self, sandbox_id: str, command_id: str) -> CommandCgroup:
        return CommandCgroup([], None)

    def oom_kills(self, sandbox_id: str, command_id: str) -> int:
        return 0

    def pids(self, sandbox_id: str, child: str | None = None) -> list[int]:
        return []

    def cpu_stat(self, sandbox_id: str) -> dict[str, int]:
        return {}

    def freeze(self, sandbox_id: str, timeout_s: float = 5.0) -> None:
        raise CgroupError(errno.ENOTSUP, self.message)

    def thaw(self, sandbox_id: str) -> None:
        raise CgroupError(errno.ENOTSUP, self.message)

    def kill_all(self, sandbox_id: str, timeout_s: float = 5.0) -> None:
        pass

    def remove(self, sandbox_id: str, timeout_s: float = 5.0) -> None:
        pass

    def remove_command(self, sandbox_id: str, command_id: str) -> bool:
        return True

    def command_cgroups(self, sandbox_id: str) -> list[str]:
        return []

    def remove_host(self) -> None:
        pass

    def claim_host(self, keep: Collection[str]) -> list[str]:
        return []


def detect_cgroups(
    host_id: str, *, parent: str = "sandhold", mounts_text: str | None = None
) -> Cgroups:
    """Pick the backend this host supports: v2 with memory, else v1 memory, else none.

    A v2 hierarchy without the memory controller (the ``unified`` mount of a
    hybrid setup) is useless for limits and is skipped.
    """
    if mounts_text is None:
        mounts_text = Path("/proc/self/mounts").read_text()
    mounts = parse_mounts(mounts_text)
    for mount in mounts:
        if mount.fstype != "cgroup2":  # not a directory at all, some (a netns's nsfs file)
            continue
        controllers = _read(mount.target / "cgroup.controllers").split()
        if "memory" in controllers and _writable(mount):
            return V2Cgroups(mount.target, host_id, parent)
    v1 = {
        name: mount.target
        for mount in mounts
        if mount.fstype == "cgroup" and _writable(mount)
        for name in ("memory", "freezer", "pids", "cpu")
        if name in mount.options
    }
    if "memory" in v1:
        return V1Cgroups(
            v1["memory"], v1.get("freezer"), host_id, parent, pids=v1.get("pids"), cpu=v1.get("cpu")
        )
    return NoCgroups(
        "no writable cgroup hierarchy with the memory controller (neither cgroup v2 listing "
        "'memory' in cgroup.controllers nor a cgroup v1 'memory' mount): memory limits are "
        "not enforced, OOM kills are not attributed, saves pause with SIGSTOP"
    )


def _writable(mount: Mount) -> bool:
    return "ro" not in mount.options and os.access(mount.target, os.W_OK)
