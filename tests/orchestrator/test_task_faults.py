"""The orchestrator killed at its fault points: what each kind of step promises.

Each test runs its own `sandhold up` with `SANDHOLD_FAULT=<point>:<step>` set:
the orchestrator SIGKILLs itself there once (a marker file makes the restarted
one carry on), `sandhold up` restarts it, and the new runner walks the ledger.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from nats.js.errors import NotFoundError
from sandhold.bus.append import append
from sandhold.bus.service import connect as bus_connect
from sandhold.client import Client, connect
from sandhold.domain import events as ev
from sandhold.domain import requests as rq
from sandhold.domain import task as tk
from sandhold.domain.envelope import wrap
from sandhold.domain.task_manifest import load_manifest

from tests.e2e.harness import RunLog, Up
from tests.orchestrator.test_tasks import released
from tests.support.waiting import Readiness, wait_until


class Receiver:
    """A local HTTP server recording every call's idempotency key."""

    def __init__(self) -> None:
        self.keys: list[str] = []
        received = self.keys

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the http.server API
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                received.append(self.headers.get("Idempotency-Key", ""))
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"noted")

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Receiver:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


async def _last_request(client: Client) -> int:
    return (await client.js.stream_info(client.names.requests_stream)).state.last_seq


async def _stored_since(up: Up, after: int, family: str) -> bool:
    """Whether a request of `family` was stored after sequence `after`. (Not the
    stream's count: a request handled before may still be in it, its ack held
    until the next fetch, decision 092.) Read as the admin: no client reads the
    queue of requests."""
    async with await connect(up.admin_url) as admin:
        try:
            await admin.js.get_msg(
                admin.names.requests_stream,
                seq=after + 1,
                subject=admin.names.requests(family),
                next=True,
            )
        except NotFoundError:
            return False
        return True


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with Receiver() as r:
        yield r


@pytest.fixture
def counter(tmp_path: Path) -> RunLog:
    """Where agent commands count their runs (inside their sandbox; see RunLog)."""
    return RunLog(tmp_path / "data", f".runs-{uuid.uuid4().hex[:12]}")


class Faulty:
    """A `sandhold up` whose orchestrator dies once at `fault`."""

    def __init__(self, data_dir: Path, fault: str | None, **env: str) -> None:
        self.marker = data_dir.parent / "fault-fired"
        extra = (
            {"SANDHOLD_FAULT": fault, "SANDHOLD_FAULT_MARKER": str(self.marker)} if fault else {}
        )
        self.up = Up(data_dir, "--http-egress", "any", env={**extra, **env})  # local receivers

    @property
    def fired(self) -> bool:
        return self.marker.exists()


@pytest.fixture
async def faulty(
    tmp_path: Path, request: pytest.FixtureRequest
) -> AsyncIterator[tuple[Faulty, Client]]:
    marker = request.node.get_closest_marker("fault")
    fault, env = (marker.args[0], marker.kwargs) if marker else (None, {})
    f = Faulty(tmp_path / "data", fault, **env)
    f.up.start()
    try:
        client = await connect(f.up.url)
        try:
            yield f, client
        finally:
            await client.close()
    finally:
        f.up.stop()


async def _finished(client: Client, task_id: str, timeout: float = 90.0) -> tk.Task:
    return await client.wait_for_task(
        task_id, lambda s: s if s.terminal else None, timeout=timeout, what="the end"
    )


async def _types(client: Client, task_id: str) -> list[str]:
    return [r.envelope.type for r in await client.task_records(task_id)]


def _tool(receiver: Receiver, delivery: str) -> dict:
    return {
        "name": "hook",
        "pipeline": [
            {
                "name": "notify",
                "http": {"url": receiver.url, "body": "{{item}}"},
                "delivery": delivery,
            }
        ],
    }


def _agent(counter: RunLog, seconds: float = 0.0) -> dict:
    script = f"echo ran >> {counter.inside()}; sleep {seconds}; echo finished"
    return {
        "name": "agent-work",
        "pipeline": [{"name": "work", "agent": {"command": ["sh", "-c", script]}}],
    }


def _runs(counter: RunLog) -> int:
    return len(counter.lines())


# --- tool steps --------------------------------------------------------------------


