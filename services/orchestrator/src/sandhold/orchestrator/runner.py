"""Driving one task through its lifecycle, from its ledger.

A runner reads only the task's folded state to know what to do next, so a
runner started after a crash resumes where the log says the task is:
finished steps are adopted with their recorded outputs, never run again;
a step claimed but not finished was interrupted, and is handled by its kind
and delivery mode (see `_recover_agent_step` and `_http_step`).

Deadlines: the current stage's and the task's are enforced around every
stage's work; an agent command also carries the time left as its own
timeout, so the host ends it `timed_out` on time even if we are down.

What to decide from what the runner sees is `domain.task_policy` (pure, with
the clock and the jitter passed in); what each step kind does is its
executor in `steps/`. This module is the lifecycle and the IO around them.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import logging
import math
import random
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sandhold.bus.cancelling import cancel_and_wait
from sandhold.bus.ports import SYSTEM_CLOCK, Aggregates, Clock, OutputReader
from sandhold.domain import events as ev
from sandhold.domain import requests as rq
from sandhold.domain import sandbox as sb
from sandhold.domain import saves as sv
from sandhold.domain import task as tk
from sandhold.domain import task_policy as policy
from sandhold.domain.errors import Rejected
from sandhold.domain.task_driver import SUPERSEDED, check_driver
from sandhold.orchestrator.faults import fault
from sandhold.orchestrator.git import CloneFailed, clone
from sandhold.orchestrator.http_tool import HttpTool
from sandhold.orchestrator.sandboxes import Sandboxes
from sandhold.orchestrator.staging import store_seed
from sandhold.orchestrator.steps import executor
from sandhold.saves import SaveStore

log = logging.getLogger("sandhold.orchestrator")

RELEASE_WAIT_S = 60.0  # how long a task ended while provisioning waits for its sandbox


def sandbox_key(task_id: str) -> str:
    """The key of the task's CreateSandbox: the sandbox id follows from it."""
    return f"{task_id}:sandbox"


def task_sandbox_id(state: tk.Task) -> str:
    return rq.sandbox_id_for(state.tenant, sandbox_key(state.id))


def start_key(task_id: str, attempt: int) -> str:
    """The key of a later provisioning attempt's StartSandbox."""
    return f"{sandbox_key(task_id)}:start:{attempt}"


def start_request(task_id: str, attempt: int, tenant: str, sandbox_id: str) -> rq.StartSandbox:
    """A later provisioning attempt's start. Delivered late (a scheduler died
    deciding it), after the task's end stopped the sandbox, it starts nothing
    (decision 082): nothing would stop a task's sandbox again."""
    return rq.StartSandbox(
        key=start_key(task_id, attempt),
        tenant=tenant,
        sandbox_id=sandbox_id,
        superseded_by=(stop_key(task_id), release_key(task_id)),
    )


def stop_key(task_id: str) -> str:
    """The key of the StopSandbox that ends a task's sandbox when the task ends."""
    return f"{task_id}:stop"


def release_key(task_id: str) -> str:
    """The key of the StopSandbox a release sends (decision 071)."""
    return f"{task_id}:release"


# Clocks of two orchestrator instances may differ: a retry due this close to
# the task's end is taken as sent (a task kept is cheaper than a sandbox left).
RETRY_SENT_MARGIN_S = 5.0

# Phases a sandbox leaves only when asked to (a start): nothing to stop.
SETTLED_PHASES = frozenset({"stopped", "failed", "deleted"})


def provision_undecided(state: tk.Task, sandbox: sb.Sandbox | None) -> bool:
    """Whether an ended task's last provisioning request may still be decided
    (decision 071): it ended while provisioning, before its sandbox ran and
    before that request was refused, and the sandbox (`None`: not in the log)
    does not show it decided. The create is decided once the sandbox exists;
    a later attempt's start once the sandbox has seen its key, or is on its
    way up (a start decided then records nothing; it is stopped next). One due
    after the end was never sent; a deleted sandbox starts no more."""
    if state.sandbox_id is not None or state.failed_stage != "provisioning":
        return False
    if state.reason.startswith("provision_") and state.reason != "provision_failed":
        return False  # refused: decided
    failures = state.failures("provision")
    if not failures:
        return sandbox is None  # the create
    due = failures[-1].retry_at
    ended = state.finished_at if state.finished_at is not None else state.updated_at
    if due is None or ended < due - RETRY_SENT_MARGIN_S:
        return False  # no attempt after the last failure was (or will be) sent
    if sandbox is None:
        return True
    if sb.remembers(sandbox, start_key(state.id, len(failures) + 1)) is not False:
        return False  # (None: kept as a fingerprint, decision 085: it was sent)
    return sandbox.phase in ("stopped", "failed", "lost")


