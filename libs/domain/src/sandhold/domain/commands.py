"""Command states: the words a user reads when a command ends."""

from __future__ import annotations

from typing import Literal, TypeGuard, get_args

CommandEndState = Literal[
    "exited",  # the program ended, with its exit_code
    "infrastructure_lost",  # the host failed while it ran
    "unknown",  # sandhold cannot establish what happened: treat as possibly run
    "not_launched",  # it never started, e.g. the sandbox stopped first
    "launch_failed",  # could not start: missing executable, bad working directory
    "timed_out",  # the caller's timeout passed; TERM, grace, then KILL
    "resource_exhausted",  # ran out of memory (the sandbox's cgroup limit)
    "interrupted",  # a Stop or an explicit cancel ended it
]
CommandState = Literal["queued", "dispatched", "running"] | CommandEndState

END_STATES: frozenset[str] = frozenset(get_args(CommandEndState))


def is_end_state(state: str) -> TypeGuard[CommandEndState]:
    return state in END_STATES
