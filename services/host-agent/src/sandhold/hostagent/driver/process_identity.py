"""A process named so that a recycled pid is never mistaken for it.

A supervisor outlives the agent and is found again by a pid written on disk.
After a long outage or a reboot that pid may belong to someone else; the start
time (in clock ticks since boot) and the boot id tell the two apart.
"""

from __future__ import annotations

import functools
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_PROC = Path("/proc")


def parse_stat(text: str) -> tuple[str, int]:
    """Return (state, start time in ticks) from a ``/proc/<pid>/stat`` line."""
    # comm (field 2) may itself contain spaces and parentheses.
    after_comm = text[text.rindex(")") + 2 :].split()
    return after_comm[0], int(after_comm[19])


@functools.cache  # a process never outlives its boot: read once
def boot_id() -> str:
    try:
        return (_PROC / "sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _stat(pid: int) -> tuple[str, int] | None:
    try:
        return parse_stat((_PROC / str(pid) / "stat").read_text())
    except (OSError, ValueError, IndexError):
        return None


@dataclass(frozen=True)
class ProcessIdentity:
    pid: int
    start_ticks: int
    boot_id: str

    @classmethod
    def of(cls, pid: int) -> ProcessIdentity | None:
        stat = _stat(pid)
        return None if stat is None else cls(pid, stat[1], boot_id())

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> ProcessIdentity:
        return cls(int(raw["pid"]), int(raw["start_ticks"]), str(raw["boot_id"]))

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "start_ticks": self.start_ticks, "boot_id": self.boot_id}

    def is_alive(self) -> bool:
        if self.boot_id != boot_id():
            return False
        stat = _stat(self.pid)
        # A zombie has finished its work; only its parent's wait is missing.
        return stat is not None and stat[1] == self.start_ticks and stat[0] not in ("Z", "X")

    def send(self, sig: signal.Signals) -> bool:
        """Signal the process if it is still this one; False if it is gone."""
        if not self.is_alive():
            return False
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            return False
        return True
