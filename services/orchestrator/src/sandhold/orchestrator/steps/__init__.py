"""Step executors: one module per step kind, behind one protocol.

A runner drives the pipeline (claiming, retrying, failing the task); what a
step *does* — start its command and watch it, or make its HTTP call — and how
it resumes after an orchestrator died in the middle of it, is its kind's
executor. Adding a kind is one action in the manifest (`task_manifest.py`),
one executor here, and its tests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from sandhold.domain import task as tk

if TYPE_CHECKING:
    from sandhold.orchestrator.runner import Runner


class StepExecutor(Protocol):
    kind: str

    async def run(
        self, runner: Runner, instance: tk.StepInstance, record: tk.StepRecord | None
    ) -> None:
        """One attempt of the step: claim (or resume a claimed one), act, and record
        its end (`task.step_finished` / `task.step_failed`) through the runner."""
        ...

    async def stop(self, runner: Runner, record: tk.StepRecord, *, why: str) -> None:
        """The task is ending (cancelled, timed out) while this step is in flight:
        stop what it started, if anything can be stopped."""
        ...


def executor(kind: str) -> StepExecutor:
    from sandhold.orchestrator.steps.agent import AgentStep
    from sandhold.orchestrator.steps.http import HttpStep

    executors: dict[str, StepExecutor] = {"agent": AgentStep(), "http": HttpStep()}
    return executors[kind]
