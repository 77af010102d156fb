"""A command's launcher: a static program of a few instructions that runs a list
of system calls it is handed, the last of them the command's ``execve``.

Why: a command in a box must join the box (its cgroups, namespaces, ids,
capabilities, no_new_privs, the seccomp filter) between its process's birth
and its exec. Done in Python (a ``preexec_fn``), that meant CPython's
after-fork work and the joins run by the interpreter in the child, which
touched (and so copied) hundreds of the supervisor's pages: ~2–4 ms per
command, on its path (decision 084). The supervisor now starts this program
with a plain ``subprocess.Popen`` (no Python in the child: a fork and an
exec; not a ``vfork``, which the kernel refuses into the box's pid
namespace), and this program does the joins.

The plan (`Plan`) comes on stdin, a memory file. The launcher reads it whole
into its buffer at ``BUFFER``, closes descriptor 0 (the plan's first step
opens the command's stdin there), and runs its steps in order: each step is
eight 64-bit words, the system call's number, its six arguments (addresses
point into the buffer, where the plan put its strings and arrays) and flags.
A step flagged ``FAIL`` that returns an error (or any step flagged ``LAST``
that returns) makes the launcher write the step's offset and the result to
the report descriptor (named in the buffer's first word, the header) and
exit with 127; a successful ``execve`` closes it (a step marks it
close-on-exec), so the supervisor reads end-of-file and knows the command
runs. Steps without ``FAIL`` that fail are passed over: the candidates of a
PATH search. The plan names descriptors by number: after the spawn the
child holds exactly 0–2 and the ones passed, so the one a step opens is the
lowest other number, known in advance.

The code is x86-64 only; elsewhere ``program()`` is None, and where it will
not run (``install`` proves it does) the host says so and the supervisor
joins the box in Python as before.
"""

from __future__ import annotations

import contextlib
import os
import struct
import subprocess
from dataclasses import dataclass, field
from typing import Any

from sandhold.hostagent.driver.box_init import elf_x86_64, is_x86_64

BUFFER = 0x10000000
BUFFER_SIZE = 4 << 20
STEP_SIZE = 64
MAX_STEPS = 255
DATA = BUFFER + (1 + MAX_STEPS) * STEP_SIZE  # after the header and the steps
FAIL, LAST = 1, 2

# x86-64 system call numbers.
SYS_OPEN, SYS_WRITE, SYS_CLOSE, SYS_FCNTL = 2, 1, 3, 72
SYS_EXECVE, SYS_CHDIR = 59, 80
SYS_SETGROUPS, SYS_SETRESUID, SYS_SETRESGID = 116, 117, 119
SYS_PRCTL, SYS_SETNS = 157, 308

# Each row: the bytes (or an opcode and the label its 8-bit jump goes to), the
# instruction. r12 counts the plan's bytes read, rbx points at the step.
_CODE: list[tuple[str, str] | tuple[str, str, str]] = [
    ("45 31 e4", "xor r12d, r12d        ; nothing read yet"),
    ("read:", ""),
    ("31 c0", "xor eax, eax           ; read"),
    ("31 ff", "xor edi, edi          ;   the plan, on stdin"),
    ("49 8d b4 24 00 00 00 10", "lea rsi, [r12+BUFFER] ;   after what came"),
    ("ba 00 00 40 00", "mov edx, BUFFER_SIZE  ;   4 MiB at most"),
    ("4c 29 e2", "sub rdx, r12          ;   what is left of it"),
    ("0f 05", "syscall"),
    ("48 85 c0", "test rax, rax"),
    ("7e", "read_done", "jle read_done         ; end of file (or an error)"),
    ("49 01 c4", "add r12, rax"),
    ("eb", "read", "jmp read"),
    ("read_done:", ""),
    ("78", "exit", "js exit               ; the plan unreadable: 127, no report"),
    ("b8 03 00 00 00", "mov eax, 3            ; close"),
    ("31 ff", "xor edi, edi          ;   the plan (a step opens the command's stdin)"),
    ("0f 05", "syscall"),
    ("bb 40 00 00 10", "mov ebx, BUFFER+64    ; the first step, after the header"),
    ("step:", ""),
    ("48 8b 03", "mov rax, [rbx]        ; number"),
    ("48 8b 7b 08", "mov rdi, [rbx+8]      ; arguments"),
    ("48 8b 73 10", "mov rsi, [rbx+16]"),
    ("48 8b 53 18", "mov rdx, [rbx+24]"),
    ("4c 8b 53 20", "mov r10, [rbx+32]"),
    ("4c 8b 43 28", "mov r8, [rbx+40]"),
    ("4c 8b 4b 30", "mov r9, [rbx+48]"),
    ("0f 05", "syscall"),
    ("48 8b 4b 38", "mov rcx, [rbx+56]     ; flags (syscall clobbered rcx)"),
    ("48 85 c0", "test rax, rax"),
    ("79", "done", "jns done              ; it worked"),
    ("f6 c1 01", "test cl, FAIL"),
    ("75", "report", "jnz report"),
    ("done:", ""),
    ("f6 c1 02", "test cl, LAST          ; nothing after this one"),
    ("75", "report", "jnz report"),
    ("48 83 c3 40", "add rbx, STEP_SIZE"),
    ("eb", "step", "jmp step"),
    ("report:", ""),
    ("48 89 43 08", "mov [rbx+8], rax      ; the result"),
    ("48 89 d8", "mov rax, rbx"),
    ("48 2d 00 00 00 10", "sub rax, BUFFER"),
    ("48 89 03", "mov [rbx], rax        ; the step's offset"),
    ("b8 01 00 00 00", "mov eax, 1            ; write"),
    ("8b 3c 25 00 00 00 10", "mov edi, [BUFFER]     ;   the report's descriptor (header)"),
    ("48 89 de", "mov rsi, rbx"),
    ("ba 10 00 00 00", "mov edx, 16"),
    ("0f 05", "syscall"),
    ("exit:", ""),
    ("b8 e7 00 00 00", "mov eax, 231          ; exit_group"),
    ("bf 7f 00 00 00", "mov edi, 127"),
    ("0f 05", "syscall"),
]


