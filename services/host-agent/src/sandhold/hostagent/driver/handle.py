"""A command seen from the agent: its output and its end, read from its files."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

from sandhold.hostagent.driver.layout import CommandPaths
from sandhold.hostagent.driver.pool import Doorbell, WarmSupervisor
from sandhold.hostagent.driver.process_identity import ProcessIdentity
from sandhold.hostagent.driver.records import (
    STREAMS,
    CommandExit,
    OutputChunk,
    Stream,
    read_exit,
    read_json,
    read_pid,
)

log = logging.getLogger(__name__)

CHUNK_BYTES = 64 * 1024
# Even with a doorbell, look at the files now and then: a lost wake-up must
# cost latency, never a hang.
_DOORBELL_FALLBACK_S = 1.0
# A command directory whose supervisor never recorded itself within this time
# was abandoned between the driver's mkdir and the hand-over (agent crash).
LAUNCH_CONFIRM_S = 5.0


class CommandHandle:
    """Follow one command, launched by this driver or adopted after a restart.

    Several watchers may follow the same handle; each reads the files itself.
    """

    def __init__(
        self, sandbox_id: str, command_id: str, paths: CommandPaths, *, poll_interval_s: float
    ) -> None:
        self.sandbox_id = sandbox_id
        self.command_id = command_id
        self.paths = paths
        self._poll_interval_s = poll_interval_s
        self._doorbell: Doorbell | None = None
        self._supervisor: WarmSupervisor | None = None  # launched here: to give back
        # True while this driver is between mkdir and the hand-over.
        self._launching = False
        # `watch` has read the exit record (its output may still be coming).
        self.exit_seen = False

    def __repr__(self) -> str:
        return f"CommandHandle({self.sandbox_id!r}, {self.command_id!r})"

    @property
    def adopted(self) -> bool:
        """Whether progress is learned by polling (no doorbell from the supervisor)."""
        return self._doorbell is None or not self._doorbell.attached

    @contextlib.contextmanager
    def launching(self) -> Iterator[None]:
        """While the driver hands the command over, a missing supervisor is not a death."""
        self._launching = True
        try:
            yield
        finally:
            self._launching = False

    def attach(self, doorbell: Doorbell, supervisor: WarmSupervisor | None = None) -> None:
        self._doorbell = doorbell
        self._supervisor = supervisor

    def detach(self) -> None:
        """Stop listening; the supervisor takes no command after this one."""
        if self._doorbell is not None:
            self._doorbell.detach()
        self.let_supervisor_go()

    def let_supervisor_go(self) -> None:
        """Its supervisor takes no command after this one (still heard until it exits)."""
        if self._supervisor is not None:
            self._supervisor.let_go()
            self._supervisor = None

    def give_back(self) -> WarmSupervisor | None:
        """The supervisor, to serve another command, once this one's exit is
        recorded and it is still there; else None (and detached as `detach`)."""
        supervisor, doorbell = self._supervisor, self._doorbell
        if supervisor is not None and doorbell is not None and self.exit_record() is not None:
            fd = doorbell.pass_on()
            if fd is not None:
                self._supervisor = None
                supervisor.doorbell_fd = fd
                return supervisor
        self.detach()
        return None

    def exit_record(self) -> CommandExit | None:
        """The exit as recorded so far, without waiting."""
        return read_exit(self.paths.exit)

    def supervisor(self) -> ProcessIdentity | None:
        try:
            raw = read_json(self.paths.supervisor)
        except ValueError:  # (written without an fsync: a power loss may empty it)
            return None
        return None if raw is None else ProcessIdentity.from_json(raw)

    def supervisor_alive(self) -> bool:
        if self._doorbell is not None and self._doorbell.attached:
            return not self._doorbell.hung_up
        identity = self.supervisor()
        if identity is not None:
            # (Alive, and still this command's: one serving the next command
            # since, decision 088, is gone as far as this one is concerned.)
            return identity.is_alive() and _logs_to(identity.pid, self.paths.log)
        if self._launching:
            return True
        try:
            age = time.time() - self.paths.spec.stat().st_mtime
        except FileNotFoundError:
            return False
        return age < LAUNCH_CONFIRM_S

    def _vanished(self) -> CommandExit:
        if self.supervisor() is None:
            detail = "launch was never confirmed: no supervisor took the command"
        else:
            detail = "supervisor vanished without an exit record"
        return CommandExit(reason="unknown", detail=detail)

    def _rings(self) -> int:
        return self._doorbell.rings if self._doorbell is not None else 0

    async def _wait(self, seen: int) -> None:
        if self._doorbell is not None and self._doorbell.attached and not self._doorbell.hung_up:
            await self._doorbell.wait(seen, _DOORBELL_FALLBACK_S)
        else:
            await asyncio.sleep(self._poll_interval_s)

    async def started(self) -> int | CommandExit:
        """The command's pid once it runs, or its end if it never ran (launch_failed)."""
        while True:
            seen = self._rings()
            alive = self.supervisor_alive()
            pid = read_pid(self.paths.pid)
            if pid is not None:
                return pid
            record = self.exit_record()
            if record is not None:
                return record
            if not alive:
                return self._vanished()
            await self._wait(seen)

    async def wait(self) -> CommandExit:
        """The end of the command, without reading its output."""
        while True:
            seen = self._rings()
            # Liveness first: an exit record written before death is then visible.
            alive = self.supervisor_alive()
            record = self.exit_record()
            if record is not None:
                return record
            if not alive:
                return self._vanished()
            await self._wait(seen)

    async def watch(
        self, offsets: dict[str, int] | None = None
    ) -> AsyncIterator[OutputChunk | CommandExit]:
        """Output from ``offsets`` on (64 KiB pieces at most), then the exit.

        The exit comes only after all output: the supervisor writes exit.json
        after the last output byte, and the files are read after exit.json.
        """
        positions = {"stdout": 0, "stderr": 0}
        positions.update(offsets or {})
        files: dict[str, int] = {}
        try:
            while True:
                seen = self._rings()
                alive = self.supervisor_alive()
                record = self.exit_record()
                self.exit_seen = record is not None
                for stream in STREAMS:
                    while chunk := self._read(files, stream, positions[stream]):
                        positions[stream] += len(chunk.data)
                        yield chunk
                if record is not None:
                    yield record
                    return
                if not alive:
                    yield self._vanished()
                    return
                await self._wait(seen)
        finally:
            for fd in files.values():
                os.close(fd)

    def _read(self, files: dict[str, int], stream: Stream, offset: int) -> OutputChunk | None:
        if stream not in files:
            try:
                files[stream] = os.open(self.paths.stream(stream), os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                return None
        data = os.pread(files[stream], CHUNK_BYTES, offset)
        return OutputChunk(stream, offset, data) if data else None

    def signal_supervisor(self, sig: signal.Signals) -> bool:
        """Signal the command's supervisor, unless it is done with this command:
        a supervisor serves one command after another (decision 088). Done when
        the exit is recorded, or when the supervisor's stderr is no longer this
        command's log (`_logs_to`; this command's directory may also be going,
        exit record first). The checks and the signal are one step of the
        driver's loop, and only that loop hands a supervisor its next command."""
        if self.exit_record() is not None:
            return False
        identity = self.supervisor()
        return (
            identity is not None and _logs_to(identity.pid, self.paths.log) and identity.send(sig)
        )


def _logs_to(pid: int, log_file: Path) -> bool:
    """Whether process `pid`'s stderr is the file `log_file` (the same inode): a
    supervisor's is the log of the command it runs now, and /dev/null between
    commands. Where this host will not let us look (a security module), True:
    its pid alone says, as before supervisors served several commands."""
    try:
        held, named = os.stat(f"/proc/{pid}/fd/2"), os.stat(log_file)
    except PermissionError as err:
        _cannot_look(err.strerror or str(err))
        return True
    except OSError:
        return False
    return (held.st_dev, held.st_ino) == (named.st_dev, named.st_ino)


@functools.cache
def _cannot_look(reason: str) -> None:
    log.warning("cannot look at a supervisor's stderr (%s): judged by its pid alone", reason)
