"""The orchestrator: takes task requests and drives every unfinished task.

Requests (`<prefix>.req.task.<verb>.<tenant>`) come off the REQUESTS work queue: decode
strictly → decide on the task's folded state → append behind the fence →
reply → ack. Every task not yet ended has one runner; at start-up the
orchestrator replays every task and starts a runner for each unfinished one,
which resumes from the task's ledger.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from pathlib import Path

import msgspec
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig
from sandhold.bus import secret_store
from sandhold.bus.answering import RequestKinds, answer
from sandhold.bus.names import Names
from sandhold.bus.output import OutputLog
from sandhold.bus.service import Shell
from sandhold.domain import sandbox as sb
from sandhold.domain import task as tk
from sandhold.domain.errors import Rejected
from sandhold.domain.task_views import TaskReply, task_view
from sandhold.domain.views import ErrorBody
from sandhold.orchestrator.faults import check_configuration
from sandhold.orchestrator.http_tool import Egress, HttpTool
from sandhold.orchestrator.runner import Runner, task_sandbox_id
from sandhold.orchestrator.sandboxes import Sandboxes
from sandhold.saves import SaveStore
from sandhold.telemetry import context

log = logging.getLogger("sandhold.orchestrator")

_encoder = msgspec.json.Encoder()


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
    ) -> None:
        self._names = names
        self._shell = Shell(self.name, nats_url, names)
        self._work_dir = work_dir
        # JetStream remembers message ids for 120 s (the streams' duplicate window):
        # inside this margin a re-send shows whether a request had left.
        self._proof_window_s = proof_window_s
        self._decision_wait_s = decision_wait_s
        self._http = HttpTool(egress=http_egress)
        self._runners: dict[str, asyncio.Task[None]] = {}
        self._live: dict[str, Runner] = {}
        # Each task's sandbox id (it follows from the task), and the last phase
        # seen of it here: a sandbox that comes up after its task ended is released.
        self._task_of_sandbox: dict[str, str] = {}
        self._sandbox_up: dict[str, bool] = {}

    async def run(self) -> None:
        check_configuration()
        async with self._shell as shell:
            self._nc, self._js = shell.nc, shell.js
            shell.on_close(self._end_runners)
            shell.on_close(self._close_http)
            self._output = OutputLog(shell.js, self._names)
            sandbox_store = shell.store("sandbox", sb.evolve)
            self.tasks = shell.store("task", tk.evolve)
            self._sandbox_store = sandbox_store
            self._sandboxes = Sandboxes(shell.nc, self._names, sandbox_store)
            self._save_store = SaveStore(shell.nc, self._names)
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
            for task_id in self.tasks.ids():
                self._ensure_runner(task_id)
            sandbox_store.listen(self._sandbox_changed)
            await shell.work_queue(
                self._names.requests_stream, consumer, self._handle, batch=16, what="task requests"
            )
            log.info("orchestrator ready: %d unfinished task(s) resumed", len(self._runners))
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
            self._ensure_runner(tk.aggregate_of(request))

    async def _decide(self, request: tk.AnyTaskRequest) -> bytes:
        task_id = tk.aggregate_of(request)
        kept = isinstance(request, tk.SubmitTask) and bool(request.secrets)
        if isinstance(request, tk.SubmitTask) and kept:
            if self.tasks.get(task_id)[0] is None:  # kept before the event naming them
                await secret_store.keep(
                    self._js, self._names, self._names.task_secret(task_id), request.secrets
                )
            else:
                kept = False  # a retry: the first submit's are kept (or used)
        try:
            executed = await self.tasks.execute(
                task_id,
                lambda state: tk.decide(state, request),
                id_base=f"req:{request.key}",
                causation_id=request.key,
                correlation_id=request.key,
            )
        except Rejected:
            if kept:
                await secret_store.forget(self._js, self._names, self._names.task_secret(task_id))
            raise
        assert executed.state is not None
        reply = TaskReply(ok=True, task=task_view(executed.state))
        return _fitting(reply, self._nc.max_payload)

    # --- runners ------------------------------------------------------------------

    def _task_changed(self, task_id: str) -> None:
        runner = self._live.get(task_id)
        if runner is not None:
            runner.changed.set()
        if task_id not in self._sandbox_up:
            state, _ = self.tasks.get(task_id)
            if state is not None:
                self._task_of_sandbox[task_sandbox_id(state)] = task_id
                self._sandbox_up[task_id] = False

    def _sandbox_changed(self, sandbox_id: str) -> None:
        """A task's sandbox that comes up after the task ended (its create was
        decided late, after the runner stopped waiting or died) is released."""
        task_id = self._task_of_sandbox.get(sandbox_id)
        if task_id is None:
            return
        state, _ = self.tasks.get(task_id)
        sandbox = self._sandboxes.state(sandbox_id)
        up = sandbox is not None and sandbox.phase in {"pending", *sb.ACTIVE_PHASES}
        came_up, self._sandbox_up[task_id] = up and not self._sandbox_up[task_id], up
        if came_up and state is not None and state.terminal:
            self._ensure_runner(task_id)

    def _ensure_runner(self, task_id: str) -> None:
        state, _ = self.tasks.get(task_id)
        if state is None:
            return
        running = self._runners.get(task_id)
        if running is not None and not running.done():
            return
        if state.terminal and not self._holds_a_sandbox(state):
            self._runners.pop(task_id, None)  # a finished runner is not kept forever
            return
        self._runners[task_id] = asyncio.create_task(self._drive(task_id))

    async def _forget_secrets(self, task_id: str) -> None:
        """A task that ended needs its secrets no more."""
        state, _ = self.tasks.get(task_id)
        if state is not None and state.terminal and state.manifest.secrets:
            await secret_store.forget(self._js, self._names, self._names.task_secret(task_id))

    def _holds_a_sandbox(self, state: tk.Task) -> bool:
        """An ended task whose sandbox is still up: the runner that ended it may
        have stopped between appending the end and stopping the sandbox, so a
        runner is started to release it (its stop key makes a repeat harmless)."""
        if state.state == "completed":
            return False
        sandbox_id = state.sandbox_id or task_sandbox_id(state)
        sandbox = self._sandboxes.state(sandbox_id)
        return sandbox is not None and sandbox.phase in {"pending", *sb.ACTIVE_PHASES}

    async def _drive(self, task_id: str) -> None:
        """One runner at a time per task; one that fails is replaced by a new one,
        which treats whatever it finds claimed as interrupted (it was)."""
        delay = 0.5
        while not self._shell.stopping:
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
            )
            self._live[task_id] = runner
            try:
                # The runner continues the trace its task was submitted in.
                with (
                    context.carry(self.tasks.trace_of(task_id)),
                    context.working_on(task_id=task_id),
                ):
                    await runner.run()
                await self._forget_secrets(task_id)
                if self._runners.get(task_id) is asyncio.current_task():
                    del self._runners[task_id]
                return
            except asyncio.CancelledError:
                raise
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
