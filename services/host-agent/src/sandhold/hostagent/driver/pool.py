"""Warm supervisors and their doorbells.

Starting Python costs 20-40 ms, more than the whole exec round trip may take,
so supervisors are started ahead of need and wait for a command on stdin;
and one whose command ended is given back to wait for the next (decision 088).
They are not the agent's children (forked by the zygote, which reaps them, or
detached by a second fork), each in its own session: nothing for the agent to
reap, nothing killed when the agent exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPERVISOR_MODULE = "sandhold.hostagent.driver.supervisor"
ZYGOTE_MODULE = "sandhold.hostagent.driver.zygote"
_ANNOUNCE_LIMIT = 64

log = logging.getLogger(__name__)


class SupervisorStartError(RuntimeError):
    """A supervisor process could not be started."""


# How long a supervisor may take to read its command's line.
HAND_OVER_S = 10.0


@dataclass
class WarmSupervisor:
    """An idle supervisor: its pid, the write end of its stdin, its doorbell pipe,
    and how many commands it was handed."""

    pid: int
    stdin_fd: int
    doorbell_fd: int
    handed: int = 0
    # While a hand-over waits for the pipe to drain: what wakes it.
    _drained: asyncio.Future[None] | None = field(default=None, repr=False)

    async def hand_over(
        self,
        command_dir: Path,
        spec: dict[str, Any],
        secrets: dict[str, str] | None = None,
    ) -> None:
        """Give it its command: its directory, its spec (as `spec.json` has it,
        not read back from there), and its secrets, which exist nowhere else on
        this host; raises BrokenPipeError (its stdin closed) if it died while
        idle or will take no more, or did not take the whole line within
        `HAND_OVER_S` (then it is let go). Its stdin stays open: given back once
        its command ended, it takes the next one (decision 088)."""
        if self.stdin_fd < 0:
            raise BrokenPipeError(f"supervisor {self.pid} was let go")
        handed = {"command_dir": str(command_dir), "spec": spec, "secrets": secrets or {}}
        line = json.dumps(handed).encode()
        line += b"\n"
        view = memoryview(line)
        try:
            # A line longer than the pipe's buffer (big secrets) goes in parts as
            # the supervisor reads them; one given back may still be finishing its
            # last command (its directory's fsync). Waited for on the loop, never
            # in a blocking write (the pipe is non-blocking, `_announced`): a
            # supervisor that does not read holds up this command alone, not the
            # agent (its lease, every other sandbox).
            async with asyncio.timeout(HAND_OVER_S):
                while view:
                    try:
                        view = view[os.write(self.stdin_fd, view) :]
                    except BlockingIOError:
                        await self._drain()
        except TimeoutError:
            # (A part of the line, then EOF: it takes no command and exits.)
            log.warning("supervisor %d took no command in %.1f s: let go", self.pid, HAND_OVER_S)
            self.let_go()
            raise BrokenPipeError(f"supervisor {self.pid} took no command") from None
        except (BrokenPipeError, asyncio.CancelledError):
            self.let_go()  # (cancelled: what it has of the line is no command)
            raise
        self.handed += 1

    async def _drain(self) -> None:
        """Until its stdin can take more (or it is let go: BrokenPipeError)."""
        loop = asyncio.get_running_loop()
        drained: asyncio.Future[None] = loop.create_future()
        self._drained = drained

        def writable() -> None:
            if not drained.done():
                drained.set_result(None)

        loop.add_writer(self.stdin_fd, writable)
        try:
            await drained
        finally:
            self._stop_waiting(loop)

    def _stop_waiting(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        drained, self._drained = self._drained, None
        if drained is None:
            return
        # (Before its descriptor is closed: a loop must not watch a closed one.)
        (loop or drained.get_loop()).remove_writer(self.stdin_fd)
        if not drained.done():
            drained.set_exception(BrokenPipeError(f"supervisor {self.pid} was let go"))

    def let_go(self) -> None:
        """EOF on its stdin: it exits once idle (at once if it is), and is never
        handed another command. Its doorbell stays with whoever listens to it."""
        self._stop_waiting()
        with contextlib.suppress(OSError):
            os.close(self.stdin_fd)
        self.stdin_fd = -1

    def dismiss(self) -> None:
        """Let it go: EOF on its stdin makes an idle supervisor exit."""
        self.let_go()
        with contextlib.suppress(OSError):
            os.close(self.doorbell_fd)


class Zygote:
    """A pre-imported process that forks supervisors (see `zygote.py`)."""

    def __init__(self, root: Path) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        argv = [sys.executable, "-m", ZYGOTE_MODULE, "--root", str(root)]
        null = os.open(os.devnull, os.O_RDWR)
        try:
            self.pid = os.posix_spawn(
                sys.executable,
                argv,
                os.environ,
                file_actions=[
                    (os.POSIX_SPAWN_DUP2, null, 0),
                    (os.POSIX_SPAWN_DUP2, null, 1),
                    (os.POSIX_SPAWN_DUP2, null, 2),
                    (os.POSIX_SPAWN_DUP2, theirs.fileno(), 3),
                ],
                setsid=True,
            )
        finally:
            os.close(null)
            theirs.close()
        self._control = ours
        self._lock = threading.Lock()

    def fork_supervisor(self, fds: list[int]) -> bool:
        """Ask for one supervisor on these descriptors; False if the zygote is gone."""
        with self._lock:
            try:
                socket.send_fds(self._control, [b"s"], fds)
                return True
            except OSError:
                return False

    def start_box(self, spec_path: Path) -> str | None:
        """Start a box from its spec (blocking); what the starter said, None if no zygote."""
        report_r, report_w = os.pipe()
        try:
            with self._lock:
                try:
                    socket.send_fds(self._control, [b"b" + str(spec_path).encode()], [report_w])
                except OSError:
                    return None
        finally:
            os.close(report_w)
        said = []
        with os.fdopen(report_r, "rb") as report:  # EOF: the starter is done
            said.append(report.read())
        return b"".join(said).decode(errors="replace")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._control.close()
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(self.pid, 0)


def spawn_supervisor(
    root: Path, zygote: Zygote | None = None, open_files: int | None = None
) -> WarmSupervisor:
    """Start one supervisor and wait until it has announced itself (blocking).

    Forked by the zygote when there is one (milliseconds), else started as a
    new interpreter (tens of milliseconds of CPU), told `open_files`: the
    soft limit its commands get where the agent raised its own.
    """
    stdin_r, stdin_w = os.pipe()
    bell_r, bell_w = os.pipe()
    err_r, err_w = os.pipe()
    argv = [sys.executable, "-m", SUPERVISOR_MODULE, "--root", str(root)]
    if open_files is not None:
        argv += ["--open-files", str(open_files)]
    launcher = None
    if zygote is not None and zygote.fork_supervisor([stdin_r, bell_w, err_w]):
        for fd in (stdin_r, bell_w, err_w):
            os.close(fd)
        return _announced(None, stdin_w, bell_r, err_r)
    try:
        launcher = os.posix_spawn(
            sys.executable,
            argv,
            os.environ,
            file_actions=[
                (os.POSIX_SPAWN_DUP2, stdin_r, 0),
                (os.POSIX_SPAWN_DUP2, bell_w, 1),
                (os.POSIX_SPAWN_DUP2, err_w, 2),
            ],
            setsid=True,
        )
    except OSError as err:
        for fd in (stdin_r, stdin_w, bell_r, bell_w, err_r, err_w):
            os.close(fd)
        raise SupervisorStartError(f"cannot spawn {sys.executable}: {err}") from err
    for fd in (stdin_r, bell_w, err_w):
        os.close(fd)
    return _announced(launcher, stdin_w, bell_r, err_r)


def _announced(launcher: int | None, stdin_w: int, bell_r: int, err_r: int) -> WarmSupervisor:
    announced = b""
    while not announced.endswith(b"\n") and len(announced) < _ANNOUNCE_LIMIT:
        piece = os.read(bell_r, _ANNOUNCE_LIMIT)
        if not piece:
            break
        announced += piece
    if launcher is not None:
        os.waitpid(launcher, 0)  # the intermediate process that forked the supervisor
    if not announced.endswith(b"\n"):
        errors = os.read(err_r, 8192).decode(errors="replace").strip()
        for fd in (stdin_w, bell_r, err_r):
            os.close(fd)
        raise SupervisorStartError(f"supervisor did not start: {errors or 'no output'}")
    os.close(err_r)
    os.set_blocking(bell_r, False)
    os.set_blocking(stdin_w, False)
    return WarmSupervisor(int(announced), stdin_w, bell_r)


# A supervisor given back serves at most this many commands, then is let go:
# whatever a long life may gather (fragmented memory, a command's secrets left
# in freed memory) goes with a fresh one from the zygote.
COMMANDS_PER_SUPERVISOR = 100
# Supervisors given back are kept idle up to this many times the pool's size,
# for bursts of commands; beyond, they are let go.
KEEP_GIVEN_BACK = 4


class SupervisorPool:
    """Keeps ``size`` idle supervisors ready, refilling in the background, and
    takes back those whose command ended (decision 088).

    A refill starts only once no idle supervisor is left: one given back is
    idle again by the time the next command of a client that runs them one
    after another comes, so such a client costs no fork at all."""

    def __init__(self, root: Path, size: int) -> None:
        self._root = root
        self._size = size
        self._idle: list[WarmSupervisor] = []
        self._spawning: set[asyncio.Task[None]] = set()
        self._closed = False
        # Threads of the pool's own: a refill must never queue behind the
        # default executor's long jobs (64 saves' captures and hashing), or the
        # next command waits for a supervisor (docs/benchmarks.md (m)).
        self._threads = ThreadPoolExecutor(max_workers=2, thread_name_prefix="supervisor-spawn")
        self._zygote: Zygote | None = None
        # The soft limit of open files commands get, where the agent raised its
        # own after the zygote started (one started without it is told).
        self.open_files: int | None = None

    async def start(self) -> None:
        """Fill the pool; a supervisor that cannot start fails here, loudly."""
        try:
            self._zygote = Zygote(self._root)
        except OSError as err:  # supervisors are then started one interpreter each
            log.warning("no zygote for supervisors: %s", err)
        spawned = await asyncio.gather(*(self._spawn() for _ in range(self._size)))
        self._idle.extend(spawned)

    @property
    def idle(self) -> int:
        """Supervisors waiting for a command now: started ahead (the size at
        most), or given back (up to KEEP_GIVEN_BACK times the size)."""
        return len(self._idle)

    async def take(self) -> WarmSupervisor:
        """An idle supervisor; else one already starting; else a fresh one."""
        while not self._closed:
            if self._idle:
                supervisor = self._idle.pop()
                self._top_up()
                return supervisor
            if not self._spawning:
                break
            await asyncio.wait(set(self._spawning), return_when=asyncio.FIRST_COMPLETED)
        if self._closed:
            raise SupervisorStartError("the supervisor pool is closed")
        supervisor = await self._spawn()
        self._top_up()
        return supervisor

    def give_back(self, supervisor: WarmSupervisor) -> None:
        """A supervisor whose command ended (its exit recorded), to serve the next."""
        if (
            self._closed
            or supervisor.stdin_fd < 0  # (let go: it takes no command)
            or supervisor.handed >= COMMANDS_PER_SUPERVISOR
            or len(self._idle) >= KEEP_GIVEN_BACK * self._size
        ):
            supervisor.dismiss()
            return
        self._idle.append(supervisor)

    def _top_up(self) -> None:
        if self._idle:
            return  # (one given back will be idle again soon enough)
        for _ in range(self._size - len(self._spawning)):
            task = asyncio.create_task(self._spawn_one(), name="supervisor-pool-refill")
            self._spawning.add(task)
            task.add_done_callback(self._spawning.discard)

    async def _spawn_one(self) -> None:
        try:
            supervisor = await self._spawn()
        except SupervisorStartError:
            # take() then starts one itself and surfaces the error there.
            log.exception("refilling the supervisor pool failed")
            return
        if self._closed:
            supervisor.dismiss()
        else:
            self._idle.append(supervisor)

    def start_box(self, spec_path: Path) -> str | None:
        """Through the zygote (see ``Zygote.start_box``); None where there is none."""
        return None if self._zygote is None else self._zygote.start_box(spec_path)

    def _spawn(self) -> asyncio.Future[WarmSupervisor]:
        return asyncio.get_running_loop().run_in_executor(
            self._threads, spawn_supervisor, self._root, self._zygote, self.open_files
        )

    async def close(self) -> None:
        self._closed = True
        # Not cancelled: a cancelled to_thread would leak the supervisor it is
        # starting. Each sees _closed and dismisses its own.
        await asyncio.gather(*self._spawning)
        while self._idle:
            self._idle.pop().dismiss()
        if self._zygote is not None:
            await asyncio.to_thread(self._zygote.close)
            self._zygote = None
        self._threads.shutdown(wait=False)


class Doorbell:
    """Wake-ups from a supervisor's stdout; EOF there means it has exited."""

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd
        self._loop = asyncio.get_running_loop()
        self._event = asyncio.Event()
        self.rings = 0
        self.hung_up = False
        self._loop.add_reader(fd, self._on_readable)

    @property
    def attached(self) -> bool:
        """Whether this bell still speaks for the supervisor (not closed by the driver)."""
        return self._fd is not None or self.hung_up

    def _on_readable(self) -> None:
        assert self._fd is not None
        try:
            data = os.read(self._fd, 4096)
        except BlockingIOError:
            return
        if not data:
            self.hung_up = True
            self._release()
        self._ring()

    def _ring(self) -> None:
        self.rings += 1
        self._event.set()
        self._event = asyncio.Event()

    def _release(self, *, close: bool = True) -> int | None:
        """Stop listening; the descriptor, if still open (`close=False`)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return None
        self._loop.remove_reader(fd)
        if close:
            os.close(fd)
            return None
        return fd

    def detach(self) -> None:
        """Stop listening (driver closing); the supervisor keeps running."""
        self._release()
        self._ring()

    def pass_on(self) -> int | None:
        """Stop listening, and the descriptor (still open) for the supervisor's
        next command's bell; None if it hung up or was detached."""
        if self.hung_up:
            return None
        fd = self._release(close=False)
        self._ring()
        return fd

    async def wait(self, seen: int, timeout_s: float) -> None:
        """Return once the bell rang after ``seen`` rings, or after ``timeout_s``."""
        if self.rings != seen:
            return
        event = self._event
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await event.wait()
