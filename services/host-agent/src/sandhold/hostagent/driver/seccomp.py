"""The seccomp filter every process of a namespaced sandbox runs under.

Built once per host-agent with libseccomp (through ``pyseccomp``) and kept as a
raw BPF program on disk: a supervisor's child loads those bytes with one
``prctl`` just before exec, so no supervisor imports libseccomp, and bubblewrap
puts the same program on the sandbox's init (``--seccomp FD``).

A denylist in the spirit of Docker's default profile: everything a program
needs to run stays allowed; what would reach past the sandbox's namespaces
(mounts, new namespaces, ptrace, kernel modules, keyrings, bpf, the clock,
handles to host inodes) fails with EPERM. Namespaces and dropped capabilities
are the boundary; this filter shrinks the kernel surface an exploit could use.
"""

from __future__ import annotations

import ctypes
import errno
from pathlib import Path

# Calls refused outright (EPERM), grouped by what they would let a sandbox do.
DENIED_CALLS: tuple[str, ...] = (
    # file systems: mounting, remounting, moving the root
    "mount", "umount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree",
    "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr",
    # new or other namespaces (a nested user namespace would bring back capabilities)
    "unshare", "setns",
    # other processes' memory
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    # the kernel itself
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load",
    "bpf", "perf_event_open", "userfaultfd", "lookup_dcookie", "syslog", "acct",
    "reboot", "swapon", "swapoff", "iopl", "ioperm", "quotactl", "quotactl_fd",
    "nfsservctl", "uselib", "personality", "vhangup",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    # keyrings are not namespaced
    "keyctl", "add_key", "request_key",
    # handles that name host inodes directly (the "shocker" escape)
    "open_by_handle_at", "name_to_handle_at",
    # the machine's clock
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "stime",
)  # fmt: skip

# clone(2) may not make namespaces either; clone3 passes its flags in memory,
# which a filter cannot read, so it is refused with ENOSYS and libc falls back
# to clone (what Docker does too).
_CLONE_NAMESPACE_FLAGS = (
    0x00020000,  # CLONE_NEWNS
    0x02000000,  # CLONE_NEWCGROUP
    0x04000000,  # CLONE_NEWUTS
    0x08000000,  # CLONE_NEWIPC
    0x10000000,  # CLONE_NEWUSER
    0x20000000,  # CLONE_NEWPID
    0x40000000,  # CLONE_NEWNET
)

_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2


class SeccompUnavailable(RuntimeError):
    """libseccomp is missing or cannot build the filter here; the reason says which."""


def build_filter() -> bytes:
    """The filter as raw BPF (an array of ``struct sock_filter``)."""
    try:
        import pyseccomp as seccomp
    except (ImportError, OSError) as err:  # pyseccomp loads libseccomp.so.2 on import
        raise SeccompUnavailable(f"libseccomp is not available: {err}") from err
    import tempfile

    flt = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
    for call in DENIED_CALLS:
        try:
            flt.add_rule(seccomp.ERRNO(errno.EPERM), call)
        except (OSError, RuntimeError, ValueError):
            continue  # a call this architecture does not have
    for flag in _CLONE_NAMESPACE_FLAGS:
        flt.add_rule(
            seccomp.ERRNO(errno.EPERM),
            "clone",
            seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag),
        )
    flt.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    with tempfile.TemporaryFile() as out:
        flt.export_bpf(out)
        out.seek(0)
        program = out.read()
    if not program or len(program) % 8:
        raise SeccompUnavailable("libseccomp produced no usable BPF program")
    return program


def write_filter(path: Path) -> None:
    path.write_bytes(build_filter())


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


class LoadedFilter:
    """A BPF program in memory, ready to be installed in a forked child.

    Prepared before the fork (allocations, libc lookup), installed after it:
    ``install`` makes one system call and never allocates.
    """

    def __init__(self, program: bytes) -> None:
        self._buffer = ctypes.create_string_buffer(program, len(program))
        self._fprog = _SockFprog(len(program) // 8, ctypes.addressof(self._buffer))
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]

    def install(self) -> int:
        """Load the filter on the calling thread; 0 or the errno. Needs no_new_privs."""
        if self._libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(self._fprog)):
            return ctypes.get_errno()
        return 0
