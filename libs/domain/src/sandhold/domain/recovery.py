"""The recovery service's decisions: a host is lost, its sandboxes with it.

A lost host's running commands end `infrastructure_lost` (it may have done
anything); commands dispatched but never confirmed as launched end `unknown`;
queued commands stay queued for the recovery; saves the host had not finished
fail and never count. Nothing reruns.
"""

from __future__ import annotations

from typing import Literal

from sandhold.domain import events as ev
from sandhold.domain.sandbox import ACTIVE_PHASES, LostInfo, Sandbox


def declare_lost(
    state: Sandbox | None,
    *,
    host: str,
    last_renewal_at: float,
    fence_at: float,
    cause: Literal["host", "files_gone"] = "host",
) -> list[ev.AnyEvent]:
    """`sandbox.lost` for a sandbox placed on `host`, once."""
    if state is None or state.host != host or state.phase not in ACTIVE_PHASES:
        return []
    return [
        ev.SandboxLost(
            host=host,
            generation=state.generation,
            last_renewal_at=last_renewal_at,
            fence_at=fence_at,
            cause=cause,
        )
    ]


def declare_lost_here(
    state: Sandbox | None,
    *,
    host: str,
    generation: int,
    last_renewal_at: float,
    fence_at: float,
    cause: Literal["host", "files_gone"] = "host",
) -> list[ev.AnyEvent]:
    """`sandbox.lost` said by its host itself: nothing of that placement runs
    there any more, fenced since `fence_at`. The host killed its processes in a
    fence (and came back with a new epoch before recovery judged it, so nobody
    else would say it), or found the sandbox's files gone. Either way recovery
    takes it from there: the commands' end states, then its last save."""
    if state is None or state.generation != generation:
        return []  # placed anew since: not the copy this host lost
    return declare_lost(
        state, host=host, last_renewal_at=last_renewal_at, fence_at=fence_at, cause=cause
    )


def after_loss(state: Sandbox | None) -> list[ev.AnyEvent]:
    """The end states a loss implies (level-triggered: safe to decide again)."""
    # Also after a stop or delete of the lost sandbox: the loss still decides
    # how the lost placement's commands and saves ended.
    if state is None or state.lost is None:
        return []
    lost = state.lost
    what = _what_was_lost(lost)
    events: list[ev.AnyEvent] = []
    for command in state.unended_commands():
        if command.generation != lost.generation:
            continue
        if command.state == "running":
            events.append(
                ev.CommandEnded(
                    command_id=command.id,
                    state="infrastructure_lost",
                    output_complete=False,
                    reason=f"{what} while the command ran; its kept output is "
                    "readable, newer output may be lost",
                    host=lost.host,
                    generation=lost.generation,
                )
            )
        elif command.state == "dispatched":
            events.append(
                ev.CommandEnded(
                    command_id=command.id,
                    state="unknown",
                    output_complete=False,
                    reason=f"{what} before the host confirmed that the "
                    "command started: treat it as possibly run",
                    host=lost.host,
                    generation=lost.generation,
                )
            )
    for save in state.saves_under_way():
        if save.generation == lost.generation and save.state in ("requested", "captured"):
            events.append(
                ev.SaveFailed(
                    save_id=save.id,
                    stage="interrupted",
                    reason=f"{what} during the save",
                    host=lost.host,
                    generation=lost.generation,
                )
            )
    return events


def _what_was_lost(lost: LostInfo) -> str:
    if lost.cause == "files_gone":
        return f"the sandbox's files went missing from host {lost.host}"
    return f"host {lost.host} failed"


def loss_pending(state: Sandbox | None) -> bool:
    """Whether recovery still has something to say of the sandbox's loss: that
    it is fenced, or the end states the loss implies. Once both are said, a
    lost sandbox (one nobody brings back: lazy recovery) needs nothing more."""
    return (
        state is not None
        and state.lost is not None
        and (not state.lost.fenced or bool(after_loss(state)))
    )


def declare_fenced(state: Sandbox | None, *, host: str) -> list[ev.AnyEvent]:
    if state is None or state.lost is None or state.lost.host != host or state.lost.fenced:
        return []
    return [ev.SandboxFenced(host=host, generation=state.lost.generation)]