@pytest.mark.fault("before_output_recorded:notify")
async def test_an_at_most_once_tool_step_interrupted_after_its_call_is_not_sent_again(
    faulty, receiver: Receiver
):
    f, client = faulty
    view = await client.submit_task(load_manifest(_tool(receiver, "at_most_once")))
    state = await _finished(client, view.id)
    assert f.fired
    assert state.state == "failed" and state.reason == "interrupted"
    step = state.steps["notify"]
    assert (step.status, step.reason, step.attempt) == ("failed", "interrupted", 1)
    assert receiver.keys == [tk.step_key(view.id, "notify", 1)]  # fired once, never twice


@pytest.mark.fault("after_claim:notify")
async def test_an_at_most_once_tool_step_claimed_before_a_crash_fails_without_firing(
    faulty, receiver: Receiver
):
    f, client = faulty
    view = await client.submit_task(load_manifest(_tool(receiver, "at_most_once")))
    state = await _finished(client, view.id)
    assert f.fired
    assert state.state == "failed" and state.steps["notify"].reason == "interrupted"
    assert receiver.keys == []


@pytest.mark.fault("before_output_recorded:notify")
async def test_an_at_least_once_tool_step_runs_again_with_the_same_idempotency_key(
    faulty, receiver: Receiver
):
    f, client = faulty
    view = await client.submit_task(load_manifest(_tool(receiver, "at_least_once")))
    state = await _finished(client, view.id)
    assert f.fired
    assert state.state == "completed"
    assert state.steps["notify"].status == "finished" and state.steps["notify"].output == "noted"
    key = tk.step_key(view.id, "notify", 1)
    assert receiver.keys == [key, key]  # delivered twice, de-duplicable by the receiver


# --- agent steps -------------------------------------------------------------------


async def _commands(client: Client, state: tk.Task) -> list[str]:
    assert state.sandbox_id is not None
    sandbox = await client.sandbox_state(state.sandbox_id)
    assert sandbox is not None
    return sorted(sandbox.commands)


@pytest.mark.fault("during_command:work")
async def test_an_agent_step_re_attaches_to_its_command_after_a_crash(faulty, counter: RunLog):
    f, client = faulty
    view = await client.submit_task(load_manifest(_agent(counter, seconds=2)))
    state = await _finished(client, view.id)
    assert f.fired
    assert state.state == "completed"
    step = state.steps["work"]
    assert step.status == "finished" and step.output.strip().endswith("finished")
    assert _runs(counter) == 1
    assert await _commands(client, state) == [step.command_id]
    records = await client.task_records(view.id)
    claims = [r for r in records if r.envelope.type == "task.step_claimed"]
    assert len(claims) == 1
    dispatches = [r.envelope.event for r in records if r.envelope.type == "task.step_dispatched"]
    assert [d.fresh_after_crash for d in dispatches] == [False]


@pytest.mark.fault("after_claim:work")
async def test_a_stillborn_agent_step_is_dispatched_once_after_a_crash(faulty, counter: RunLog):
    f, client = faulty
    view = await client.submit_task(load_manifest(_agent(counter)))
    state = await _finished(client, view.id)
    assert f.fired
    assert state.state == "completed"
    records = await client.task_records(view.id)
    dispatches = [r.envelope.event for r in records if r.envelope.type == "task.step_dispatched"]
    assert [d.fresh_after_crash for d in dispatches] == [True]  # proved never sent, sent now
    assert _runs(counter) == 1
    assert await _commands(client, state) == [state.steps["work"].command_id]


@pytest.mark.fault("after_send:work")
async def test_an_agent_step_whose_request_left_before_the_crash_is_not_sent_again(
    faulty, counter: RunLog
):
    f, client = faulty
    view = await client.submit_task(load_manifest(_agent(counter)))
    state = await _finished(client, view.id)
    assert f.fired
    assert state.state == "completed"
    records = await client.task_records(view.id)
    dispatches = [r.envelope.event for r in records if r.envelope.type == "task.step_dispatched"]
    assert not any(d.fresh_after_crash for d in dispatches)
    assert _runs(counter) == 1
    assert await _commands(client, state) == [state.steps["work"].command_id]


