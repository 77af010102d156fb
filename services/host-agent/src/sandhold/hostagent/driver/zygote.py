"""A parent for supervisors that has already paid for its imports.

Starting a supervisor as a new Python process costs ~90 ms of CPU (the
interpreter and the supervisor's imports); on a small host that competes with
the very command being launched. This process imports the supervisor once and
then forks one per request: the agent sends three descriptors (the new
supervisor's stdin, doorbell and stderr) over a socketpair, the zygote forks, and
the child becomes what `python -m sandhold.hostagent.driver.supervisor` is once
started: own session, pid announced on the doorbell. It is forked once, not
twice as a supervisor started on its own detaches: the zygote reaps it when it
ends (on SIGCHLD), so nothing else ever has to. The second fork made a warm
supervisor cost 3.6 ms of CPU where it now costs 2.3 (a copy of the zygote's
page tables, then their teardown when the middle process exited), on every
command, on the cores the command's own path needs (decision 083).

It also starts sandbox boxes (message ``b<spec path>`` with one descriptor,
where the starter's complaints go): the box starter is Python too, and its
imports cost more than the rest of a sandbox's start.

The zygote exits when the agent closes its end; supervisors it made outlive it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys

from sandhold.hostagent.driver import box, supervisor

_CONTROL_FD = 3  # the socketpair end the agent passes in
_MESSAGE_LIMIT = 8192


def _become_supervisor(fds: list[int], control: socket.socket) -> int:
    os.setsid()
    for target, fd in zip((0, 1, 2), fds, strict=True):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    control.close()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    return supervisor.serve(detach=False)


def _reap(*_: object) -> None:
    """Collect every child that has ended: supervisors, and a box start's first fork."""
    while True:
        try:
            pid, _status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _start_box(spec_path: str, report: int, control: socket.socket) -> None:
    """Fork a box starter (twice: the zygote reaps only the first, at once)."""
    first = os.fork()
    if first == 0:
        code = 1
        try:
            if os.fork() == 0:
                control.close()
                os.dup2(report, 2)
                os.close(report)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                code = box.main([spec_path])
            else:
                code = 0
        finally:
            os._exit(code)
    os.close(report)
    # Waited for here, so the starter has forked when the agent hears from it;
    # `_reap` may have collected it first.
    with contextlib.suppress(ChildProcessError):
        os.waitpid(first, 0)


def main() -> int:
    control = socket.socket(fileno=_CONTROL_FD)
    signal.signal(signal.SIGHUP, lambda *_: None)
    signal.signal(signal.SIGCHLD, _reap)
    while True:
        try:
            message, fds, _flags, _addr = socket.recv_fds(control, _MESSAGE_LIMIT, 3)
        except (OSError, ValueError):
            return 0
        if not message:
            return 0  # the agent closed its end (or died)
        if message.startswith(b"b") and len(fds) == 1:
            _start_box(message[1:].decode(), fds[0], control)
            continue
        if len(fds) != 3:
            for fd in fds:
                os.close(fd)
            continue
        child = os.fork()
        if child == 0:
            code = 1
            try:
                code = _become_supervisor(fds, control)
            finally:
                os._exit(code)
        for fd in fds:
            os.close(fd)


if __name__ == "__main__":
    sys.exit(main())
