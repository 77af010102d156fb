"""Driving one task through its lifecycle, from its ledger.

A runner reads only the task's folded state to know what to do next, so a
runner started after a crash resumes where the log says the task is:
finished steps are adopted with their recorded outputs, never run again;
a step claimed but not finished was interrupted, and is handled by its kind
and delivery mode (see `_recover_agent_step` and `_http_step`).

Deadlines: the current stage's and the task's are enforced around every
stage's work; an agent command also carries the time left as its own
timeout, so the host ends it `timed_out` on time even if we are down.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import http.client
import logging
import math
import random
import shutil
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec
from sandhold.bus.store import AggregateStore
from sandhold.domain import events as ev
from sandhold.domain import requests as rq
from sandhold.domain import sandbox as sb
from sandhold.domain import task as tk
from sandhold.domain.errors import Rejected
from sandhold.domain.retry import backoff_delay
from sandhold.domain.task_manifest import RecordedHttpCall
from sandhold.orchestrator.faults import fault
from sandhold.orchestrator.git import CloneFailed, clone
from sandhold.orchestrator.http_tool import HttpTool
from sandhold.orchestrator.sandboxes import Sandboxes
from sandhold.orchestrator.staging import store_seed
from sandhold.saves import SaveStore

log = logging.getLogger("sandhold.orchestrator")

BACKSTOP_S = 10.0  # after a deadline, how long the host gets to end a command itself
RELEASE_WAIT_S = 60.0  # how long a task ended while provisioning waits for its sandbox


def sandbox_key(task_id: str) -> str:
    """The key of the task's CreateSandbox: the sandbox id follows from it."""
    return f"{task_id}:sandbox"


def task_sandbox_id(state: tk.Task) -> str:
    return rq.sandbox_id_for(state.tenant, sandbox_key(state.id))


class StageOver(Exception):
    """The current stage's work appended the event that ends it (or the task)."""