@pytest.mark.fault("after_claim:work", SANDHOLD_PROOF_WINDOW="0.001")
async def test_an_agent_step_that_cannot_be_proven_unsent_fails_honestly(faulty, counter: RunLog):
    # With no window in which JetStream's de-duplication can tell whether the
    # request left, the restarted orchestrator must not guess: the step fails.
    f, client = faulty
    view = await client.submit_task(load_manifest(_agent(counter)))
    state = await _finished(client, view.id)
    assert f.fired
    assert state.state == "failed" and state.reason == "interrupted"
    assert "not dispatching it again" in state.steps["work"].detail
    assert _runs(counter) == 0
    assert await _commands(client, state) == []


# --- cancellation survives crashes ---------------------------------------------------------


async def test_a_cancel_sent_while_the_orchestrator_is_down_is_honoured_and_stays(
    faulty, counter: RunLog
):
    f, client = faulty
    view = await client.submit_task(load_manifest(_agent(counter, seconds=120)))
    running = await client.wait_for_task(
        view.id,
        lambda s: s if "work" in s.steps and s.steps["work"].status == "dispatched" else None,
        timeout=60,
        what="the command dispatched",
    )
    await wait_until(lambda: _runs(counter) == 1, timeout=30, what="the command to start")
    pid = f.up.service_pid("orchestrator")
    os.kill(pid, signal.SIGSTOP)
    try:
        after = await _last_request(client)
        cancel = asyncio.ensure_future(client.cancel_task(view.id, key="stop-it"))
        await wait_until(
            lambda: _stored_since(f.up, after, "task"),
            timeout=10,
            what="the cancel request stored",
        )
        os.kill(pid, signal.SIGKILL)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert (await cancel).cancel_requested
    state = await _finished(client, view.id)
    assert state.state == "cancelled"
    assert state.steps["work"].reason == "cancelled"
    sandbox = await client.sandbox_state(running.sandbox_id or "")
    assert sandbox is not None
    command = sandbox.commands[running.steps["work"].command_id or ""]
    ended = await client.wait_for(
        sandbox.id,
        lambda s: c if (c := s.commands[command.id]).ended else None,
        timeout=60,
        what="the command's end",
    )
    assert ended.state == "interrupted"
    # Crash the orchestrator again: a cancelled (and released) task stays
    # cancelled, nothing is appended.
    await released(client, view.id)
    before = await _types(client, view.id)
    os.kill(f.up.service_pid("orchestrator"), signal.SIGKILL)
    other = await client.submit_task(
        load_manifest({"name": "after", "agent": {"command": ["true"]}})
    )
    assert (await _finished(client, other.id)).state == "completed"  # the new one is running
    assert await _types(client, view.id) == before
    assert before[-2:] == ["task.cancelled", "task.released"]
    assert _runs(counter) == 1


async def test_a_task_that_ended_before_its_sandbox_was_stopped_has_it_stopped_after_a_crash(
    faulty, counter: RunLog
):
    """The runner appends the task's end and then stops its sandbox: an orchestrator
    killed between the two must not leave that sandbox holding a host forever."""
    f, client = faulty
    view = await client.submit_task(load_manifest(_agent(counter, seconds=300)))
    running = await client.wait_for_task(
        view.id,
        lambda s: s if "work" in s.steps and s.steps["work"].status == "dispatched" else None,
        timeout=60,
        what="the command dispatched",
    )
    await wait_until(lambda: _runs(counter) == 1, timeout=30, what="the command to start")
    pid = f.up.service_pid("orchestrator")
    os.kill(pid, signal.SIGSTOP)
    try:
        # What a runner appends when it ends the task, as if it died right after.
        records = await client.task_records(view.id)
        record = running.steps["work"]
        ended = [
            ev.TaskStepFailed(step_id="work", attempt=record.attempt, reason="timed_out"),
            ev.TaskTimedOut(stage="running", detail="the task's limit passed"),
        ]
        # appended as the orchestrator (no other user may write a task's events)
        orchestrator = await bus_connect(f.up.url_as("orchestrator"), name="test-orchestrator")
        await append(
            orchestrator.jetstream(),
            client.names.events_stream,
            client.names.events("task", view.id),
            wrap(
                ended,
                aggregate_id=view.id,
                id_base="test:ended",
                actor="orchestrator",
                causation_id="test",
                correlation_id="test",
                time=time.time(),
            ),
            records[-1].seq,
        )
        await orchestrator.close()
        os.kill(pid, signal.SIGKILL)
    finally:
        os.kill(pid, signal.SIGCONT)
    sandbox = await client.wait_for(
        running.sandbox_id or "",
        lambda s: s if s.phase == "stopped" else None,
        timeout=90,
        what="the ended task's sandbox stopped by the restarted orchestrator",
    )
    assert sandbox.phase == "stopped"
    assert (await _finished(client, view.id)).state == "timed_out"
    # ... and then released it: nothing more is to be done for it (decision 071).
    await released(client, view.id)


