"""Agent steps: a command in the task's sandbox, dispatched at most once per attempt.

The command is linked in the ledger (`task.step_claimed` with its id) before
its request leaves, so an orchestrator that died at any point finds it: the
command exists (wait for it), or the request provably never left (JetStream's
de-duplication window says so: send it now), or it cannot be shown either way
(the step fails `interrupted` rather than risk a second agent turn).
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING

import msgspec
from sandhold.domain import events as ev
from sandhold.domain import requests as rq
from sandhold.domain import sandbox as sb
from sandhold.domain import task as tk
from sandhold.domain import task_policy as policy
from sandhold.domain.errors import InfraError, Rejected
from sandhold.orchestrator.faults import fault

if TYPE_CHECKING:
    from sandhold.orchestrator.runner import Runner

log = logging.getLogger("sandhold.orchestrator")


async def _with_secrets(
    runner: Runner, record: tk.StepRecord, instance: tk.StepInstance
) -> rq.RunCommand | None:
    """The step's command with the task's secrets (kept since its submit, never
    in its log); None, and the step's failure recorded, once they are gone."""
    request = policy.run_request(runner.state, instance, record)
    if not runner.state.manifest.secrets:
        return request
    values = await runner.sandboxes.task_secrets(runner.task_id)
    if values is None:
        await runner.record_step_failure(
            record,
            "secrets_gone",
            "the task's secrets are no longer kept (a week after its submit, or lost "
            "with the bus): submit it again",
        )
        return None
    return msgspec.structs.replace(request, secrets=values)