# What `_ended_save` finds of a save its store kept no record of, once ended.
_DROPPED = sv.SaveRecord(id="", kind="scheduled", state="expired", requested_at=0.0)


def _ended_save(state: sb.Sandbox, save_id: str, key: str) -> sv.SaveRecord | None:
    """The Snapshot asked for with `key`, once it ended (None while under way or
    not read yet); `_DROPPED` once it ended and the store dropped its record
    (deleted since, and expired: decision 068): its request key is known, so
    its request was folded, and a record is dropped only once it ended."""
    record = state.saves.get(save_id)
    if record is None:
        # (A deleted sandbox's kept state has no request keys: read it back.)
        # (A key kept as a fingerprint was sent, decision 085.)
        dropped = sb.remembers(state, key) is not False or state.phase == "deleted"
        return _DROPPED if dropped else None
    return None if record.state in sv.IN_FLIGHT else record


class StageOver(Exception):
    """The current stage's work appended the event that ends it (or the task)."""


class Superseded(Exception):
    """This runner's claim is no longer the task's latest (another instance took
    the task over), or its instance's lease lapsed: it stops, writing nothing."""


@dataclass(frozen=True)
class DriverClaim:
    """What a runner drives its task under: `instance`'s claim of `epoch`, good
    while `held()` (the instance's lease, in the term the claim was made in)."""

    instance: str
    epoch: int
    held: Callable[[], bool]


