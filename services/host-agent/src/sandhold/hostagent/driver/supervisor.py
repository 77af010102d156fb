"""The supervisor: a process that runs one command at a time, independent of the agent.

Started warm by the driver (forked by the zygote, or ``python -m
sandhold.hostagent.driver.supervisor``), it announces its pid on stdout and
waits for one line on stdin naming a command directory, with the command's
spec (the driver's record of it is ``spec.json``) and secrets. Then it runs
the command, copies its output into files, enforces the timeout and
interrupts, and writes ``exit.json``. stdout stays a pipe to the agent: one
byte there (the doorbell) after every write tells the agent to look at the
files. If the agent is gone the doorbell is silently lost and the files
remain the truth. Then it waits for the next line: the driver gives a
supervisor whose command ended back to its pool (decision 088), and lets it
go by closing its stdin, on which it exits.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import resource
import selectors
import shutil
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from sandhold.hostagent.driver.cgroups import (
    join_self,
    parse_oom_kills,
    parse_pids,
    parse_pids_max_events,
)
from sandhold.hostagent.driver.disk import exhausted
from sandhold.hostagent.driver.joining import (
    BoxTarget,
    Joiner,
    launch_failure,
    launch_problem_inside,
)
from sandhold.hostagent.driver.launcher import start as launcher_start
from sandhold.hostagent.driver.layout import CommandPaths
from sandhold.hostagent.driver.process_identity import ProcessIdentity
from sandhold.hostagent.driver.records import (
    CommandExit,
    CommandSpec,
    ExitReason,
    read_json,
    write_atomically,
    write_json,
)
from sandhold.hostagent.driver.tmp_isolation import TmpIsolation

_READ_SIZE = 64 * 1024
# After the command exits, output still held by its background children is
# read for this long; then the pipes are closed and the exit is recorded.
_DRAIN_S = 0.5
_DOORBELL = 1
_OUTPUT_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC


def ring() -> None:
    """Wake the agent; never block and never fail, the agent may be gone."""
    with contextlib.suppress(OSError):
        os.write(_DOORBELL, b"!")


def launch_problem(spec: CommandSpec) -> str | None:
    """Why the command cannot start, in the words ``launch_failed`` reports."""
    if not spec.argv:
        return "empty command line"
    if not os.path.isdir(spec.cwd):
        return f"working directory does not exist: {spec.cwd}"
    program = spec.argv[0]
    if "/" in program:
        path = os.path.join(spec.cwd, program)
        if not os.path.exists(path):
            return f"executable not found: {program}"
        if os.path.isdir(path) or not os.access(path, os.X_OK):
            return f"not an executable file: {program}"
        return None
    if shutil.which(program, path=spec.env.get("PATH", os.defpath)) is None:
        return f"executable not found: {program}"
    return None


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 4096):
        chunks.append(chunk)
    return b"".join(chunks)


def _kill_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _program_dirs(spec: CommandSpec) -> list[str]:
    """The program's directory and the one above it (a venv or prefix: `bin/..`).

    A private /tmp would hide a program that lives under the host's /tmp (say
    a checkout there with its venv); these stay visible through it.
    """
    found = shutil.which(spec.argv[0], path=spec.env.get("PATH", os.defpath))
    if found is None:
        return []
    program_dir = os.path.dirname(os.path.realpath(found))
    unresolved_dir = os.path.dirname(os.path.abspath(found))
    return sorted(
        {program_dir, os.path.dirname(program_dir), unresolved_dir, os.path.dirname(unresolved_dir)}
    )


class Supervisor:
    def __init__(self, paths: CommandPaths, spec: CommandSpec, wakeup: int) -> None:
        self.paths = paths
        self.spec = spec
        self.wakeup = wakeup
        self.started_at = time.time()
        self.tmp_isolated = False
        self.tmp_detail = ""
        self.ending: ExitReason | None = None
        self.ending_detail = ""
        self.kill_at: float | None = None
        self.killed = False
        self.output_problem = ""
        # The command's own pid and process group (inside a box, not the child's).
        self.command_pid: int | None = None
        # Forks the process limit had refused before this command (where the
        # count is the sandbox's, not the command's own).
        self.refused_forks_before = self.refused_forks()

    # --- launch -----------------------------------------------------------

    def run(self) -> None:
        if self.spec.box is not None:
            self.run_in_box(Joiner(BoxTarget.from_json(self.spec.box)))
            return
        problem = launch_problem(self.spec)
        if problem is not None:
            self.finish(CommandExit(reason="launch_failed", detail=problem))
            return
        status_r, status_w = os.pipe()
        isolation = TmpIsolation() if self.spec.isolate_tmp else None
        child: subprocess.Popen[bytes] | None = None
        problem = ""  # as in run_in_box: set below when the child did not start
        try:
            child = subprocess.Popen(
                self.spec.argv,
                cwd=self.spec.cwd,
                env=self.spec.env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                preexec_fn=lambda: self._child_setup(isolation, status_w),
            )
        except subprocess.SubprocessError:
            problem = "child setup failed"
        except OSError as err:
            problem = f"cannot start {self.spec.argv[0]}: {err.strerror}"
        finally:
            # Closed before reading, so a child that wrote nothing yields EOF.
            os.close(status_w)
        status = os.read(status_r, 4096).decode(errors="replace")
        os.close(status_r)
        if child is None:
            if status.startswith("F"):
                problem = status[1:]
            self.finish(CommandExit(reason="launch_failed", detail=problem))
            return
        self.tmp_isolated = status.startswith("T")
        self.tmp_detail = status[1:]
        self.started(child, child.pid)

    def started(self, child: subprocess.Popen[bytes], command_pid: int) -> None:
        self.command_pid = command_pid
        write_atomically(self.paths.pid, f"{command_pid}\n".encode(), durable=False)
        ring()
        self.relay(child)
        self.finish(self.exit_record(child))

    def run_in_box(self, joiner: Joiner) -> None:
        """Run the command inside its sandbox's box (see ``joining``).

        The supervisor joins the box's pid namespace itself, which applies to
        its children only: the command is born inside it, as the supervisor's
        own child, so its exit status and process group are the supervisor's
        to see, as for a command on the host.
        """
        if (problem := joiner.open_box() or joiner.join_pid_namespace()) is not None:
            joiner.close()  # (this process serves more commands: no box is kept open)
            self.finish(CommandExit(reason="launch_failed", detail=problem))
            return
        if joiner.target.launcher is not None:
            self.run_launched(joiner, joiner.target.launcher)
            return
        status_r, status_w = os.pipe()
        child: subprocess.Popen[bytes] | None = None
        problem = ""
        try:
            child = subprocess.Popen(
                self.spec.argv,
                env=self.spec.env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                preexec_fn=lambda: self._enter_box(joiner, status_w),
            )
        except subprocess.SubprocessError:
            problem = "entering the sandbox failed"
        except OSError as err:
            problem = f"cannot start {self.spec.argv[0]}: {err.strerror}"
        finally:
            os.close(status_w)
            joiner.close()
        status = _read_all(status_r).decode(errors="replace")
        os.close(status_r)
        if child is None or status.startswith("F"):
            self.finish(CommandExit(reason="launch_failed", detail=status[1:] or problem))
            return
        self.tmp_isolated = True
        self.started(child, child.pid)

    def run_launched(self, joiner: Joiner, launcher: str) -> None:
        """Start the command through the host's launcher (launcher.py), which
        joins the box as `_enter_box` would, with no Python in the child."""
        child: subprocess.Popen[bytes] | None = None
        problem = ""
        try:
            report_r, report_w = os.pipe()
        except OSError as err:
            joiner.close()
            self.finish(CommandExit(reason="launch_failed", detail=f"a pipe: {err.strerror}"))
            return
        try:
            if not self.spec.argv:
                raise ValueError("empty command line")
            plan = joiner.plan(
                self.spec.argv, self.spec.cwd, self.spec.env, self.spec.cgroup_procs, report_w
            )
            encoded = plan.encode()
        except (ValueError, struct.error) as err:  # a NUL in the command, a plan too large
            problem = str(err) if not self.spec.argv else f"cannot start {self.spec.argv[0]}: {err}"
        else:
            try:
                child = launcher_start(
                    launcher,
                    encoded,
                    (report_w, *joiner.namespace_fds()),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,
                )
            except OSError as err:
                problem = f"cannot start the launcher {launcher}: {err.strerror}"
        finally:
            os.close(report_w)
            joiner.close()
        report = _read_all(report_r)
        os.close(report_r)
        if child is not None:
            failure = plan.failure(report)
            if failure is None:
                self.tmp_isolated = True
                self.started(child, child.pid)
                return
            problem = launch_failure(*failure, self.spec.argv, self.spec.cwd)
            child.wait()
            for pipe in (child.stdout, child.stderr):
                if pipe is not None:
                    pipe.close()
        self.finish(CommandExit(reason="launch_failed", detail=problem))

    def _enter_box(self, joiner: Joiner, status_w: int) -> None:
        """Runs in the child between fork and exec (in the box's pid namespace already)."""

        def fail(reason: str) -> None:
            os.write(status_w, f"F{reason}".encode())
            raise RuntimeError(reason)

        if (
            problem := self._join_cgroups()
        ) is not None:  # our pid in the box: cgroupfs reads it so
            fail(problem)
        if (problem := joiner.enter()) is not None:
            fail(problem)
        if problem := launch_problem_inside(self.spec.argv, self.spec.cwd, self.spec.env):
            fail(problem)
        if (problem := joiner.install_filter()) is not None:
            fail(problem)

    def _join_cgroups(self) -> str | None:
        """In the child: join the command's cgroups; why not, if it failed."""
        return join_self(self.spec.cgroup_procs)

    def _child_setup(self, isolation: TmpIsolation | None, status_w: int) -> None:
        """Runs in the child between fork and exec: join cgroups, private /tmp."""
        if (problem := self._join_cgroups()) is not None:
            os.write(status_w, f"F{problem}".encode())
            raise OSError(problem)
        if isolation is None:
            os.write(status_w, b"Nprivate /tmp disabled")
            return
        reason = isolation.isolate(
            [*self.spec.keep_visible, self.spec.cwd, *_program_dirs(self.spec)]
        )
        os.write(status_w, b"T" if reason is None else f"N{reason}".encode())

    # --- relay and end ------------------------------------------------------

    def relay(self, child: subprocess.Popen[bytes]) -> None:
        assert child.stdout is not None and child.stderr is not None
        outputs = {
            child.stdout.fileno(): os.open(self.paths.stdout, _OUTPUT_FLAGS, 0o644),
            child.stderr.fileno(): os.open(self.paths.stderr, _OUTPUT_FLAGS, 0o644),
        }
        selector = selectors.DefaultSelector()
        for fd in outputs:
            os.set_blocking(fd, False)
            selector.register(fd, selectors.EVENT_READ)
        selector.register(self.wakeup, selectors.EVENT_READ)
        timeout_at = None if self.spec.timeout_s is None else time.monotonic() + self.spec.timeout_s
        drain_until: float | None = None
        while True:
            now = time.monotonic()
            if timeout_at is not None and now >= timeout_at and child.returncode is None:
                timeout_at = None
                self.begin_ending(child, "timed_out", self.spec.kill_grace_s)
            if self.kill_at is not None and now >= self.kill_at and not self.killed:
                self.kill_everything(self.command_pid or child.pid)
            if child.returncode is None and child.poll() is not None:
                drain_until = max(now, self.kill_at or 0.0) + _DRAIN_S
            if drain_until is not None and (len(outputs) == 0 or now >= drain_until):
                break
            kill_at = None if self.killed else self.kill_at
            timers = [t for t in (timeout_at, kill_at, drain_until) if t is not None]
            wait = max(0.0, min(timers) - now) if timers else None
            for key, _ in selector.select(wait):
                fd = int(key.fd)
                if fd == self.wakeup:
                    self.handle_signals(child)
                    continue
                data = os.read(fd, _READ_SIZE)
                if data:
                    self.record_output(outputs[fd], data)
                    ring()
                else:
                    selector.unregister(fd)
                    os.close(outputs.pop(fd))
        for fd, out in outputs.items():
            selector.unregister(fd)
            os.close(out)
        selector.close()
        child.stdout.close()
        child.stderr.close()

    def record_output(self, out: int, data: bytes) -> None:
        # On a full disk the command keeps running (its pipe is still read),
        # and its end says what was lost rather than the supervisor dying.
        if self.output_problem:
            return
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(out, view) :]
        except OSError as err:
            self.output_problem = f"output not recorded from here on: {err.strerror}"

    def handle_signals(self, child: subprocess.Popen[bytes]) -> None:
        try:
            received = os.read(self.wakeup, 256)
        except BlockingIOError:
            return
        if {signal.SIGUSR1, signal.SIGTERM} & set(received) and child.returncode is None:
            grace = self.spec.kill_grace_s
            with contextlib.suppress(OSError, ValueError, TypeError):
                grace = float((read_json(self.paths.interrupt) or {}).get("grace_s", grace))
            self.begin_ending(child, "interrupted", grace)

    def begin_ending(
        self, child: subprocess.Popen[bytes], reason: ExitReason, grace: float
    ) -> None:
        """TERM to the process group now, KILL after the grace; first reason wins."""
        if self.ending is not None:
            return
        self.ending = reason
        what = "timeout passed" if reason == "timed_out" else "interrupt requested"
        self.ending_detail = f"{what}: SIGTERM sent, SIGKILL after {grace:g}s"
        _kill_group(self.command_pid or child.pid, signal.SIGTERM)
        self.kill_at = time.monotonic() + grace

    def kill_everything(self, pgid: int) -> None:
        self.killed = True
        _kill_group(pgid, signal.SIGKILL)
        # The cgroup also reaches processes that left the process group.
        for procs in self.spec.own_cgroup_procs or self.spec.cgroup_procs:
            with contextlib.suppress(OSError):
                for pid in parse_pids(Path(procs).read_text()):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)

    def refused_forks(self) -> int:
        if self.spec.pids_file is None:
            return 0
        with contextlib.suppress(OSError, ValueError):
            return parse_pids_max_events(Path(self.spec.pids_file).read_text())
        return 0

    def full_disk(self) -> str | None:
        return None if self.spec.disk_dir is None else exhausted(self.spec.disk_dir)

    def exit_record(self, child: subprocess.Popen[bytes]) -> CommandExit:
        code = child.returncode
        assert code is not None
        oom_kills = 0
        if self.spec.oom_file is not None:
            with contextlib.suppress(OSError, ValueError):
                counted = parse_oom_kills(Path(self.spec.oom_file).read_text())
                oom_kills = max(0, counted - self.spec.oom_kills_before)
        refused = self.refused_forks() - self.refused_forks_before
        exit_code, sig = (code, None) if code >= 0 else (None, -code)
        if oom_kills:
            reason: ExitReason = "resource_exhausted"
            detail = f"out of memory: {oom_kills} process(es) of the command were OOM-killed"
        elif refused and self.ending is None and code != 0:
            # A command that still succeeded despite a refused fork exited; one
            # that failed after its forks were refused ran out of processes.
            reason = "resource_exhausted"
            detail = f"process limit (pids) reached: {refused} fork(s) refused"
        elif self.ending is None and code != 0 and (full := self.full_disk()) is not None:
            reason, detail = "resource_exhausted", full
        elif self.ending is not None:
            reason, detail = self.ending, self.ending_detail
        else:
            reason = "exited"
            detail = "" if sig is None else f"killed by {signal.Signals(sig).name}"
        if self.output_problem:
            detail = f"{detail}; {self.output_problem}" if detail else self.output_problem
        return CommandExit(
            reason=reason, exit_code=exit_code, signal=sig, detail=detail,
            oom_kills=oom_kills, pid=self.command_pid or child.pid,
        )  # fmt: skip

    def finish(self, record: CommandExit) -> None:
        final = CommandExit(
            **{
                **record.to_json(),
                "started_at": self.started_at,
                "ended_at": time.time(),
                "tmp_isolated": self.tmp_isolated,
                "tmp_detail": self.tmp_detail,
            }
        )
        told = False

        def tell() -> None:
            nonlocal told
            ring()
            told = True

        # The agent is told once the whole record is in place, before its fsyncs
        # (decisions 091, 094): it reports the end to the log, which is what
        # counts, while this process makes the record durable. On this
        # machine's disk the fsyncs took ~1.7 ms under load, on every
        # command's way to `command.ended`, competing with the log's own.
        try:
            write_json(self.paths.exit, final.to_json(), durable=True, placed=tell)
        except OSError as err:
            if not told:
                raise
            # Told, and perhaps handed its next command already: that one is
            # still served. Only the record may not survive a power loss.
            print(f"the exit record was not synced: {err}", file=sys.stderr)