class AgentStep:
    kind = "agent"

    async def run(
        self, runner: Runner, instance: tk.StepInstance, record: tk.StepRecord | None
    ) -> None:
        if record is not None and not record.done:
            if not await self._recover(runner, instance, record):
                return
        else:
            attempt = runner.next_attempt(record)
            sandbox_id = runner.sandbox_id()
            key = tk.step_key(runner.task_id, instance.id, attempt)
            # The command is linked in the ledger before its request leaves.
            record = await runner.claim(
                instance,
                attempt,
                sandbox_id=sandbox_id,
                command_id=rq.command_id_for(sandbox_id, key),
            )
            request = await _with_secrets(runner, record, instance)
            if request is None:
                return
            runner.ensure_driving()
            sent = await runner.sandboxes.send(request)
            fault("after_send", instance.id)
            await runner.append(
                ev.TaskStepDispatched(step_id=record.id, attempt=record.attempt),
                why=f"dispatched:{record.id}:{record.attempt}",
            )
            if not await self._settled(runner, record, sent):
                return
        await self._await_command(runner, instance, record)

    async def stop(self, runner: Runner, record: tk.StepRecord, *, why: str) -> None:
        if record.sandbox_id and record.command_id:
            with contextlib.suppress(Rejected):
                await cancel_command(runner, record, why=why)

    async def _settled(self, runner: Runner, record: tk.StepRecord, sent) -> bool:
        """The run request decided: True once its command exists; refused, the
        step's failure is recorded."""
        assert record.sandbox_id is not None
        key = record.idempotency_key
        try:
            await runner.sandboxes.settle(
                sent, lambda s: sb.queued_by(s, key) is not False, sandbox_id=record.sandbox_id
            )
        except Rejected as err:
            await runner.record_step_failure(record, f"rejected_{err.code}", err.message)
            return False
        return True

    async def _recover(
        self, runner: Runner, instance: tk.StepInstance, record: tk.StepRecord
    ) -> bool:
        """A step claimed by an orchestrator that stopped. True: its command exists
        (now), go on waiting for it; False: the step's end was recorded."""
        assert record.sandbox_id and record.command_id
        # (As waited for: the store may hold it no more, decision 061.)
        sandbox = await runner.sandboxes.wait(record.sandbox_id, lambda s: s, timeout=None)
        queued = sb.queued_by(sandbox, record.idempotency_key)
        if queued is None:  # its key kept as a fingerprint (decision 085): the log is exact
            whole = await runner.sandboxes.whole(record.sandbox_id)
            queued = whole is not None and sb.queued_by(whole, record.idempotency_key)
        if queued:
            log.info("%s: re-attaching to %s (%s)", runner.task_id, record.command_id, record.id)
            return True
        # No command in the sandbox's log. Whether its request left can be learnt
        # from JetStream's de-duplication, but only within its window.
        if runner.clock.now() - record.claimed_at > runner.proof_window_s:
            await runner.record_step_failure(
                record,
                "interrupted",
                "the orchestrator stopped after linking this step's command and before it "
                "could be shown whether the request was sent; not dispatching it again",
            )
            return False
        request = await _with_secrets(runner, record, instance)
        if request is None:
            return False
        runner.ensure_driving()
        sent = await runner.sandboxes.send(request)
        if not sent.duplicate:
            # Provably stillborn: the request had never been stored. This is its first send.
            log.info("%s: %s was never sent; dispatching it now", runner.task_id, record.id)
            await runner.append(
                ev.TaskStepDispatched(
                    step_id=record.id, attempt=record.attempt, fresh_after_crash=True
                ),
                why=f"dispatched:{record.id}:{record.attempt}",
            )
            return await self._settled(runner, record, sent)
        # It left before the crash. A scheduler decides it soon, unless it was
        # refused (the answer went to the dead orchestrator): wait a while, then
        # fail rather than risk a second agent turn under a new key.
        key = record.idempotency_key
        try:
            await runner.sandboxes.wait(
                record.sandbox_id,
                lambda s: True if sb.queued_by(s, key) is not False else None,
                timeout=runner.decision_wait_s,
            )
        except TimeoutError:
            await runner.record_step_failure(
                record,
                "interrupted",
                "the request left before the orchestrator stopped, but no command was "
                f"recorded within {runner.decision_wait_s:g}s; not dispatching it again",
            )
            return False
        return True

    async def _await_command(
        self, runner: Runner, instance: tk.StepInstance, record: tk.StepRecord
    ) -> None:
        assert record.sandbox_id and record.command_id
        fault("during_command", instance.id)
        command = await self._watch(runner, record)
        fault("before_output_recorded", instance.id)
        tail = await runner.read_output(record.sandbox_id, record.command_id)
        stdout = tail.decode("utf-8", "replace")
        if command.state == "exited" and command.exit_code == 0:
            await runner.append(
                ev.TaskStepFinished(
                    step_id=record.id, attempt=record.attempt, output=stdout, exit_code=0
                ),
                why=f"finished:{record.id}:{record.attempt}",
            )
            return
        state = runner.state
        reason, detail = policy.why_command_failed(state, record, command, now=runner.clock.now())
        retry = None
        if command.state == "infrastructure_lost":
            retry = policy.lost_command_retry(
                state, record, now=runner.clock.now(), jitter=runner.jitter()
            )
        await runner.record_step_failure(
            record,
            reason,
            detail,
            retry=retry,
            output=stdout,
            exit_code=command.exit_code,
            end_state=command.state,
        )

    async def _watch(self, runner: Runner, record: tk.StepRecord) -> sb.Command:
        """Wait for the command's end, warning and then cancelling on silence."""
        assert record.sandbox_id and record.command_id
        hang = runner.state.manifest.hang
        warn_after, cancel_after = float(hang.warn_after), float(hang.cancel_after)
        tick = min(max(min(warn_after, cancel_after) / 10, 0.2), 30.0)
        warned = record.hang_warned
        cancelled = False
        command_id, key = record.command_id, record.idempotency_key
        while True:
            try:
                found: sb.Command | _EndedAway = await runner.sandboxes.wait(
                    record.sandbox_id, lambda s: _end_of(s, command_id, key), timeout=tick
                )
            except TimeoutError:
                pass
            else:
                if not isinstance(found, _EndedAway):
                    return found
                # Ended, and the store keeps no ended command: its end is in the log.
                whole = await runner.sandboxes.whole(record.sandbox_id)
                ended = whole.commands.get(command_id) if whole is not None else None
                if ended is not None and ended.ended:
                    return ended
                raise InfraError(
                    f"{command_id} ended, but its end was not read back", retryable=True
                )
            command = command_of(runner, record)
            if command is None or command.state != "running":
                continue  # silence counts only once it runs (not while queued or restored)
            last = await runner.output.last_written_at(record.sandbox_id, record.command_id)
            quiet_since = max(command.started_at or record.claimed_at, last or 0.0)
            silent = runner.clock.now() - quiet_since
            if silent >= warn_after and not warned:
                warned = True
                await runner.append(
                    ev.TaskHangWarned(
                        step_id=record.id, command_id=record.command_id, silent_s=round(silent, 3)
                    ),
                    why=f"hang-warned:{record.id}:{record.attempt}:{quiet_since}",
                )
                record = runner.state.steps[record.id]
            if silent >= cancel_after and not cancelled:
                cancelled = True
                await cancel_command(runner, record, why="hung")


class _EndedAway:
    """What `_watch`'s wait finds when the command ended and was compacted away."""


_AWAY = _EndedAway()


def _end_of(state: sb.Sandbox, command_id: str, key: str) -> sb.Command | _EndedAway | None:
    """The command's end record, `_AWAY` when it ended and the store dropped
    it, None while it has not ended."""
    command = state.commands.get(command_id)
    if command is not None and command.ended:
        return command
    return _AWAY if sb.ended_away(state, command_id, key) else None


def command_of(runner: Runner, record: tk.StepRecord) -> sb.Command | None:
    assert record.sandbox_id and record.command_id
    sandbox = runner.sandboxes.state(record.sandbox_id)
    return sandbox.commands.get(record.command_id) if sandbox is not None else None


async def cancel_command(runner: Runner, record: tk.StepRecord, *, why: str) -> None:
    assert record.sandbox_id and record.command_id
    command = command_of(runner, record)
    if command is None or command.ended:
        return
    await runner.sandboxes.send(
        rq.CancelCommand(
            key=f"{record.idempotency_key}:cancel:{why}",
            tenant=runner.state.tenant,
            sandbox_id=record.sandbox_id,
            command_id=record.command_id,
        )
    )
