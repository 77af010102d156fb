"""The orchestrator: takes task requests and drives unfinished tasks.

Requests (`<prefix>.req.task.<verb>.<tenant>`) come off the REQUESTS work queue: decode
strictly → decide on the task's folded state → append behind the fence →
reply → ack. Any instance decides any request. Every task not yet ended has one
runner, in the one instance that drives it (decision 036): the instance that
took its submit claims it (`task.driver_claimed`), and a task whose driver's
lease lapsed — or that was left unclaimed — is claimed by whichever instance
gets there first. A runner resumes from the task's ledger.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable
from pathlib import Path

import msgspec
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig
from sandhold.bus import secret_store
from sandhold.bus.answering import RequestKinds, answer
from sandhold.bus.instances import instance_bucket
from sandhold.bus.names import Names
from sandhold.bus.output import OutputLog
from sandhold.bus.service import Shell, instance_name
from sandhold.domain import sandbox as sb
from sandhold.domain import task as tk
from sandhold.domain.errors import Rejected
from sandhold.domain.task_views import TaskReply, task_view
from sandhold.domain.views import ErrorBody
from sandhold.orchestrator.driving import Driving
from sandhold.orchestrator.faults import check_configuration
from sandhold.orchestrator.http_tool import Egress, HttpTool
from sandhold.orchestrator.runner import Runner, Superseded, task_sandbox_id
from sandhold.orchestrator.sandboxes import Sandboxes
from sandhold.saves import SaveStore
from sandhold.telemetry import context

log = logging.getLogger("sandhold.orchestrator")

_encoder = msgspec.json.Encoder()

# Runners releasing tasks that had ended before they were started, at once.
RELEASES_AT_ONCE = 16


class Orchestrator:
    name = "orchestrator"

    def __init__(
        self,
        nats_url: str,
        names: Names,
        *,
        work_dir: Path,
        proof_window_s: float = 100.0,
        decision_wait_s: float = 60.0,
        http_egress: Egress = "public",
        lease_ttl_s: float = 5.0,
        fence_margin_s: float = 2.0,
    ) -> None:
        self._names = names
        self._shell = Shell(self.name, nats_url, names)
        self._instance = instance_name(self.name)
        self._lease_ttl_s = lease_ttl_s
        self._fence_margin_s = fence_margin_s
        self._work_dir = work_dir
        # JetStream remembers message ids for 120 s (the streams' duplicate window):
        # inside this margin a re-send shows whether a request had left.
        self._proof_window_s = proof_window_s
        self._decision_wait_s = decision_wait_s
        self._http = HttpTool(egress=http_egress)
        self._runners: dict[str, asyncio.Task[None]] = {}
        self._runner_terms: dict[str, int] = {}  # the lease term each runner started in
        self._live: dict[str, Runner] = {}
        # Tasks that may need a runner: unfinished, or ended and not released.
        self._pending: set[str] = set()
        # Each held task's sandbox id (it follows from the task): a change of the
        # sandbox of an ended task not released starts a runner. A released task
        # is forgotten (decision 071), and its entry goes.
        self._task_of_sandbox: dict[str, str] = {}
        self._releasing = asyncio.Semaphore(RELEASES_AT_ONCE)

    async def run(self) -> None:
        check_configuration()
        async with self._shell as shell:
            self._nc, self._js = shell.nc, shell.js
            shell.on_close(self._end_runners)
            shell.on_close(self._close_http)
            self._output = OutputLog(shell.js, self._names)
            sandbox_store = shell.store(
                "sandbox", sb.evolve, compact=sb.compact, forget=sb.forgettable
            )
            # Each instance appends as itself: the log says which one drove what.
            self.tasks = shell.store(
                "task",
                tk.evolve,
                actor=self._instance,
                compact=tk.compact,
                forget=tk.forgettable,
            )
            self.tasks.on_forget(self._task_forgotten)
            self._sandbox_store = sandbox_store
            self._sandboxes = Sandboxes(shell.nc, self._names, sandbox_store)
            self._save_store = SaveStore(shell.nc, self._names)
            self._driving = Driving(
                self.tasks,
                await instance_bucket(shell.js, self._names),
                self.name,
                self._instance,
                lease_ttl_s=self._lease_ttl_s,
                fence_margin_s=self._fence_margin_s,
            )
            await self._driving.start()
            shell.on_close(self._driving.twins.stop)
            shell.spawn(self._driving.lease.run(), "lease renewal")
            self.tasks.listen(self._task_changed)
            await shell.start_stores()
            consumer = ConsumerConfig(
                durable_name="orchestrator",
                ack_policy=AckPolicy.EXPLICIT,
                # Deciding a task request takes milliseconds: one delivered to an
                # orchestrator that died goes to the next one soon.
                ack_wait=5,
                max_deliver=10,
                filter_subject=self._names.requests("task"),
            )
            sandbox_store.listen(self._sandbox_changed)
            shell.spawn(self._watch_tasks(), "task claims")
            await shell.work_queue(
                self._names.requests_stream, consumer, self._handle, what="task requests"
            )
            log.info("%s ready: %d task(s) may need a runner", self._instance, len(self._pending))
            await shell.serve()

    async def shutdown(self) -> None:
        self._shell.stop()

    async def _end_runners(self) -> None:
        runners = list(self._runners.values())
        for runner in runners:
            runner.cancel()
        if runners:
            await asyncio.wait(runners, timeout=5)

    async def _close_http(self) -> None:
        self._http.close()

    # --- requests ----------------------------------------------------------------

    async def _handle(self, msg: Msg) -> None:
        request = await answer(self._nc, self._names, msg, _REQUESTS, self._decide)
        if request is not None:
            # A submit is driven where it was taken (tasks spread as requests do);
            # a cancel is acted on by the task's driver, or here if it has none live.
            self._ensure_runner(tk.aggregate_of(request), asked=True)

    async def _decide(self, request: tk.AnyTaskRequest) -> bytes:
        task_id = tk.aggregate_of(request)
        kept = isinstance(request, tk.SubmitTask) and bool(request.secrets)
        if isinstance(request, tk.SubmitTask) and kept:
            existing = self.tasks.get(task_id)[0]
            if existing is None:  # not held: new, or released and forgotten (decision 071)
                existing, _ = await self.tasks.read_whole(task_id)
            if existing is None:  # kept before the event naming them
                await secret_store.keep(
                    self._js, self._names, self._names.task_secret(task_id), request.secrets
                )
            else:
                kept = False  # a retry: the first submit's are kept (or used, and gone)
        try:
            executed = await self.tasks.execute(
                task_id,
                lambda state: tk.decide(state, request),
                id_base=f"req:{request.key}",
                causation_id=request.key,
                correlation_id=request.key,
                # An ended task's outputs are in the log only; its view shows them.
                whole=lambda state: tk.whole_needed(state, request),
            )
        except Rejected:
            if kept:
                await secret_store.forget(self._js, self._names, self._names.task_secret(task_id))
            raise
        assert executed.state is not None
        reply = TaskReply(ok=True, task=task_view(executed.state))
        return _fitting(reply, self._nc.max_payload)

    # --- which tasks this instance drives -------------------------------------------

    async def _watch_tasks(self) -> None:
        """While the lease has lapsed, no runner runs here (the self-fence); once it
        is held again, every task that wants a driver and has no live one is claimed."""
        lease, fenced = self._driving.lease, False
        while True:
            if not lease.held():
                if not fenced:
                    log.error(
                        "%s could not renew its lease for %.1fs: its runners stop until it does",
                        self._instance,
                        lease.ttl,
                    )
                    fenced = True
                self._stop_runners(lambda term: True, why="the lease lapsed")
            else:
                if fenced:
                    log.warning("%s renewed its lease again: claiming anew", self._instance)
                    fenced = False
                self._stop_runners(lambda term: term != lease.term, why="the lease lapsed")
                if self._driving.may_claim():
                    for task_id in list(self._pending):
                        self._ensure_runner(task_id)
            await asyncio.sleep(lease.interval / 2)

    def _stop_runners(self, started_in: Callable[[int], bool], *, why: str) -> None:
        for task_id, runner in self._runners.items():
            if not runner.done() and started_in(self._runner_terms.get(task_id, 0)):
                log.warning("%s: %s's runner stops: %s", task_id, self._instance, why)
                runner.cancel()

    # --- runners ------------------------------------------------------------------

    def _task_changed(self, task_id: str) -> None:
        state, _ = self.tasks.get(task_id)
        if state is None:
            return
        runner = self._live.get(task_id)
        if runner is not None:
            runner.changed.set()
            if state.driver_epoch != runner.driver.epoch:
                # Taken over: whatever it does next would be refused (and a tool's
                # call is no append): it stops now.
                log.warning(
                    "%s: taken over by %s (epoch %d); %s's runner stops",
                    task_id,
                    state.driver,
                    state.driver_epoch,
                    self._instance,
                )
                drive = self._runners.get(task_id)
                if drive is not None:
                    drive.cancel()
        self._pending.add(task_id)  # held: not released (decision 071)
        self._task_of_sandbox.setdefault(task_sandbox_id(state), task_id)

    def _task_forgotten(self, task_id: str, state: tk.Task) -> None:
        """A released task (decision 071): nothing of it is kept here."""
        self._task_of_sandbox.pop(task_sandbox_id(state), None)
        self._pending.discard(task_id)
        self._runners.pop(task_id, None)
        self._runner_terms.pop(task_id, None)
        self._driving.forget(task_id)

    def _sandbox_changed(self, sandbox_id: str) -> None:
        """A change of an ended task's sandbox, while the task is not released
        (a provisioning request decided late, after the runner stopped waiting
        or died), starts a runner: it stops the sandbox and releases the task."""
        task_id = self._task_of_sandbox.get(sandbox_id)
        if task_id is None:
            return
        state, _ = self.tasks.get(task_id)
        if state is not None and state.terminal:  # (a released one is not held)
            self._pending.add(task_id)
            self._ensure_runner(task_id)

    def _ensure_runner(self, task_id: str, *, asked: bool = False) -> None:
        state, _ = self.tasks.get(task_id)
        if state is None:
            return
        running = self._runners.get(task_id)
        if running is not None and not running.done():
            return
        if not self._driving.may_claim() or not self._driving.wants(state, asked=asked):
            return
        term = self._driving.lease.term
        self._runners[task_id] = asyncio.create_task(self._drive(task_id, term))
        self._runner_terms[task_id] = term

    async def _forget_secrets(self, task_id: str) -> None:
        """A task that ended needs its secrets no more."""
        state, _ = self.tasks.get(task_id)
        if state is not None and state.terminal and state.manifest.secrets:
            await secret_store.forget(self._js, self._names, self._names.task_secret(task_id))

    async def _drive(self, task_id: str, term: int) -> None:
        """One runner at a time per task, once this instance's claim of it is in the
        log (an ended task's sandbox is released without one); a runner that fails
        is replaced by a new one, which treats whatever it finds claimed as
        interrupted (it was)."""
        state, _ = self.tasks.get(task_id)
        if state is None:
            return
        epoch = state.driver_epoch
        if not state.terminal:
            try:
                with context.carry(self.tasks.trace_of(task_id)):  # the task's, as its runner
                    claimed = await self._driving.claim(task_id, term)
            except Exception as err:  # NATS away: the next look claims it again
                log.warning("%s: %s could not claim it: %r", task_id, self._instance, err)
                return
            if claimed is None:
                return
            epoch = claimed
        driver = self._driving.runner_claim(epoch, term)
        delay = 0.5
        # A task that ended before this start (after an upgrade: every one ended
        # since the first start) waits its turn: releases are not all at once.
        gate = self._releasing if state.terminal else contextlib.nullcontext()
        async with gate:
            while not self._shell.stopping:
                if self.tasks.get(task_id)[0] is None:
                    return  # released meanwhile (by a twin, or by an append whose ack was lost)
                runner = Runner(
                    task_id,
                    tasks=self.tasks,
                    sandboxes=self._sandboxes,
                    save_store=self._save_store,
                    work_dir=self._work_dir,
                    output=self._output,
                    proof_window_s=self._proof_window_s,
                    decision_wait_s=self._decision_wait_s,
                    http=self._http,
                    driver=driver,
                )
                self._live[task_id] = runner
                try:
                    # The runner continues the trace its task was submitted in.
                    with (
                        context.carry(self.tasks.trace_of(task_id)),
                        context.working_on(task_id=task_id),
                    ):
                        releasable = await runner.run()
                        await self._forget_secrets(task_id)
                        if releasable:  # (after the secrets: a released task is not held here)
                            await self.tasks.follow_up(task_id, tk.release, why="released")
                        else:  # a provisioning request undecided: its sandbox's next change
                            self._pending.discard(task_id)
                    if self._runners.get(task_id) is asyncio.current_task():
                        del self._runners[task_id]
                        self._runner_terms.pop(task_id, None)
                        self._driving.forget(task_id)
                    return
                except asyncio.CancelledError:
                    raise
                except Superseded as err:
                    log.warning("%s: %s's runner stops: %s", task_id, self._instance, err)
                    return
                except Exception:
                    log.exception("runner of %s failed; a new one resumes from the ledger", task_id)
                    await asyncio.sleep(delay * (1 + random.random()))
                    delay = min(delay * 2, 30.0)
                    # NATS may still be away (often why the runner failed): a sync that
                    # fails must not end this loop, or nothing drives the task any more.
                    # The next runner's appends are fenced; a stale cache only conflicts.
                    with contextlib.suppress(Exception):
                        await self.tasks.sync(task_id)
                finally:
                    self._live.pop(task_id, None)


def _fitting(reply: TaskReply, limit: int) -> bytes:
    """The reply, in one message: a ledger's recorded outputs (16 KiB a step) can
    outgrow it, so they are left out, then the steps (`task show` folds the
    whole task from the log). A reply that does not fit is never delivered."""
    data = _encoder.encode(reply)
    view = reply.task
    if len(data) <= limit or view is None:
        return data
    replace = msgspec.structs.replace
    view = replace(view, steps=[replace(step, output="") for step in view.steps])
    data = _encoder.encode(replace(reply, task=view))
    if len(data) <= limit:
        return data
    return _encoder.encode(replace(reply, task=replace(view, steps=[], attempts=[])))


def _error(code: str, message: str) -> bytes:
    return _encoder.encode(TaskReply(ok=False, error=ErrorBody(code=code, message=message)))


_REQUESTS = RequestKinds(
    decode=tk.decode_task_request,
    tag_of=tk.task_request_tag,
    tenant_of=lambda request: request.tenant,
    error=_error,
    what="task requests",
)
