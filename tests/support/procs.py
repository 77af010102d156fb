"""Processes as the kernel sees them: a tree of descendants, alive or not."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path


def process_tree(root_pids: list[int]) -> list[int]:
    """Every live process whose parent chain reaches one of `root_pids` or that
    started a supervisor from this data dir."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    found, todo = [], list(root_pids)
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone, or going as we read
        return False


def stopped(pid: int) -> bool:
    """Whether every thread of process `pid` is stopped (state T): `kill()` of a
    SIGSTOP returns before all threads of a multi-threaded process stop."""
    states = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
        except (FileNotFoundError, IndexError):
            continue  # (a thread that just ended)
    return bool(states) and all(state in ("T", "t") for state in states)


def stop_all(procs: Sequence[subprocess.Popen[bytes]], *, grace_s: float) -> None:
    """SIGTERM to every process at once, then each gets `grace_s` to exit before
    SIGKILL: stopped by PID, whatever state the test left them in."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
