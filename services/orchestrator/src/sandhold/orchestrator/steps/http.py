"""Tool steps: one HTTP call, delivered at least or at most once."""

from __future__ import annotations

import http.client
import logging
from typing import TYPE_CHECKING

from sandhold.domain import events as ev
from sandhold.domain import task as tk
from sandhold.domain import task_policy as policy
from sandhold.orchestrator.faults import fault

if TYPE_CHECKING:
    from sandhold.orchestrator.runner import Runner

log = logging.getLogger("sandhold.orchestrator")


class HttpStep:
    kind = "http"

    async def run(
        self, runner: Runner, instance: tk.StepInstance, record: tk.StepRecord | None
    ) -> None:
        step = instance.step
        if record is not None and not record.done:
            # Claimed by an orchestrator that stopped before recording a result.
            if step.delivery == "at_most_once":
                await runner.append(
                    ev.TaskStepFailed(
                        step_id=record.id,
                        attempt=record.attempt,
                        reason="interrupted",
                        detail="the orchestrator stopped between claiming this at_most_once "
                        "step and recording its result; it may or may not have fired, so it "
                        "is not sent again",
                    ),
                    why=f"interrupted:{record.id}",
                )
                return
            log.info(
                "%s: re-running at_least_once step %s after a restart", runner.task_id, record.id
            )
        else:
            record = await runner.claim(instance, runner.next_attempt(record))
        assert step.http is not None
        call = policy.render_call(step.http, instance, tk.outputs(runner.state))
        runner.ensure_driving()
        unsendable = False
        try:
            status, body = await runner.http.perform(call, record.idempotency_key)
        except (ValueError, http.client.InvalidURL) as err:
            # A rendered URL or header urllib will not send: sending again cannot help.
            status, body, unsendable = None, f"{type(err).__name__}: {err}", True
        except (OSError, http.client.HTTPException) as err:
            # No answer, or one that is not HTTP: transient, like a refused connection.
            status, body = None, f"{type(err).__name__}: {err}"
        fault("before_output_recorded", instance.id)
        outcome = policy.http_outcome(status, body, unsendable=unsendable)
        if outcome.finished:
            await runner.append(
                ev.TaskStepFinished(
                    step_id=record.id, attempt=record.attempt, output=body, status=status
                ),
                why=f"finished:{record.id}:{record.attempt}",
            )
            return
        assert outcome.error_class is not None
        retry = runner.attempt_failed(
            record.id,
            attempt=record.attempt,
            error_class=outcome.error_class,
            reason=outcome.reason,
            detail=outcome.detail,
            budget=runner.state.manifest.retry.network,
        )
        await runner.record_step_failure(record, outcome.reason, outcome.detail, retry=retry)

    async def stop(self, runner: Runner, record: tk.StepRecord, *, why: str) -> None:
        """A call in flight cannot be taken back."""
