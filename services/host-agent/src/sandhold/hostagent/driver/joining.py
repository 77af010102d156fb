"""Joining a running box: how a supervisor's child becomes a command inside it.

The supervisor stays outside, as the parent of everything it watches (output
pipes, exit status, timeouts and the record on disk are as for the process
driver). It checks that the box's init is still the process it was (a pid can
be reused), opens its namespaces and joins its pid namespace — which applies to
its children only, so the command it forks next is born inside the box. That
child, between fork and exec, joins the command's cgroups, its own session (as
for every command), the user, mount, net, ipc, uts and cgroup namespaces,
takes the sandbox user's ids, drops every capability outside the small set a
container's root keeps (none at all for the unprivileged user), sets
``no_new_privs`` and installs the seccomp filter last (it refuses ``setns``).

Everything is prepared before the fork (libc, the filter in memory); the child
only makes system calls. ``enter`` returns a reason instead of raising where
it can, since a launch failure must be recorded, not crash the supervisor.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import struct
from dataclasses import dataclass
from typing import Any

from sandhold.hostagent.driver import launcher as steps
from sandhold.hostagent.driver.process_identity import ProcessIdentity
from sandhold.hostagent.driver.seccomp import LoadedFilter

# Joined in this order once the pid namespace is; the user namespace first,
# so the rest is joined with the box's own capabilities.
_NAMESPACES = ("user", "mnt", "net", "ipc", "uts", "cgroup")
_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_DUMPABLE = 4
_PR_CAPBSET_DROP = 24
_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2
# What the sandbox's root keeps inside its user namespace (Docker's default
# set, less NET_RAW): enough for a package manager; never CAP_SYS_ADMIN,
# CAP_SYS_PTRACE, CAP_SYS_MODULE, CAP_NET_ADMIN or the like.
ROOT_CAPABILITIES = frozenset(
    {0, 1, 3, 4, 5, 6, 7, 8, 10, 18, 27, 29, 31}
)  # CHOWN DAC_OVERRIDE FOWNER FSETID KILL SETGID SETUID SETPCAP NET_BIND_SERVICE SYS_CHROOT MKNOD AUDIT_WRITE SETFCAP  # noqa: E501
_LAST_CAP = 63


@dataclass(frozen=True)
class BoxTarget:
    """Which box to join and as whom; part of the command's spec on disk."""

    init: dict[str, Any]  # ProcessIdentity of the box's init
    uid: int
    gid: int
    groups: list[int]
    seccomp: str | None  # the raw BPF program's path
    # The host's launcher (launcher.py); None: joined in Python, in the child.
    launcher: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "init": self.init, "uid": self.uid, "gid": self.gid,
            "groups": self.groups, "seccomp": self.seccomp, "launcher": self.launcher,
        }  # fmt: skip

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> BoxTarget:
        return cls(
            init=dict(raw["init"]),
            uid=int(raw["uid"]),
            gid=int(raw["gid"]),
            groups=[int(g) for g in raw.get("groups", [])],
            seccomp=raw.get("seccomp"),
            launcher=raw.get("launcher"),
        )