# --- process setup ----------------------------------------------------------


def _detach() -> None:
    """Fork once more so that the agent never has to reap us (started on our own)."""
    if os.fork() > 0:
        os._exit(0)


def _signals() -> int:
    """Route SIGUSR1/SIGTERM/SIGCHLD into a pipe the relay loop selects on."""
    wakeup_r, wakeup_w = os.pipe()
    os.set_blocking(wakeup_r, False)
    os.set_blocking(wakeup_w, False)
    for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGCHLD):
        signal.signal(sig, lambda *_: None)
    signal.set_wakeup_fd(wakeup_w, warn_on_full_buffer=False)
    return wakeup_r


def serve(*, detach: bool = True, open_files: int | None = None) -> int:
    """Wait for a command and supervise it, then for the next one, until the
    driver closes our stdin (decision 088: a supervisor the driver gives back
    serves another command, so most commands cost no fork, no copy of the
    zygote's pages and no exit). `detach=False` where the parent (the zygote)
    reaps us itself."""
    # A handler rather than SIG_IGN: ignored signals would be inherited by the command.
    signal.signal(signal.SIGHUP, lambda *_: None)
    if open_files is not None:  # started by an agent that raised its own limit
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, hard))
    if detach:
        _detach()
    os.write(_DOORBELL, f"{os.getpid()}\n".encode())
    identity = ProcessIdentity.of(os.getpid())  # (while waiting: it needs no command)
    assert identity is not None
    # Commands come on a descriptor of our own, not inherited by them; 0 is /dev/null.
    commands = os.fdopen(os.dup(0), "rb")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    null_err = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
    wakeup: int | None = None
    for line in command_lines(commands):
        if wakeup is None:  # (once there is a command: an unused one exits quietly)
            os.set_blocking(_DOORBELL, False)
            wakeup = _signals()
        _drain(wakeup)
        handed = json.loads(line)
        del line  # (the secrets: in the spec's environment only, for this command)
        _supervise(handed, identity, wakeup, commands)
        del handed
        # Between commands stderr is no command's log: that it is one's says this
        # process runs that command now (`handle._logs_to`), not that it did.
        os.dup2(null_err, 2)
    return 0  # the driver let us go: unused, or done with our last command