class Runner:
    def __init__(
        self,
        task_id: str,
        *,
        tasks: AggregateStore[tk.Task],
        sandboxes: Sandboxes,
        save_store: SaveStore,
        work_dir: Path,
        output_reader: Callable[[str, str], Awaitable[bytes]],
        last_output_at: Callable[[str, str], Awaitable[float | None]],
        proof_window_s: float,
        decision_wait_s: float,
        http: HttpTool,
    ) -> None:
        self.task_id = task_id
        self._tasks = tasks
        self._sandboxes = sandboxes
        self._store = save_store
        self._work_dir = work_dir
        self._read_output = output_reader
        self._last_output_at = last_output_at
        self._proof_window_s = proof_window_s
        self._decision_wait_s = decision_wait_s
        self._http = http
        self.changed = asyncio.Event()
        self._random = random.Random()

    # --- the loop -----------------------------------------------------------------

    @property
    def state(self) -> tk.Task:
        state, _ = self._tasks.get(self.task_id)
        assert state is not None
        return state

    async def _append(self, *events: ev.AnyEvent, why: str) -> tk.Task:
        """Append on the state the decision was made on. On a conflict (a cancel
        request came first) the same events are appended on the newer state,
        unless the task has ended meanwhile (another writer ended it): then
        nothing is appended and this stage's work stops."""

        def decide(state: tk.Task | None) -> list[ev.AnyEvent]:
            return [] if state is None or state.terminal else list(events)

        executed = await self._tasks.follow_up(self.task_id, decide, why=why)
        assert executed.state is not None
        if not executed.appended:
            raise StageOver
        return executed.state

    async def run(self) -> None:
        while True:
            state = self.state
            if state.terminal:
                await self._release(state)
                return
            if state.cancel_requested:
                with contextlib.suppress(StageOver):  # it ended meanwhile
                    await self._cancel(state)
                continue
            now = time.time()
            task_deadline = tk.deadline(state, "task")
            stage_deadline = tk.deadline(state, "stage")
            # Only a running command is ended by its host (it carries the time
            # left); any other stage's work is ours, so its limit is kept on time.
            backstop = BACKSTOP_S if state.state == "running" else 0.0
            if task_deadline is not None and now >= task_deadline + backstop:
                with contextlib.suppress(StageOver):
                    await self._end_for_time(state, "task")
                continue
            if stage_deadline is not None and now >= stage_deadline + backstop:
                with contextlib.suppress(StageOver):
                    await self._end_for_time(state, "stage")
                continue
            limit = min(d for d in (task_deadline, stage_deadline, math.inf) if d is not None)
            await self._advance_until(state, limit + backstop - now)

    async def _advance_until(self, state: tk.Task, seconds: float) -> None:
        self.changed.clear()
        work = asyncio.ensure_future(self._advance(state))
        cancelled = asyncio.ensure_future(self._wait_for_cancel())
        try:
            done, _ = await asyncio.wait(
                {work, cancelled},
                timeout=None if math.isinf(seconds) else max(0.0, seconds),
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            cancelled.cancel()
        if work in done:
            with contextlib.suppress(StageOver):
                work.result()
            return
        # A cancel request or a deadline: the loop decides what follows. On 3.11 a
        # cancellation can be swallowed by a wait that completed at the same moment
        # (asyncio.wait_for), so it is repeated until the work has really stopped.
        while not work.done():
            work.cancel()
            await asyncio.wait({work}, timeout=1.0)
        with contextlib.suppress(asyncio.CancelledError, StageOver):
            work.result()

    async def _wait_for_cancel(self) -> None:
        while not self.state.cancel_requested:
            self.changed.clear()
            await self.changed.wait()

    async def _advance(self, state: tk.Task) -> None:
        match state.state:
            case "pending":
                await self._append(ev.TaskStageEntered(stage="staging"), why="stage")
            case "staging":
                await self._staging(state)
            case "provisioning":
                await self._provisioning(state)
            case "running":
                await self._running()
            case "completing":
                await self._completing(state)

    # --- failing, cancelling, timing out --------------------------------------------

    async def _fail(self, reason: str, detail: str = "") -> None:
        await self._append(
            ev.TaskFailed(reason=reason, detail=detail, stage=self.state.state), why="fail"
        )
        raise StageOver

    async def _end_for_time(self, state: tk.Task, which: str) -> None:
        await self._stop_step_in_flight(state, reason="timed_out")
        if which == "task":
            limit = state.manifest.timeouts.task
            await self._append(
                ev.TaskTimedOut(stage=state.state, detail=f"the task's limit of {limit:g}s passed"),
                why="timed-out",
            )
        else:
            await self._append(
                ev.TaskFailed(
                    reason="stage_timeout",
                    detail=f"the {state.state} stage's limit passed",
                    stage=state.state,
                ),
                why="stage-timeout",
            )

    async def _cancel(self, state: tk.Task) -> None:
        await self._stop_step_in_flight(state, reason="cancelled")
        await self._append(ev.TaskCancelled(stage=state.state), why="cancelled")

    async def _stop_step_in_flight(self, state: tk.Task, *, reason: str) -> None:
        """An agent step's command still running is cancelled; its step fails."""
        for record in state.steps.values():
            if record.done:
                continue
            if record.kind == "agent" and record.sandbox_id and record.command_id:
                with contextlib.suppress(Rejected):
                    await self._cancel_command(record, why=reason)
            await self._append(
                ev.TaskStepFailed(
                    step_id=record.id, attempt=record.attempt, reason=reason, detail=reason
                ),
                why=f"step-{reason}",
            )

    async def _cancel_command(self, record: tk.StepRecord, *, why: str) -> None:
        assert record.sandbox_id and record.command_id
        command = self._command(record)
        if command is None or command.ended:
            return
        await self._sandboxes.send(
            rq.CancelCommand(
                key=f"{record.idempotency_key}:cancel:{why}",
                tenant=self.state.tenant,
                sandbox_id=record.sandbox_id,
                command_id=record.command_id,
            )
        )

    async def _release(self, state: tk.Task) -> None:
        """A finished task holds no host: its sandbox is stopped (with its final save)."""
        if state.state == "completed":
            return
        sandbox_id = state.sandbox_id
        if sandbox_id is None:
            if state.failed_stage != "provisioning":
                return
            # It ended while its sandbox was being made: the create may still be
            # decided after this, so wait for the sandbox (its id follows from the task).
            sandbox_id = self._sandbox_id()
            with contextlib.suppress(TimeoutError):
                await self._sandboxes.wait(sandbox_id, lambda s: True, timeout=RELEASE_WAIT_S)
        sandbox = self._sandboxes.state(sandbox_id)
        if sandbox is None or sandbox.phase not in {"pending", *sb.ACTIVE_PHASES}:
            return
        with contextlib.suppress(Rejected):
            await self._sandboxes.send(
                rq.StopSandbox(
                    key=f"{state.id}:release", tenant=state.tenant, sandbox_id=sandbox_id
                )
            )

    # --- retries ----------------------------------------------------------------------

    def _attempt_failed(
        self,
        operation: str,
        *,
        attempt: int,
        error_class: str,
        reason: str,
        detail: str,
        budget: int,
    ) -> ev.TaskOperationFailed:
        """A failed attempt with its cause; `retry_at` set when another follows
        (the backoff chosen now is recorded, so a restart waits the same)."""
        retry = self.state.manifest.retry
        retry_at = None
        if error_class != "permanent" and attempt <= budget:
            delay = backoff_delay(
                attempt,
                base_s=float(retry.base_delay),
                cap_s=float(retry.max_delay),
                jitter=self._random.random(),
            )
            retry_at = time.time() + delay
        return ev.TaskOperationFailed(
            operation=operation,
            attempt=attempt,
            error_class=error_class,  # type: ignore[arg-type]
            reason=reason,
            detail=detail[-2000:],
            retry_at=retry_at,
        )

    async def _after_failure(self, operation: str, **failure) -> bool:
        """Record a failed attempt; True when another attempt follows (after its backoff)."""
        event = self._attempt_failed(operation, **failure)
        await self._append(event, why=f"attempt-failed:{operation}:{event.attempt}")
        return event.retry_at is not None

    async def _wait_for_retry(self, operation: str) -> int:
        """The next attempt's number, once the recorded backoff has passed."""
        failures = self.state.failures(operation)
        if failures and failures[-1].retry_at is not None:
            await asyncio.sleep(max(0.0, failures[-1].retry_at - time.time()))
        return len(failures) + 1

    # --- staging ----------------------------------------------------------------------

    def _sandbox_key(self) -> str:
        return sandbox_key(self.task_id)

    def _sandbox_id(self) -> str:
        return task_sandbox_id(self.state)

    async def _staging(self, state: tk.Task) -> None:
        repository = state.manifest.repository
        if repository is None or state.seed_save_id is not None:
            await self._append(ev.TaskStageEntered(stage="provisioning"), why="stage")
            return
        attempt = await self._wait_for_retry("clone")
        checkout = self._work_dir / "staging" / self.task_id / "checkout"
        shutil.rmtree(checkout.parent, ignore_errors=True)
        checkout.parent.mkdir(parents=True, exist_ok=True)
        limit = float(state.manifest.timeouts.clone)
        deadline = tk.deadline(state, "stage")
        if deadline is not None:
            limit = max(1.0, min(limit, deadline - time.time()))
        try:
            try:
                commit = await clone(repository.url, repository.ref, checkout, timeout_s=limit)
            except CloneFailed as err:
                again = await self._after_failure(
                    "clone",
                    attempt=attempt,
                    error_class=err.error_class,
                    reason=err.reason,
                    detail=err.detail,
                    budget=state.manifest.retry.network,
                )
                if not again:
                    await self._fail(f"clone_{err.reason}", err.detail)
                return
            sandbox_id = self._sandbox_id()
            staged = await store_seed(
                self._store,
                checkout,
                # A fresh id per staging: one that crashed before `task.staged` may
                # have stored a (different) manifest under its id already.
                save_id=rq.save_id_for(sandbox_id, f"seed:{uuid.uuid4().hex}"),
                sandbox_id=sandbox_id,
                spool=checkout.parent / "spool",
            )
        finally:
            shutil.rmtree(checkout.parent, ignore_errors=True)
        await self._append(
            ev.TaskStaged(
                seed_save_id=staged.seed_save_id,
                commit=commit,
                files=staged.files,
                bytes=staged.bytes,
            ),
            ev.TaskStageEntered(stage="provisioning"),
            why="staged",
        )

    # --- provisioning -------------------------------------------------------------------

    async def _provisioning(self, state: tk.Task) -> None:
        sandbox_id = self._sandbox_id()
        attempt = await self._wait_for_retry("provision")
        spec = state.manifest.sandbox
        try:
            if attempt == 1:
                await self._sandboxes.request(
                    rq.CreateSandbox(
                        key=self._sandbox_key(),
                        tenant=state.tenant,
                        memory_limit_bytes=spec.memory_limit_bytes,
                        from_snapshot=spec.from_snapshot,
                        seed=state.seed_save_id,
                    ),
                    lambda s: True,
                    sandbox_id=sandbox_id,
                )
            else:
                await self._sandboxes.request(
                    rq.StartSandbox(
                        key=f"{self._sandbox_key()}:start:{attempt}",
                        tenant=state.tenant,
                        sandbox_id=sandbox_id,
                    ),
                    lambda s: s.phase not in ("failed", "lost", "stopped"),
                    sandbox_id=sandbox_id,
                )
        except Rejected as err:
            await self._fail(f"provision_{err.code}", err.message)
        sandbox = await self._sandboxes.wait(
            # Lost (its host died while starting it) or stopped meanwhile: a failed
            # placement attempt too, retried like a start that failed.
            sandbox_id,
            lambda s: s if s.phase in ("running", "failed", "deleted", "lost", "stopped") else None,
        )
        if sandbox.phase != "running":
            again = await self._after_failure(
                "provision",
                attempt=attempt,
                error_class="placement",
                reason="start_failed" if sandbox.phase == "failed" else f"sandbox_{sandbox.phase}",
                detail=sandbox.reason or f"the sandbox became {sandbox.phase} while starting",
                budget=state.manifest.retry.placement,
            )
            if not again:
                await self._fail("provision_failed", sandbox.reason)
            return
        await self._append(
            ev.TaskProvisioned(sandbox_id=sandbox_id),
            ev.TaskStageEntered(stage="running"),
            why="provisioned",
        )

    # --- running: the pipeline -----------------------------------------------------------

    async def _running(self) -> None:
        for instance in tk.instances(self.state.manifest):
            while True:
                record = self.state.steps.get(instance.id)
                if record is not None and record.status == "finished":
                    break  # adopted: its output is in the ledger
                failed = record is not None and record.status == "failed"
                if failed and not await self._retry_failed_step(instance, record):
                    await self._fail(
                        record.reason, f"step {record.id}: {record.detail or record.reason}"
                    )
                # A failed step that is retried goes on to its next attempt, claimed below.
                if instance.step.kind == "http":
                    await self._http_step(instance, record)
                else:
                    await self._agent_step(instance, record)
        await self._append(ev.TaskStageEntered(stage="completing"), why="stage")

    async def _retry_failed_step(self, instance: tk.StepInstance, record: tk.StepRecord) -> bool:
        """A failed step runs again only when its failure was recorded as retried
        (a `task.operation_failed` with `retry_at` for this attempt)."""
        failures = self.state.failures(instance.id)
        if not failures or failures[-1].attempt != record.attempt:
            return False
        if failures[-1].retry_at is None:
            return False
        await asyncio.sleep(max(0.0, failures[-1].retry_at - time.time()))
        return True

    def _next_attempt(self, record: tk.StepRecord | None) -> int:
        return 1 if record is None else record.attempt + 1

    async def _claim(self, instance: tk.StepInstance, attempt: int, **link: str) -> tk.StepRecord:
        state = await self._append(
            ev.TaskStepClaimed(
                step_id=instance.id,
                step=instance.step.name,
                index=instance.index,
                kind=instance.step.kind,
                attempt=attempt,
                idempotency_key=tk.step_key(self.task_id, instance.id, attempt),
                **link,
            ),
            why=f"claim:{instance.id}:{attempt}",
        )
        fault("after_claim", instance.id)
        return state.steps[instance.id]

    # --- tool steps ----------------------------------------------------------------------

    async def _http_step(self, instance: tk.StepInstance, record: tk.StepRecord | None) -> None:
        step = instance.step
        if record is not None and not record.done:
            # Claimed by an orchestrator that stopped before recording a result.
            if step.delivery == "at_most_once":
                await self._append(
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
                "%s: re-running at_least_once step %s after a restart", self.task_id, record.id
            )
        else:
            record = await self._claim(instance, self._next_attempt(record))
        assert step.http is not None
        call = _render_call(step.http, instance, tk.outputs(self.state))
        permanent = False
        try:
            status, body = await self._http.perform(call, record.idempotency_key)
        except (ValueError, http.client.InvalidURL) as err:
            # A rendered URL or header urllib will not send: sending again cannot help.
            status, body, permanent = None, f"{type(err).__name__}: {err}", True
        except (OSError, http.client.HTTPException) as err:
            # No answer, or one that is not HTTP: transient, like a refused connection.
            status, body = None, f"{type(err).__name__}: {err}"
        fault("before_output_recorded", instance.id)
        if status is not None and 200 <= status < 300:
            await self._append(
                ev.TaskStepFinished(
                    step_id=record.id, attempt=record.attempt, output=body, status=status
                ),
                why=f"finished:{record.id}:{record.attempt}",
            )
            return
        transient = not permanent and (status is None or status >= 500 or status in (408, 429))
        reason = "http_error" if status is None else "http_status"
        detail = body if status is None else f"HTTP {status}: {body[:500]}"
        await self._record_step_failure(
            record,
            reason,
            detail,
            retry=self._attempt_failed(
                record.id,
                attempt=record.attempt,
                error_class="network" if transient else "permanent",
                reason=reason,
                detail=detail,
                budget=self.state.manifest.retry.network,
            ),
        )

    # --- agent steps ----------------------------------------------------------------------

    def _command(self, record: tk.StepRecord) -> sb.Command | None:
        assert record.sandbox_id and record.command_id
        sandbox = self._sandboxes.state(record.sandbox_id)
        return sandbox.commands.get(record.command_id) if sandbox is not None else None

    def _run_request(self, instance: tk.StepInstance, record: tk.StepRecord) -> rq.RunCommand:
        state = self.state
        agent = instance.step.agent
        assert agent is not None and record.sandbox_id is not None
        scope = tk.outputs(state)
        env = {
            **state.manifest.environment,
            **{k: tk.render(v, item=instance.item, scope=scope) for k, v in agent.env.items()},
            "SANDHOLD_TASK_ID": state.id,
            "SANDHOLD_STEP": instance.id,
            "SANDHOLD_STEP_KEY": record.idempotency_key,
        }
        if instance.item is not None:
            env["SANDHOLD_ITEM"] = instance.item
        # The time left travels with the command: the host ends it `timed_out`
        # when the step's, the stage's or the task's limit comes, even if we are down.
        limits = [float(agent.timeout)] if agent.timeout else []
        for what in ("stage", "task"):
            deadline = tk.deadline(state, what)  # type: ignore[arg-type]
            if deadline is not None:
                limits.append(max(1.0, deadline - record.claimed_at))
        return rq.RunCommand(
            key=record.idempotency_key,
            tenant=state.tenant,
            sandbox_id=record.sandbox_id,
            argv=[tk.render(a, item=instance.item, scope=scope) for a in agent.command],
            cwd=agent.cwd,
            env=env,
            timeout_s=min(limits) if limits else None,
        )

    async def _agent_step(self, instance: tk.StepInstance, record: tk.StepRecord | None) -> None:
        if record is not None and not record.done:
            if not await self._recover_agent_step(instance, record):
                return
        else:
            attempt = self._next_attempt(record)
            sandbox_id = self._sandbox_id()
            key = tk.step_key(self.task_id, instance.id, attempt)
            # The command is linked in the ledger before its request leaves.
            record = await self._claim(
                instance,
                attempt,
                sandbox_id=sandbox_id,
                command_id=rq.command_id_for(sandbox_id, key),
            )
            sent = await self._sandboxes.send(self._run_request(instance, record))
            fault("after_send", instance.id)
            await self._append(
                ev.TaskStepDispatched(step_id=record.id, attempt=record.attempt),
                why=f"dispatched:{record.id}:{record.attempt}",
            )
            try:
                await self._sandboxes.settle(
                    sent, lambda s: record.command_id in s.commands, sandbox_id=sandbox_id
                )
            except Rejected as err:
                await self._record_step_failure(record, f"rejected_{err.code}", err.message)
                return
        await self._await_command(instance, record)

    async def _recover_agent_step(self, instance: tk.StepInstance, record: tk.StepRecord) -> bool:
        """An agent step claimed by an orchestrator that stopped. True: its command
        exists (now), go on waiting for it; False: the step's end was recorded."""
        assert record.sandbox_id and record.command_id
        await self._sandboxes.wait(record.sandbox_id, lambda s: True, timeout=None)
        if self._command(record) is not None:
            log.info("%s: re-attaching to %s (%s)", self.task_id, record.command_id, record.id)
            return True
        # No command in the sandbox's log. Whether its request left can be learnt
        # from JetStream's de-duplication, but only within its window.
        if time.time() - record.claimed_at > self._proof_window_s:
            await self._record_step_failure(
                record,
                "interrupted",
                "the orchestrator stopped after linking this step's command and before it "
                "could be shown whether the request was sent; not dispatching it again",
            )
            return False
        sent = await self._sandboxes.send(self._run_request(instance, record))
        if not sent.duplicate:
            # Provably stillborn: the request had never been stored. This is its first send.
            log.info("%s: %s was never sent; dispatching it now", self.task_id, record.id)
            await self._append(
                ev.TaskStepDispatched(
                    step_id=record.id, attempt=record.attempt, fresh_after_crash=True
                ),
                why=f"dispatched:{record.id}:{record.attempt}",
            )
            try:
                await self._sandboxes.settle(
                    sent, lambda s: record.command_id in s.commands, sandbox_id=record.sandbox_id
                )
            except Rejected as err:
                await self._record_step_failure(record, f"rejected_{err.code}", err.message)
                return False
            return True
        # It left before the crash. A scheduler decides it soon, unless it was
        # refused (the answer went to the dead orchestrator): wait a while, then
        # fail rather than risk a second agent turn under a new key.
        try:
            await self._sandboxes.wait(
                record.sandbox_id,
                lambda s: True if record.command_id in s.commands else None,
                timeout=self._decision_wait_s,
            )
        except TimeoutError:
            await self._record_step_failure(
                record,
                "interrupted",
                "the request left before the orchestrator stopped, but no command was "
                f"recorded within {self._decision_wait_s:g}s; not dispatching it again",
            )
            return False
        return True

    async def _await_command(self, instance: tk.StepInstance, record: tk.StepRecord) -> None:
        assert record.sandbox_id and record.command_id
        fault("during_command", instance.id)
        command = await self._watch(record)
        fault("before_output_recorded", instance.id)
        tail = await self._read_output(record.sandbox_id, record.command_id)
        stdout = tail.decode("utf-8", "replace")
        if command.state == "exited" and command.exit_code == 0:
            await self._append(
                ev.TaskStepFinished(
                    step_id=record.id, attempt=record.attempt, output=stdout, exit_code=0
                ),
                why=f"finished:{record.id}:{record.attempt}",
            )
            return
        reason, detail = self._why_command_failed(record, command)
        retry = None
        if command.state == "infrastructure_lost":
            policy = self.state.manifest.on_infrastructure_lost
            retry = self._attempt_failed(
                record.id,
                attempt=record.attempt,
                error_class="infrastructure_lost",
                reason="infrastructure_lost",
                detail=f"the host of {record.sandbox_id} failed while {record.command_id} ran",
                # `recover_and_retry`: once; the next command brings the sandbox back.
                budget=1 if policy == "recover_and_retry" else 0,
            )
        await self._record_step_failure(
            record,
            reason,
            detail,
            retry=retry,
            output=stdout,
            exit_code=command.exit_code,
            end_state=command.state,
        )

    def _why_command_failed(self, record: tk.StepRecord, command: sb.Command) -> tuple[str, str]:
        state = self.state
        record = state.steps[record.id]
        if command.state == "exited":
            return "exit_code", f"{command.id} exited with {command.exit_code}"
        if command.state == "interrupted" and record.hang_warned and command.cancel_requested:
            cancel_after = state.manifest.hang.cancel_after
            return "hung", f"no output for {cancel_after:g}s: {command.id} was cancelled"
        if command.state == "timed_out":
            now = (command.ended_at or time.time()) + 1.0
            task_deadline = tk.deadline(state, "task")
            stage_deadline = tk.deadline(state, "stage")
            if task_deadline is not None and now >= task_deadline:
                return "task_timeout", f"{command.id} reached the task's limit"
            if stage_deadline is not None and now >= stage_deadline:
                return "stage_timeout", f"{command.id} reached the running stage's limit"
            return "timed_out", f"{command.id} reached the step's timeout"
        return command.state, command.reason or f"{command.id} ended {command.state}"

    async def _record_step_failure(
        self,
        record: tk.StepRecord,
        reason: str,
        detail: str,
        *,
        retry: ev.TaskOperationFailed | None = None,
        **extra: object,
    ) -> None:
        """The step's failure and, where a retry is decided, that decision.

        One append is not atomic (its events are published one by one), so the
        retry decision goes first: a crash after it finds the step unfinished and
        records its end again, whereas a failure recorded without its decision
        would end the task although a retry was due."""
        failed = ev.TaskStepFailed(
            step_id=record.id,
            attempt=record.attempt,
            reason=reason,
            detail=detail,
            **extra,  # type: ignore[arg-type]
        )
        events: list[ev.AnyEvent] = [failed] if retry is None else [retry, failed]
        if reason == "task_timeout":
            events.append(ev.TaskTimedOut(stage="running", detail=detail))
        await self._append(*events, why=f"failed:{record.id}:{record.attempt}")
        if reason == "task_timeout":
            raise StageOver

    async def _watch(self, record: tk.StepRecord) -> sb.Command:
        """Wait for the command's end, warning and then cancelling on silence."""
        assert record.sandbox_id and record.command_id
        hang = self.state.manifest.hang
        warn_after, cancel_after = float(hang.warn_after), float(hang.cancel_after)
        tick = min(max(min(warn_after, cancel_after) / 10, 0.2), 30.0)
        warned = record.hang_warned
        cancelled = False
        command_id = record.command_id
        while True:
            try:
                return await self._sandboxes.wait(
                    record.sandbox_id,
                    lambda s: c if (c := s.commands.get(command_id)) and c.ended else None,
                    timeout=tick,
                )
            except TimeoutError:
                pass
            command = self._command(record)
            if command is None or command.state != "running":
                continue  # silence counts only once it runs (not while queued or restored)
            last = await self._last_output_at(record.sandbox_id, record.command_id)
            quiet_since = max(command.started_at or record.claimed_at, last or 0.0)
            silent = time.time() - quiet_since
            if silent >= warn_after and not warned:
                warned = True
                await self._append(
                    ev.TaskHangWarned(
                        step_id=record.id, command_id=record.command_id, silent_s=round(silent, 3)
                    ),
                    why=f"hang-warned:{record.id}:{record.attempt}:{quiet_since}",
                )
                record = self.state.steps[record.id]
            if silent >= cancel_after and not cancelled:
                cancelled = True
                await self._cancel_command(record, why="hung")

    # --- completing -----------------------------------------------------------------------

    async def _completing(self, state: tk.Task) -> None:
        sandbox_id = state.sandbox_id
        assert sandbox_id is not None
        if state.manifest.artifacts and state.snapshot_id is None:
            key = f"{self.task_id}:artifacts"
            save_id = rq.save_id_for(sandbox_id, f"snapshot:{key}")
            try:
                await self._sandboxes.request(
                    rq.SnapshotSandbox(
                        key=key, tenant=state.tenant, sandbox_id=sandbox_id, name=f"task-{state.id}"
                    ),
                    lambda s: save_id in s.saves,
                    sandbox_id=sandbox_id,
                )
            except Rejected as err:
                await self._fail("artifacts_failed", err.message)
            save = await self._sandboxes.wait(
                sandbox_id,
                lambda s: (
                    r
                    if (r := s.saves.get(save_id)) and r.state in ("completed", "failed")
                    else None
                ),
            )
            if save.state != "completed":
                await self._fail(
                    "artifacts_failed", f"the snapshot {save_id} failed: {save.reason}"
                )
            manifest = await self._store.get_manifest(save_id)
            artifacts = [
                ev.Artifact(path=path, size=entry.size, save_id=save_id)
                for entry in manifest.workspace_entries()
                if entry.kind == "file"
                and (path := entry.path.decode("utf-8", "replace"))
                and any(fnmatch.fnmatchcase(path, glob) for glob in state.manifest.artifacts)
            ]
            await self._append(
                ev.TaskArtifactsCollected(snapshot_id=save_id, artifacts=artifacts),
                why="artifacts",
            )
        try:
            await self._sandboxes.request(
                rq.StopSandbox(
                    key=f"{self.task_id}:stop", tenant=state.tenant, sandbox_id=sandbox_id
                ),
                lambda s: s.phase in ("stopping", "stopped"),
                sandbox_id=sandbox_id,
            )
        except Rejected as err:
            await self._fail("stop_failed", err.message)
        stopped = await self._sandboxes.wait(
            sandbox_id, lambda s: s if s.phase in ("stopped", "failed", "lost") else None
        )
        await self._append(ev.TaskCompleted(final_save_id=stopped.final_save_id), why="completed")


def _render_call(
    call: RecordedHttpCall, instance: tk.StepInstance, scope: dict[str, str]
) -> RecordedHttpCall:
    def render(text: str) -> str:
        return tk.render(text, item=instance.item, scope=scope)

    return msgspec.structs.replace(
        call,
        url=render(call.url),
        body=render(call.body) if call.body is not None else None,
        headers={k: render(v) for k, v in call.headers.items()},
    )