DISPATCH_S, OUTAGE_S, BACK_S = 60, 30, 90


# Its own deadlines (set-up, dispatch, the outage, the way back) must fit its
# limit: on a loaded machine the way back alone — the host's lease lapsed, so it
# fenced itself; recovery declares it lost and fenced; the task retries or ends —
# has taken most of BACK_S, and the suite's 120 s cut the test short.
@pytest.mark.timeout(60 + DISPATCH_S + OUTAGE_S + BACK_S)
async def test_a_runner_failing_while_nats_is_unreachable_is_replaced_once_it_is_back(
    faulty, counter: RunLog
):
    """A runner that fails is replaced by a new one; the replacement must not
    depend on NATS answering at that very moment (it did: the sync before it
    raised and nothing drove the task any more)."""
    f, client = faulty
    view = await client.submit_task(load_manifest(_agent(counter, seconds=4)))
    await client.wait_for_task(
        view.id,
        lambda s: s if "work" in s.steps and s.steps["work"].status == "dispatched" else None,
        timeout=DISPATCH_S,
        what="the command dispatched",
    )
    nats_pid = int(f.up.runtime["nats_pid"])
    os.kill(nats_pid, signal.SIGSTOP)  # every request times out, for a while
    try:
        await asyncio.sleep(OUTAGE_S)  # noqa: ASYNC110 - an outage lasts a while, by design
    finally:
        os.kill(nats_pid, signal.SIGCONT)
    back = time.monotonic()
    # Whatever the outage did to the command, the task is driven to an end.
    state = await _finished(client, view.id, timeout=BACK_S)
    assert state.terminal
    print(f"the task ended {time.monotonic() - back:.1f}s after NATS came back ({state.state})")


async def test_a_sandbox_created_after_its_task_ended_and_a_restart_is_released(
    faulty, counter: RunLog
):
    """A task cancelled while its create request waits for a stopped scheduler:
    the sandbox comes into being after the task ended (and after the runner that
    would have waited for it was killed). It must not stay up holding a host."""
    f, client = faulty
    scheduler = f.up.service_pid("scheduler")
    os.kill(scheduler, signal.SIGSTOP)
    after = await _last_request(client)
    try:
        view = await client.submit_task(load_manifest(_agent(counter, seconds=300)))
        await client.wait_for_task(
            view.id,
            lambda s: s if s.state == "provisioning" else None,
            timeout=30,
            what="provisioning",
        )

        await wait_until(
            lambda: _stored_since(f.up, after, "sandbox"),
            timeout=10,
            what="the create request stored",
        )
        await client.cancel_task(view.id)
        state = await _finished(client, view.id, timeout=30)
        assert state.state == "cancelled" and state.failed_stage == "provisioning"
        orchestrator = f.up.service_pid("orchestrator")
        readiness = await Readiness().listen(client.nc, client.names)
        os.kill(orchestrator, signal.SIGKILL)
        await wait_until(
            lambda: f.up.service_pid("orchestrator") != orchestrator,
            timeout=30,
            what="the orchestrator restarted",
        )
        # Serving (its stores folded, its requests consumed) before the create lands.
        await readiness.wait_for("orchestrator", f.up.service_pid("orchestrator"))
        await readiness.close()
    finally:
        os.kill(scheduler, signal.SIGCONT)
    sandbox_id = rq.sandbox_id_for("default", f"{view.id}:sandbox")

    async def stopped() -> bool:
        sandbox = await client.sandbox_state(sandbox_id)
        return sandbox is not None and sandbox.phase == "stopped"

    await wait_until(stopped, timeout=60, interval=0.5, what="the late sandbox stopped")
    assert _runs(counter) == 0