def _assemble() -> bytes:
    """The rows above as bytes, each 8-bit jump resolved to its label."""
    labels: dict[str, int] = {}
    at = 0
    for row in _CODE:
        if row[0].endswith(":"):
            labels[row[0][:-1]] = at
        else:
            at += len(bytes.fromhex(row[0])) + (1 if len(row) == 3 else 0)
    code = bytearray()
    for row in _CODE:
        if row[0].endswith(":"):
            continue
        code += bytes.fromhex(row[0])
        if len(row) == 3:
            offset = labels[row[1]] - (len(code) + 1)
            code += struct.pack("<b", offset)
    return bytes(code)


def program(machine: str | None = None) -> bytes | None:
    """The launcher's ELF image for this machine, or None where there is none."""
    return elf_x86_64(_assemble(), (BUFFER, BUFFER_SIZE)) if is_x86_64(machine) else None


def install(path: str) -> str:
    """Write the launcher to ``path`` (root's, read and execute only) and prove
    it runs here: a host root mounted ``noexec``, or a security module that
    refuses the exec, would fail every boxed command. Raises
    `LauncherUnavailable` saying why (or where this machine has none)."""
    image = program()
    if image is None:
        raise LauncherUnavailable("no launcher for this CPU")
    tmp = f"{path}.tmp"
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, 0o500)
        try:
            write_all(fd, image)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as err:
        raise LauncherUnavailable(f"cannot write {path}: {err.strerror}") from err
    _prove(path)
    return path


class LauncherUnavailable(RuntimeError):
    """The launcher cannot run on this host: boxed commands are joined in Python."""


def start(
    path: str, plan: bytes, pass_fds: tuple[int, ...], **popen: Any
) -> subprocess.Popen[bytes]:
    """Start the launcher at ``path`` on an encoded plan (on its stdin, a memory
    file), passing ``pass_fds`` at their own numbers; the plan names them so."""
    plan_fd = os.memfd_create("launch-plan", os.MFD_CLOEXEC)
    try:
        write_all(plan_fd, plan)
        os.lseek(plan_fd, 0, os.SEEK_SET)
        return subprocess.Popen([path], env={}, stdin=plan_fd, pass_fds=pass_fds, **popen)
    finally:
        os.close(plan_fd)


def _prove(path: str) -> None:
    """Run a plan of one step that reports itself: the launcher starts, reads
    its plan and reports as it should."""
    report_r, report_w = os.pipe()
    plan = Plan(report_w)
    plan.call(SYS_CHDIR, plan.string("/"), what="proof", flags=LAST)
    child: subprocess.Popen[bytes] | None = None
    try:
        child = start(path, plan.encode(), (report_w,))
    except OSError as err:
        raise LauncherUnavailable(f"cannot run {path}: {err.strerror}") from err
    finally:
        os.close(report_w)
        with os.fdopen(report_r, "rb") as report:
            said = report.read()
        if child is not None:
            child.wait()
    if plan.failure(said) != ("proof", 0) or child.returncode != 127:
        raise LauncherUnavailable(f"{path} did not run its plan (exit status {child.returncode})")


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


@dataclass
class Plan:
    """The steps a launcher runs, with the strings and arrays they point at."""

    report_fd: int
    steps: list[tuple[int, tuple[int, ...], int]] = field(default_factory=list)
    whats: list[str] = field(default_factory=list)  # each step's failure, in words
    data: bytearray = field(default_factory=bytearray)

    def put(self, raw: bytes) -> int:
        """Place ``raw`` in the buffer; its address there."""
        address = DATA + len(self.data)
        self.data += raw
        self.data += bytes(-len(self.data) % 8)
        return address

    def string(self, text: str | bytes) -> int:
        raw = text.encode() if isinstance(text, str) else text
        if b"\0" in raw:
            raise ValueError("a NUL byte in a string for the launcher")
        return self.put(raw + b"\0")

    def strings(self, texts: list[str]) -> int:
        """A NULL-terminated array of strings (argv, envp)."""
        addresses = [self.string(t) for t in texts]
        return self.put(struct.pack(f"<{len(addresses) + 1}Q", *addresses, 0))

    def call(self, number: int, *args: int, what: str, flags: int = FAIL) -> None:
        if len(self.steps) == MAX_STEPS:
            raise ValueError(f"more than {MAX_STEPS} launcher steps")
        self.steps.append((number, args, flags))
        self.whats.append(what)

    def encode(self) -> bytes:
        out = bytearray(struct.pack("<q", self.report_fd) + bytes(STEP_SIZE - 8))
        for number, args, flags in self.steps:
            padded = (*args, *(0,) * (6 - len(args)))
            out += struct.pack("<8q", number, *padded, flags)
        out += bytes(DATA - BUFFER - len(out))
        out += self.data
        if len(out) > BUFFER_SIZE:
            raise ValueError("the command's launch plan is larger than the launcher's buffer")
        return bytes(out)

    def failure(self, report: bytes) -> tuple[str, int] | None:
        """What the report says failed, and the error number; None if it is no
        report (the command was exec'd: nothing was written)."""
        if len(report) < 16:
            return None
        offset, result = struct.unpack("<qq", report[:16])
        index = offset // STEP_SIZE - 1
        if not 0 <= index < len(self.whats):
            return f"launcher reported step {index}", 0
        return self.whats[index], -result if result < 0 else 0
