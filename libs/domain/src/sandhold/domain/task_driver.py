"""Who drives a task: one orchestrator instance at a time, named in its log.

An instance starts a runner for a task only after appending its claim
(`task.driver_claimed`, a new epoch) behind the fence; every decision the
runner makes after that is checked against the task's latest claim. Two
instances racing for a task both decide on the same sequence: the fence lets
one append, the other re-reads and finds the task driven (decision 036).
"""

from __future__ import annotations

from collections.abc import Callable

from sandhold.domain import events as ev
from sandhold.domain.errors import Rejected
from sandhold.domain.task import Task

SUPERSEDED = "superseded"


def claim_driver(
    state: Task | None, instance: str, *, holding: int | None, live: Callable[[str], bool]
) -> list[ev.AnyEvent]:
    """`instance` claims the task, to drive it in a new epoch; `[]` when it drives
    it already in `holding` (the epoch this very process claimed).

    Its own name from an earlier process (or from before its lease lapsed) is
    taken over like any other: a fresh epoch, so whatever that one still runs is
    refused. Another instance's claim stands while `live` says it renews its lease.
    """
    if state is None:
        raise Rejected("task_not_found", "no such task")
    if state.terminal:
        raise Rejected("task_finished", f"task {state.id} already ended {state.state}")
    if state.driver == instance and holding == state.driver_epoch:
        return []
    if state.driver is not None and state.driver != instance and live(state.driver):
        raise Rejected(
            "driven_elsewhere",
            f"task {state.id} is driven by {state.driver} (epoch {state.driver_epoch}), "
            "whose lease is renewed",
        )
    return [ev.TaskDriverClaimed(driver=instance, epoch=state.driver_epoch + 1)]


def check_driver(state: Task, epoch: int) -> None:
    """A runner's decision stands only while its claim is the task's latest: one
    that was superseded (paused past its lease, cut off) writes nothing more."""
    if state.driver_epoch != epoch:
        raise Rejected(
            SUPERSEDED,
            f"task {state.id} is driven by {state.driver} in epoch {state.driver_epoch}; "
            f"epoch {epoch} is over",
        )