class Runner:
    def __init__(
        self,
        task_id: str,
        *,
        tasks: Aggregates[tk.Task],
        sandboxes: Sandboxes,
        save_store: SaveStore,
        work_dir: Path,
        output: OutputReader,
        proof_window_s: float,
        decision_wait_s: float,
        http: HttpTool,
        driver: DriverClaim,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.task_id = task_id
        self.driver = driver
        self._tasks = tasks
        self.sandboxes = sandboxes
        self._store = save_store
        self._work_dir = work_dir
        self.output = output
        self.clock = clock
        self.proof_window_s = proof_window_s
        self.decision_wait_s = decision_wait_s
        self.http = http
        self.changed = asyncio.Event()
        self._random = random.Random()

    async def read_output(self, sandbox_id: str, command_id: str) -> bytes:
        """The tail of a command's output the ledger keeps (never the whole of it)."""
        return await self.output.tail(sandbox_id, command_id, limit=tk.OUTPUT_KEPT)

    def jitter(self) -> float:
        """A retry's random spread, drawn here (`task_policy` records the result)."""
        return self._random.random()

    # --- the loop -----------------------------------------------------------------

    @property
    def state(self) -> tk.Task:
        state, _ = self._tasks.get(self.task_id)
        assert state is not None
        return state

    async def append(self, *events: ev.AnyEvent, why: str) -> tk.Task:
        """Append on the state the decision was made on. On a conflict (a cancel
        request came first) the same events are appended on the newer state,
        unless the task has ended meanwhile (another writer ended it): then
        nothing is appended and this stage's work stops. Every append of a runner
        passes here, so this is where one whose claim was superseded is stopped."""

        def decide(state: tk.Task | None) -> list[ev.AnyEvent]:
            if state is None or state.terminal:
                return []
            check_driver(state, self.driver.epoch)
            return list(events)

        try:
            executed = await self._tasks.follow_up(self.task_id, decide, why=why)
        except Rejected as err:
            if err.code == SUPERSEDED:
                raise Superseded(err.message) from err
            raise
        assert executed.state is not None
        if not executed.appended:
            raise StageOver
        return executed.state

    def ensure_driving(self) -> None:
        """Before acting outside the log (a tool's call, a command's request): this
        instance still holds its lease and the task's latest claim is still ours.
        The log refuses a superseded runner's next append; this keeps one that
        woke up after its lease lapsed from acting before it gets there."""
        if not self.driver.held():
            raise Superseded(f"{self.driver.instance}'s lease lapsed")
        try:
            check_driver(self.state, self.driver.epoch)
        except Rejected as err:
            raise Superseded(err.message) from err

    async def run(self) -> bool:
        """Drive the task to its end, then release its sandbox: whether nothing
        about it can change any more (it may be released)."""
        while True:
            state = self.state
            if state.terminal:
                return await self._release(state)
            if state.cancel_requested:
                with contextlib.suppress(StageOver):  # it ended meanwhile
                    await self._cancel(state)
                continue
            now = self.clock.now()
            passed = policy.passed_limit(state, now)
            if passed is not None:
                with contextlib.suppress(StageOver):
                    await self._end_for_time(state, passed)
                continue
            await self._advance_until(state, policy.time_to_next_limit(state, now))

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
        except asyncio.CancelledError:
            # The runner is stopped (taken over, fenced): its work too, and ended
            # before the runner is, so none of it goes on beside a new holder's.
            await cancel_and_wait([work])
            raise
        finally:
            cancelled.cancel()
        if work in done:
            with contextlib.suppress(StageOver):
                work.result()
            return
        # A cancel request or a deadline: the loop decides what follows, once
        # the work has really stopped (cancelled again where need be, decision 080).
        await cancel_and_wait([work])
        with contextlib.suppress(asyncio.CancelledError, StageOver):
            work.result()

    async def _wait_for_cancel(self) -> None:
        while not self.state.cancel_requested:
            self.changed.clear()
            await self.changed.wait()

    async def _advance(self, state: tk.Task) -> None:
        match state.state:
            case "pending":
                await self.append(ev.TaskStageEntered(stage="staging"), why="stage")
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
        await self.append(
            ev.TaskFailed(reason=reason, detail=detail, stage=self.state.state), why="fail"
        )
        raise StageOver

    async def _end_for_time(self, state: tk.Task, which: policy.Limit) -> None:
        await self._stop_step_in_flight(state, reason="timed_out")
        why = "timed-out" if which == "task" else "stage-timeout"
        await self.append(policy.limit_passed(state, which), why=why)

    async def _cancel(self, state: tk.Task) -> None:
        await self._stop_step_in_flight(state, reason="cancelled")
        await self.append(ev.TaskCancelled(stage=state.state), why="cancelled")

    async def _stop_step_in_flight(self, state: tk.Task, *, reason: str) -> None:
        """What a step in flight started is stopped (its command cancelled); it fails."""
        for record in state.steps.values():
            if record.done:
                continue
            await executor(record.kind).stop(self, record, why=reason)
            await self.append(
                ev.TaskStepFailed(
                    step_id=record.id, attempt=record.attempt, reason=reason, detail=reason
                ),
                why=f"step-{reason}",
            )

    async def _release(self, state: tk.Task) -> bool:
        """A finished task holds no host: its sandbox is stopped (with its final
        save), the stop decided. Whether nothing about the task can change any
        more (decision 071): false while a provisioning request of its
        sandbox may still be decided (`provision_undecided`) after a wait."""
        if state.state == "completed":
            return True  # its sandbox's stop was decided before it completed
        sandbox_id = state.sandbox_id
        if sandbox_id is None and state.failed_stage == "provisioning":
            sandbox_id = self.sandbox_id()  # it follows from the task
            if state.compacted:  # its attempts say which request went last: read them back
                state = (await self._tasks.read_whole(self.task_id))[0] or state
        if sandbox_id is None:
            return True  # nothing was ever asked for it
        sandbox = self.sandboxes.state(sandbox_id)
        if sandbox is None:  # not folded yet, or forgotten (deleted): as the log has it
            sandbox = await self.sandboxes.whole(sandbox_id)
        if provision_undecided(state, sandbox):
            try:
                sandbox = await self.sandboxes.wait(
                    sandbox_id,
                    lambda s: None if provision_undecided(state, s) else s,
                    timeout=RELEASE_WAIT_S,
                )
            except TimeoutError:
                return False  # a change of its sandbox starts a runner again
        if sandbox is None or sandbox.phase in SETTLED_PHASES:
            return True
        # Lost or recovering ones too: left alone, they come back by themselves.
        with contextlib.suppress(Rejected):  # deleted meanwhile: nothing to stop
            await self.sandboxes.request(
                rq.StopSandbox(
                    key=release_key(state.id), tenant=state.tenant, sandbox_id=sandbox_id
                ),
                lambda s: s.phase in ("stopping", *SETTLED_PHASES),
                sandbox_id=sandbox_id,
            )
        return True

    # --- retries ----------------------------------------------------------------------

    def attempt_failed(
        self,
        operation: str,
        *,
        attempt: int,
        error_class: ev.OperationErrorClass,
        reason: str,
        detail: str,
        budget: int,
    ) -> ev.TaskOperationFailed:
        """A failed attempt, decided now (`task_policy.attempt_failed`)."""
        return policy.attempt_failed(
            self.state,
            operation,
            attempt=attempt,
            error_class=error_class,
            reason=reason,
            detail=detail,
            budget=budget,
            now=self.clock.now(),
            jitter=self.jitter(),
        )

    async def _after_failure(self, operation: str, **failure) -> bool:
        """Record a failed attempt; True when another attempt follows (after its backoff)."""
        event = self.attempt_failed(operation, **failure)
        await self.append(event, why=f"attempt-failed:{operation}:{event.attempt}")
        return event.retry_at is not None

    async def _wait_for_retry(self, operation: str) -> int:
        """The next attempt's number, once the recorded backoff has passed."""
        attempt, wait = policy.next_attempt(self.state, operation, self.clock.now())
        await asyncio.sleep(wait)
        return attempt

    # --- staging ----------------------------------------------------------------------

    def _sandbox_key(self) -> str:
        return sandbox_key(self.task_id)

    def sandbox_id(self) -> str:
        return task_sandbox_id(self.state)

    async def _staging(self, state: tk.Task) -> None:
        repository = state.manifest.repository
        if repository is None or state.seed_save_id is not None:
            await self.append(ev.TaskStageEntered(stage="provisioning"), why="stage")
            return
        attempt = await self._wait_for_retry("clone")
        checkout = self._work_dir / "staging" / self.task_id / "checkout"
        shutil.rmtree(checkout.parent, ignore_errors=True)
        checkout.parent.mkdir(parents=True, exist_ok=True)
        limit = float(state.manifest.timeouts.clone)
        deadline = tk.deadline(state, "stage")
        if deadline is not None:
            limit = max(1.0, min(limit, deadline - self.clock.now()))
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
            sandbox_id = self.sandbox_id()
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
        await self.append(
            ev.TaskStaged(
                seed_save_id=staged.seed_save_id,
                seed_manifest_digest=staged.manifest_digest,
                commit=commit,
                files=staged.files,
                bytes=staged.bytes,
            ),
            ev.TaskStageEntered(stage="provisioning"),
            why="staged",
        )

    # --- provisioning -------------------------------------------------------------------

    async def _provisioning(self, state: tk.Task) -> None:
        sandbox_id = self.sandbox_id()
        attempt = await self._wait_for_retry("provision")
        spec = state.manifest.sandbox
        try:
            if attempt == 1:
                await self.sandboxes.request(
                    rq.CreateSandbox(
                        key=self._sandbox_key(),
                        tenant=state.tenant,
                        memory_limit_bytes=spec.memory_limit_bytes,
                        from_snapshot=spec.from_snapshot,
                        seed=state.seed_save_id,
                        seed_manifest_digest=state.seed_manifest_digest or None,
                        # Never reaped: the task says when its sandbox stops.
                        idle_timeout_s=0,
                        # ...and how long it is kept once stopped (decision 074).
                        keep_stopped_s=float(spec.keep_stopped) if spec.keep_stopped else None,
                    ),
                    lambda s: True,
                    sandbox_id=sandbox_id,
                )
            else:
                await self.sandboxes.request(
                    start_request(self.task_id, attempt, state.tenant, sandbox_id),
                    lambda s: s.phase not in ("failed", "lost", "stopped"),
                    sandbox_id=sandbox_id,
                )
        except Rejected as err:
            await self._fail(f"provision_{err.code}", err.message)
        sandbox = await self.sandboxes.wait(
            # Lost (its host died while starting it) or stopped meanwhile: a failed
            # placement attempt too, retried like a start that failed.
            sandbox_id,
            lambda s: s if s.phase in ("running", "failed", "deleted", "lost", "stopped") else None,
        )
        if sandbox.phase != "running":
            reason, detail = policy.provision_failure(sandbox)
            again = await self._after_failure(
                "provision",
                attempt=attempt,
                error_class="placement",
                reason=reason,
                detail=detail,
                budget=state.manifest.retry.placement,
            )
            if not again:
                await self._fail("provision_failed", sandbox.reason)
            return
        await self.append(
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
                if record is not None and record.status == "failed":
                    wait = policy.step_retry_wait(self.state, record, self.clock.now())
                    if wait is None:
                        await self._fail(
                            record.reason, f"step {record.id}: {record.detail or record.reason}"
                        )
                    await asyncio.sleep(wait or 0.0)
                # A failed step that is retried goes on to its next attempt, claimed there.
                await executor(instance.step.kind).run(self, instance, record)
        await self.append(ev.TaskStageEntered(stage="completing"), why="stage")

    # --- what step executors share -------------------------------------------------------

    def next_attempt(self, record: tk.StepRecord | None) -> int:
        return 1 if record is None else record.attempt + 1

    async def claim(self, instance: tk.StepInstance, attempt: int, **link: str) -> tk.StepRecord:
        state = await self.append(
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

    async def record_step_failure(
        self,
        record: tk.StepRecord,
        reason: str,
        detail: str,
        *,
        retry: ev.TaskOperationFailed | None = None,
        output: str | None = None,
        exit_code: int | None = None,
        end_state: str | None = None,
    ) -> None:
        """The step's failure and, where a retry is decided, that decision
        (`task_policy.step_failed`); a failure for the task's limit ends this stage."""
        events = policy.step_failed(
            record, reason, detail, retry=retry, output=output, exit_code=exit_code,
            end_state=end_state,
        )  # fmt: skip
        await self.append(*events, why=f"failed:{record.id}:{record.attempt}")
        if reason == "task_timeout":
            raise StageOver

    # --- completing -----------------------------------------------------------------------

    async def _completing(self, state: tk.Task) -> None:
        sandbox_id = state.sandbox_id
        assert sandbox_id is not None
        if state.manifest.artifacts and state.snapshot_id is None:
            key = f"{self.task_id}:artifacts"
            save_id = rq.save_id_for(sandbox_id, f"snapshot:{key}")
            try:
                await self.sandboxes.request(
                    rq.SnapshotSandbox(
                        key=key, tenant=state.tenant, sandbox_id=sandbox_id, name=f"task-{state.id}"
                    ),
                    lambda s: save_id in s.saves or sb.remembers(s, key) is not False,
                    sandbox_id=sandbox_id,
                )
            except Rejected as err:
                await self._fail("artifacts_failed", err.message)
            save: sv.SaveRecord | None = await self.sandboxes.wait(
                sandbox_id, lambda s: _ended_save(s, save_id, key)
            )
            if save is _DROPPED:
                # Ended and not kept (decision 068: a Snapshot deleted since, and
                # expired): its record is in the log only.
                whole = await self.sandboxes.whole(sandbox_id)
                save = whole.saves.get(save_id) if whole is not None else None
            if save is None or save.state != "completed" or save.kind != "snapshot":
                shown = "gone" if save is None else f"{save.state} ({save.kind})"
                why = f": {save.reason}" if save is not None and save.reason else ""
                await self._fail("artifacts_failed", f"the snapshot {save_id} is {shown}{why}")
            assert save is not None
            manifest = await self._store.get_manifest(save_id)
            artifacts = [
                ev.Artifact(path=path, size=entry.size, save_id=save_id)
                for entry in manifest.workspace_entries()
                if entry.kind == "file"
                and (path := entry.path.decode("utf-8", "replace"))
                and any(fnmatch.fnmatchcase(path, glob) for glob in state.manifest.artifacts)
            ]
            await self.append(
                ev.TaskArtifactsCollected(snapshot_id=save_id, artifacts=artifacts),
                why="artifacts",
            )
        try:
            await self.sandboxes.request(
                rq.StopSandbox(
                    key=stop_key(self.task_id), tenant=state.tenant, sandbox_id=sandbox_id
                ),
                lambda s: s.phase in ("stopping", "stopped"),
                sandbox_id=sandbox_id,
            )
        except Rejected as err:
            # Deleted already (kept stopped its time, decision 074, while this task
            # waited for an orchestrator): stopped for good.
            if err.code != "sandbox_deleted":
                await self._fail("stop_failed", err.message)
        stopped = await self.sandboxes.wait(
            sandbox_id,
            lambda s: s if s.phase in ("stopped", "failed", "lost", "deleted") else None,
        )
        await self.append(ev.TaskCompleted(final_save_id=stopped.final_save_id), why="completed")
