"""The box's pid 1: a static program of a few instructions that maps no library.

Why not a shell loop: every process that maps a shared file (libc) joins that
file's reverse map, and the kernel walks the whole map under the file's
``i_mmap_rwsem`` whenever it reclaims or migrates one of its pages (a
proactive reclaimer such as DAMON does it all the time). Forks, execs and
exits of *every* process that maps the file wait for that lock. Boxes used to
keep four such processes each (bubblewrap outside and as pid 1, ``sh`` and
``sleep``); at 1,000 boxes a command's fork and exec waited tens of
milliseconds behind walks of 16,000 mappings (bench/host_scale.py, decision
076). This init maps only itself: each box gets its own copy (on the
starter's private tmpfs), so not even its own page is shared.

What it does, as pid 1 of the box's pid namespace (bubblewrap ``--as-pid-1``):

0. makes itself not dumpable: it runs as the sandbox's root, who could
   otherwise rewrite it through ``/proc/1/mem`` (no ptrace needed) and end
   the box;
1. writes ``ready\\n`` to descriptor 6 and closes it (the starter waits for it:
   bubblewrap runs pid 1 only after every mount succeeded);
2. blocks SIGCHLD, then for ever: reaps every child that has ended (commands'
   orphans are re-parented to it), and waits for the next SIGCHLD.

Signals sent from inside the box cannot end it (the kernel ignores, for a
namespace's init, every signal it has no handler for — SIGKILL included — when
sent from inside); the host kills it to destroy the box, which ends every
process in it. A blocked signal is never ignored, so SIGCHLD stays pending
until ``rt_sigtimedwait`` takes it, also when it arrives between the last
``wait4`` and the wait.

The code is x86-64 only; elsewhere ``program()`` is None and the box runs the
portable shell holder instead (box.py says which).
"""

from __future__ import annotations

import platform
import struct

READY_FD = 6
PATH_INSIDE = "/run/box-init"

BASE = 0x400000
_EHDR, _PHDR = 64, 56

# x86-64, Linux system call numbers. Each row: the bytes, the instruction.
_X86_64_CODE: list[tuple[str, str]] = [
    ("b8 9d 00 00 00", "mov eax, 157          ; prctl"),
    ("bf 04 00 00 00", "mov edi, 4            ;   PR_SET_DUMPABLE"),
    ("31 f6", "xor esi, esi          ;   0: /proc/1/mem and the like are the host's only"),
    ("0f 05", "syscall"),
    ("b8 01 00 00 00", "mov eax, 1            ; write"),
    ("bf 06 00 00 00", "mov edi, 6            ;   to the ready descriptor"),
    ("48 8d 35 5d 00 00 00", "lea rsi, [rip+0x5d] ;   'ready\\n' (at the end)"),
    ("ba 06 00 00 00", "mov edx, 6            ;   6 bytes"),
    ("0f 05", "syscall"),
    ("b8 03 00 00 00", "mov eax, 3            ; close"),
    ("bf 06 00 00 00", "mov edi, 6            ;   the ready descriptor"),
    ("0f 05", "syscall"),
    ("68 00 00 01 00", "push 0x10000          ; the set {SIGCHLD} (bit 17-1), on the stack"),
    ("b8 0e 00 00 00", "mov eax, 14           ; rt_sigprocmask"),
    ("31 ff", "xor edi, edi          ;   SIG_BLOCK"),
    ("48 89 e6", "mov rsi, rsp          ;   the set"),
    ("31 d2", "xor edx, edx          ;   no old set"),
    ("41 ba 08 00 00 00", "mov r10d, 8           ;   sizeof(sigset_t)"),
    ("0f 05", "syscall"),
    # reap: (offset 0x4b)
    ("b8 3d 00 00 00", "mov eax, 61           ; wait4"),
    ("bf ff ff ff ff", "mov edi, -1           ;   any child"),
    ("31 f6", "xor esi, esi          ;   no status"),
    ("ba 01 00 00 40", "mov edx, 0x40000001   ;   WNOHANG | __WALL"),
    ("45 31 d2", "xor r10d, r10d        ;   no rusage"),
    ("0f 05", "syscall"),
    ("48 85 c0", "test rax, rax"),
    ("7f e5", "jg reap               ; one reaped: look again"),
    ("b8 80 00 00 00", "mov eax, 128          ; rt_sigtimedwait (none left, or ECHILD)"),
    ("48 89 e7", "mov rdi, rsp          ;   for SIGCHLD"),
    ("31 f6", "xor esi, esi          ;   no info"),
    ("31 d2", "xor edx, edx          ;   no timeout"),
    ("41 ba 08 00 00 00", "mov r10d, 8           ;   sizeof(sigset_t)"),
    ("0f 05", "syscall"),
    ("eb cf", "jmp reap"),
    # msg: (offset 0x7c)
    ("72 65 61 64 79 0a", "'ready\\n'"),
]


def elf_x86_64(code: bytes, bss: tuple[int, int] | None = None) -> bytes:
    """A static x86-64 executable: ``code`` loaded read-only and executable at
    ``BASE`` + headers, entered at its first byte; ``bss`` (address, size) adds
    zeroed read-write memory there (the launcher's). No library, no sections."""
    phnum = 2 if bss is None else 3
    entry = BASE + _EHDR + phnum * _PHDR
    size = _EHDR + phnum * _PHDR + len(code)
    ident = b"\x7fELF" + bytes([2, 1, 1, 0]) + bytes(8)  # 64-bit, little-endian, SysV
    header = ident + struct.pack(
        "<HHIQQQIHHHHHH",
        2,  # ET_EXEC
        0x3E,  # EM_X86_64
        1,  # EV_CURRENT
        entry,
        _EHDR,  # program headers right after this one
        0,  # no section headers
        0,
        _EHDR,
        _PHDR,
        phnum,
        0,
        0,
        0,
    )
    load = struct.pack("<IIQQQQQQ", 1, 5, 0, BASE, BASE, size, size, 0x1000)  # PT_LOAD, R+X
    stack = struct.pack("<IIQQQQQQ", 0x6474E551, 6, 0, 0, 0, 0, 0, 16)  # PT_GNU_STACK, RW
    if bss is not None:
        at, length = bss
        load += struct.pack("<IIQQQQQQ", 1, 6, 0, at, at, 0, length, 0x1000)  # PT_LOAD, RW, zeroes
    return header + load + stack + code


def _x86_64() -> bytes:
    return elf_x86_64(b"".join(bytes.fromhex(hexes) for hexes, _ in _X86_64_CODE))


def is_x86_64(machine: str | None = None) -> bool:
    machine = platform.machine() if machine is None else machine
    return machine in ("x86_64", "AMD64", "amd64")


def program(machine: str | None = None) -> bytes | None:
    """The init's ELF image for this machine, or None where there is none."""
    return _x86_64() if is_x86_64(machine) else None