class Joiner:
    """Prepared in the supervisor, used in its forked child (see module docstring)."""

    def __init__(self, target: BoxTarget) -> None:
        self.target = target
        self._init = ProcessIdentity.from_json(target.init)
        self._filter: LoadedFilter | None = None
        self._filter_program = b""
        if target.seccomp is not None:
            with open(target.seccomp, "rb") as program:
                self._filter_program = program.read()
            if target.launcher is None:
                self._filter = LoadedFilter(self._filter_program)
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]
        self._libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong] + [ctypes.c_ulong] * 3
        self._fds: dict[str, int] = {}

    def _errno(self, what: str) -> str:
        return f"{what}: {os.strerror(ctypes.get_errno())}"

    def open_box(self) -> str | None:
        """Open the box's namespaces; why not, if its init is gone."""
        if not self._init.is_alive():
            return "the sandbox's init is not running"
        try:
            for name in ("pid", *_NAMESPACES):
                self._fds[name] = os.open(f"/proc/{self._init.pid}/ns/{name}", os.O_RDONLY)
        except OSError as err:
            return f"opening the sandbox's namespaces: {err.strerror}"
        # Opened, the descriptors name the namespaces whatever the pid becomes;
        # still this process, they are the box's.
        if not self._init.is_alive():
            return "the sandbox's init exited while being joined"
        return None

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}

    def join_pid_namespace(self) -> str | None:
        """Join the box's pid namespace: for this process's children (the command) only."""
        if self._libc.setns(self._fds["pid"], 0) != 0:
            return self._errno("joining the pid namespace")
        return None

    def enter(self) -> str | None:
        """In the command's process: the other namespaces, the ids, the privileges."""
        self._libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
        for name in _NAMESPACES:
            if self._libc.setns(self._fds[name], 0) != 0:
                return self._errno(f"joining the {name} namespace")
        self.close()
        keep = ROOT_CAPABILITIES if self.target.uid == 0 else frozenset()
        for cap in range(_LAST_CAP + 1):
            if cap not in keep and self._libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
                if ctypes.get_errno() == 22:  # EINVAL: past the kernel's last capability
                    break
                return self._errno("dropping capabilities")
        try:
            os.setgroups(self.target.groups)
            os.setresgid(self.target.gid, self.target.gid, self.target.gid)
            os.setresuid(self.target.uid, self.target.uid, self.target.uid)
        except OSError as err:
            return f"taking the sandbox user's ids: {err.strerror}"
        if self._libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            return self._errno("setting no_new_privs")
        return None

    def namespace_fds(self) -> list[int]:
        """The descriptors of the namespaces a command joins (open_box opened them)."""
        return [self._fds[name] for name in _NAMESPACES]

    def plan(
        self,
        argv: list[str],
        cwd: str,
        env: dict[str, str],
        cgroup_procs: list[str],
        report_fd: int,
    ) -> steps.Plan:
        """What `enter`, `launch_problem_inside` and `install_filter` do, in
        this order, as the launcher's steps, then the exec; the child holds
        0–2, `report_fd` and `namespace_fds()` (see launcher.py)."""
        plan = steps.Plan(report_fd)
        passed = {report_fd, *self.namespace_fds()}
        free = min(fd for fd in range(3, 3 + len(passed) + 1) if fd not in passed)
        # (read and write, as subprocess.DEVNULL is)
        plan.call(steps.SYS_OPEN, plan.string(os.devnull), os.O_RDWR, what="opening stdin")
        plan.call(steps.SYS_FCNTL, report_fd, 2, 1, what="setting up the launch")  # FD_CLOEXEC
        plan.call(steps.SYS_PRCTL, _PR_SET_DUMPABLE, 0, 0, 0, 0, what="setting up the launch")
        zero = plan.string("0")  # "0" is the writer itself, in either cgroup version
        for procs in cgroup_procs:
            tasks = os.path.join(os.path.dirname(procs), "tasks")  # v1: see `join_self`
            target = tasks if os.path.exists(tasks) else procs
            what = f"cannot join cgroup {procs}"
            plan.call(steps.SYS_OPEN, plan.string(target), os.O_WRONLY | os.O_CLOEXEC, what=what)
            plan.call(steps.SYS_WRITE, free, zero, 1, what=what)
            plan.call(steps.SYS_CLOSE, free, what=what)
        for name, fd in zip(_NAMESPACES, self.namespace_fds(), strict=True):
            plan.call(steps.SYS_SETNS, fd, 0, what=f"joining the {name} namespace")
        for fd in self.namespace_fds():
            plan.call(steps.SYS_CLOSE, fd, what="closing the namespaces")
        keep = ROOT_CAPABILITIES if self.target.uid == 0 else frozenset()
        last = _LAST_CAPABILITY
        for cap in range(_LAST_CAP + 1 if last is None else last + 1):
            if cap not in keep:
                # Unknown to the kernel (EINVAL) past its last: passed over
                # only where the kernel did not say which is its last.
                known = last is not None or cap <= _LAST_KNOWN_CAP
                plan.call(
                    steps.SYS_PRCTL, _PR_CAPBSET_DROP, cap, 0, 0, 0,
                    what="dropping capabilities", flags=steps.FAIL if known else 0,
                )  # fmt: skip
        ids = "taking the sandbox user's ids"
        groups = plan.put(struct.pack(f"<{len(self.target.groups)}I", *self.target.groups))
        plan.call(steps.SYS_SETGROUPS, len(self.target.groups), groups, what=ids)
        plan.call(steps.SYS_SETRESGID, *(self.target.gid,) * 3, what=ids)
        plan.call(steps.SYS_SETRESUID, *(self.target.uid,) * 3, what=ids)
        plan.call(steps.SYS_PRCTL, _PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0, what="setting no_new_privs")
        plan.call(steps.SYS_CHDIR, plan.string(cwd), what=_CWD)
        if self._filter_program:
            program = plan.put(self._filter_program)
            fprog = struct.pack("<H6xQ", len(self._filter_program) // 8, program)
            plan.call(
                steps.SYS_PRCTL, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, plan.put(fprog),
                what="installing the seccomp filter",
            )  # fmt: skip
        args = plan.strings(argv)
        envp = plan.strings([f"{k}={v}" for k, v in env.items()])
        candidates = _candidates(argv[0], env)
        for n, candidate in enumerate(candidates):
            final = n == len(candidates) - 1
            plan.call(
                steps.SYS_EXECVE, plan.string(candidate), args, envp,
                what=_EXEC, flags=steps.FAIL | steps.LAST if final else 0,
            )  # fmt: skip
        return plan

    def install_filter(self) -> str | None:
        if self._filter is None:
            return None
        code = self._filter.install()
        return None if code == 0 else f"installing the seccomp filter: {os.strerror(code)}"


_CWD, _EXEC = "chdir", "execve"  # steps whose failures `launch_failure` words itself
_MAX_PATH_ENTRIES = 64
_LAST_KNOWN_CAP = 40  # CAP_CHECKPOINT_RESTORE, Linux 5.9


def _last_capability() -> int | None:
    try:
        with open("/proc/sys/kernel/cap_last_cap") as last:
            return int(last.read())
    except (OSError, ValueError):
        return None


# Read once, as the zygote imports this, not by every supervisor per command.
_LAST_CAPABILITY = _last_capability()


def _candidates(program: str, env: dict[str, str]) -> list[str]:
    """Where the exec looks for the program: itself if it names a path, else
    each directory of the command's PATH in order (as `shutil.which` does)."""
    if "/" in program:
        return [program]
    found: list[str] = []
    for directory in env.get("PATH", os.defpath).split(os.pathsep)[:_MAX_PATH_ENTRIES]:
        candidate = os.path.join(directory, program)
        if candidate not in found:
            found.append(candidate)
    return found or [program]


def launch_failure(what: str, errno: int, argv: list[str], cwd: str) -> str:
    """A launcher's report (`Plan.failure`) in the words ``launch_failed`` uses,
    the ones `launch_problem_inside` and `enter` give."""
    if what == _CWD:
        if errno in (2, 20):  # ENOENT, ENOTDIR
            return f"working directory does not exist: {cwd}"
        return f"working directory {cwd}: {os.strerror(errno)}"
    if what == _EXEC:
        program = argv[0]
        if errno in (2, 20) or (errno == 13 and "/" not in program):  # ENOENT, ENOTDIR, EACCES
            return f"executable not found: {program}"
        if errno == 13:
            return f"not an executable file: {program}"
        return f"cannot start {program}: {os.strerror(errno)}"
    return f"{what}: {os.strerror(errno)}" if errno else what


def launch_problem_inside(argv: list[str], cwd: str, env: dict[str, str]) -> str | None:
    """``launch_failed`` reasons, judged from inside the sandbox's root."""
    if not argv:
        return "empty command line"
    try:
        os.chdir(cwd)
    except (FileNotFoundError, NotADirectoryError):
        return f"working directory does not exist: {cwd}"
    except OSError as err:
        return f"working directory {cwd}: {err.strerror}"
    program = argv[0]
    if "/" in program:
        if not os.path.exists(program):
            return f"executable not found: {program}"
        if os.path.isdir(program) or not os.access(program, os.X_OK):
            return f"not an executable file: {program}"
        return None
    if shutil.which(program, path=env.get("PATH", os.defpath)) is None:
        return f"executable not found: {program}"
    return None