def command_lines(commands: BinaryIO) -> Iterator[bytes]:
    """The commands' lines as the driver hands them over, until EOF. A part of
    a line and then EOF (a hand-over cut short, its supervisor let go midway,
    `pool.WarmSupervisor.hand_over`) is no command, even where the part is a
    whole JSON object."""
    while (line := commands.readline()).endswith(b"\n"):
        yield line


def _drain(wakeup: int) -> None:
    """Forget signals that came before this command: an interrupt of the one
    before, sent as it ended, is not this one's (the driver hands a command over
    only after it saw the previous one's exit, and a signal sent before that is
    taken before the hand-over's line is read)."""
    with contextlib.suppress(BlockingIOError):
        while os.read(wakeup, 256):
            pass


def _supervise(
    handed: dict[str, Any], identity: ProcessIdentity, wakeup: int, commands: BinaryIO
) -> None:
    paths = CommandPaths(Path(handed["command_dir"]))
    log = os.open(paths.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
    os.dup2(log, 2)
    os.close(log)
    write_json(paths.supervisor, identity.to_json())
    spec = CommandSpec.from_json(handed["spec"])
    # Secrets came through the pipe: into the command's environment, in memory only.
    secrets = handed.get("secrets") or {}
    spec = dataclasses.replace(spec, env={**spec.env, **secrets})
    del handed, secrets
    supervisor = Supervisor(paths, spec, wakeup)
    try:
        supervisor.run()
    except BaseException as err:
        # No command after this one: closed before the exit is recorded (which
        # is when the driver would give us back), a hand-over fails at once.
        commands.close()
        if not paths.exit.exists():
            detail = f"supervisor failed: {type(err).__name__}: {err}"
            supervisor.finish(CommandExit(reason="unknown", detail=detail))
        raise


def probe_tmp() -> int:
    """Report whether a private /tmp works here (run as a throwaway process)."""
    reason = TmpIsolation().isolate([])
    print(json.dumps({"tmp_isolation": reason is None, "detail": reason or ""}))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sandhold-supervisor")
    # Only there so that `ps` (and test cleanup) can tell whose supervisor this is.
    parser.add_argument("--root", default="")
    parser.add_argument("--probe-tmp", action="store_true")
    parser.add_argument("--open-files", type=int, default=None)
    args = parser.parse_args(argv)
    return probe_tmp() if args.probe_tmp else serve(open_files=args.open_files)


if __name__ == "__main__":
    sys.exit(main())
