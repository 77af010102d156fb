"""Tasks end to end, without fault injection: `sandhold up` as real processes,
a real `git daemon` on loopback, real sandboxes, a real local HTTP server.

One `sandhold up` serves the module (each test makes its own tasks); tests
wait for events with deadlines, never for a fixed time.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import nats
import pytest
import yaml
from sandhold.bus.codec import REPLY_HEADER
from sandhold.bus.permissions import inbox_prefix
from sandhold.client import Client, connect
from sandhold.domain import requests as rq
from sandhold.domain import task as tk
from sandhold.domain.errors import Rejected
from sandhold.domain.task_manifest import load_manifest, parse_manifest
from sandhold.domain.task_views import TaskReply

from tests.conftest import ROOT
from tests.e2e.harness import Up
from tests.orchestrator.conftest import GitDaemon, GitRepo, ProxyFactory, git
from tests.support.waiting import wait_until

QUICK_RETRY = {"base_delay": "0.1s", "max_delay": "0.5s"}


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory, topology: tuple[str, ...]) -> Iterator[Up]:
    # The http steps' receivers are on this machine's loopback: allowed when asked.
    running = Up(tmp_path_factory.mktemp("up") / "data", "--http-egress", "any", *topology).start()
    try:
        yield running
    finally:
        running.stop()


# --- helpers -----------------------------------------------------------------------


def manifest(**fields: Any):
    """A manifest from fields, with a unique name and quick retries by default."""
    fields.setdefault("name", f"t-{uuid.uuid4().hex[:8]}")
    fields.setdefault("retry", QUICK_RETRY)
    return load_manifest(fields)


def sh(script: str, **extra: Any) -> dict[str, Any]:
    return {"command": ["sh", "-c", script], **extra}


async def submit(client: Client, **fields: Any) -> str:
    view = await client.submit_task(manifest(**fields))
    assert view.state == "pending"
    return view.id


async def ended(client: Client, task_id: str, timeout: float = 60.0) -> tk.Task:
    try:
        return await client.wait_for_task(
            task_id, lambda s: s if s.terminal else None, timeout=timeout, what="the task's end"
        )
    except TimeoutError:
        state = await client.task_state(task_id)
        stuck = f"{state and state.state}, steps {state and state.steps}"
        # What happened next, for the report: the ledger a while later.
        with contextlib.suppress(TimeoutError):
            await client.wait_for_task(
                task_id, lambda s: s if s.terminal else None, timeout=75, what=""
            )
        records = await client.task_records(task_id)
        t0 = records[0].envelope.time
        ledger = [(r.envelope.type, round(r.envelope.time - t0, 2)) for r in records]
        raise AssertionError(
            f"{task_id} did not end in {timeout}s: {stuck}; ledger after 75s more: {ledger}"
        ) from None


async def released(client: Client, task_id: str) -> tk.Task:
    """The task once released: nothing about it changes any more (decision 071)."""
    return await client.wait_for_task(
        task_id, lambda s: s if s.released else None, timeout=30, what="its release"
    )


async def event_types(client: Client, task_id: str) -> list[str]:
    return [r.envelope.type for r in await client.task_records(task_id)]


async def command_of(client: Client, task: tk.Task, step_id: str):
    record = task.steps[step_id]
    assert record.sandbox_id and record.command_id
    sandbox = await client.sandbox_state(record.sandbox_id)
    assert sandbox is not None
    return sandbox.commands[record.command_id]


def served_repo(git_repo: GitRepo, name: str, files: dict[str, str]) -> str:
    """Another bare repo next to `git_repo` (so the same daemon serves it); its main sha."""
    source = git_repo.path.parent.parent / f"{name}-source"
    source.mkdir()
    git("init", "--quiet", "--template=", "--initial-branch=main", ".", cwd=source)
    for path, text in files.items():
        (source / path).parent.mkdir(parents=True, exist_ok=True)
        (source / path).write_text(text)
    git("add", ".", cwd=source)
    git("commit", "--quiet", "-m", "files", cwd=source)
    bare = git_repo.path.parent / f"{name}.git"
    bare.mkdir()
    git("init", "--quiet", "--template=", "--bare", ".", cwd=bare)
    git("push", "--quiet", str(bare), "main", cwd=source)
    return git("rev-parse", "HEAD", cwd=source)


# --- 1. a task with a repository completes -------------------------------------------


LIFECYCLE = [
    "task.submitted",
    "task.driver_claimed",  # by the orchestrator that took the submit (decision 036)
    "task.stage_entered:staging",
    "task.staged",
    "task.stage_entered:provisioning",
    "task.provisioned",
    "task.stage_entered:running",
    "task.step_claimed",
    "task.step_dispatched",
    "task.step_finished",
    "task.stage_entered:completing",
    "task.artifacts_collected",
    "task.completed",
    "task.released",  # its sandbox stopped: nothing about it changes (decision 071)
]


def lifecycle(records: list[Any]) -> list[str]:
    out = []
    for record in records:
        name = record.envelope.type
        if name == "task.stage_entered":
            name += f":{record.envelope.event.stage}"
        out.append(name)
    return out


@pytest.mark.cluster
async def test_a_task_with_a_repository_completes_with_output_artifacts_and_a_final_save(
    client: Client, git_repo: GitRepo, git_daemon: GitDaemon
):
    script = (
        "cat README; mkdir -p out/deep; printf 12345 > out/result.txt; "
        "printf abc > out/deep/more.txt; echo log > out/run.log"
    )
    task_id = await submit(
        client,
        repository={"url": git_daemon.url_for(git_repo.name), "ref": "main"},
        agent=sh(script),
        artifacts=["out/*.txt", "out/deep/*"],
    )
    task = await ended(client, task_id)
    assert task.state == "completed", (task.reason, task.detail)
    assert task.commit == git_repo.main
    assert task.seed_save_id is not None and task.final_save_id is not None
    step = task.steps["agent"]
    assert step.status == "finished" and step.exit_code == 0
    assert step.output == "three\n"  # README at main, read from the workspace
    sizes = {a.path: a.size for a in task.artifacts}
    assert sizes == {"out/result.txt": 5, "out/deep/more.txt": 3}
    assert {a.save_id for a in task.artifacts} == {task.snapshot_id}
    await released(client, task_id)
    assert lifecycle(await client.task_records(task_id)) == LIFECYCLE
    view = await client.show_task(task_id)
    assert view.state == "completed" and view.steps[0].output == "three\n"
    # The seed's manifest digest is recorded where it was staged and where the
    # sandbox was created: a restore of the seed reads that manifest and no other.
    [staged] = [
        r.envelope.event
        for r in await client.task_records(task_id)
        if r.envelope.type == "task.staged"
    ]
    assert len(staged.seed_manifest_digest) == 64
    assert task.sandbox_id is not None
    created = (await client.sandbox_records(task.sandbox_id))[0].envelope.event
    assert created.source_snapshot_id == task.seed_save_id
    assert created.source_snapshot_digest == staged.seed_manifest_digest
    # never reaped for being idle while its task runs: the task says when it stops
    assert created.idle_timeout_s == 0
    # ...and once stopped, kept a week (the manifest's default), then deleted
    assert created.keep_stopped_s == 7 * 86400.0
    stopped = await client.wait_for_phase(task.sandbox_id, {"stopped"}, timeout=60)
    assert stopped.keep_stopped_s == 7 * 86400.0 and stopped.deletes_at is not None


# --- 2. the CLI ------------------------------------------------------------------------


def write_manifest(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_cli_submit_watch_and_ls(up: Up, tmp_path: Path):
    name = f"cli-{uuid.uuid4().hex[:8]}"
    path = write_manifest(
        tmp_path / "task.yaml",
        f"name: {name}\nagent:\n  command: [sh, -c, 'echo hello from the agent']\n",
    )
    submitted = up.cli_json("task", "submit", path)
    assert submitted["id"].startswith("tk-") and submitted["state"] == "pending"
    watched = up.cli("task", "watch", submitted["id"])
    assert watched.returncode == 0, watched.stderr
    assert "hello from the agent" in watched.stdout
    assert "task.completed" in watched.stdout
    listed = up.cli_json("task", "ls", "--state", "completed")
    assert submitted["id"] in {view["id"] for view in listed}
    assert all(view["state"] == "completed" for view in listed)
    shown = up.cli_json("task", "show", submitted["id"])
    assert shown["name"] == name and shown["steps"][0]["output"] == "hello from the agent\n"


def test_cli_watch_exits_1_when_the_agent_fails(up: Up, tmp_path: Path):
    path = write_manifest(
        tmp_path / "task.json",
        json.dumps({"name": "fails", "agent": {"command": ["sh", "-c", "echo bad; exit 3"]}}),
    )
    submitted = up.cli_json("task", "submit", path)
    watched = up.cli("task", "watch", submitted["id"])
    assert watched.returncode == 1, watched.stdout
    shown = up.cli_json("task", "show", submitted["id"])
    assert shown["state"] == "failed" and shown["reason"] == "exit_code"
    assert shown["steps"][0]["exit_code"] == 3


def test_cli_submit_with_the_same_key_finds_the_same_task(up: Up, tmp_path: Path):
    key = f"key-{uuid.uuid4().hex[:8]}"
    first = write_manifest(tmp_path / "a.yaml", "name: same\nagent: {command: [echo, one]}\n")
    other = write_manifest(tmp_path / "b.yaml", "name: same\nagent: {command: [echo, two]}\n")
    submitted = up.cli_json("task", "submit", first, "--key", key)
    again = up.cli_json("task", "submit", first, "--key", key)
    assert again["id"] == submitted["id"]
    conflict = up.cli("task", "submit", other, "--key", key, "--json")
    assert conflict.returncode == 2 and "idempotency_conflict" in conflict.stderr
    assert up.cli("task", "watch", submitted["id"]).returncode == 0


# --- 3. malformed manifests ---------------------------------------------------------------

GOOD_AGENT = "agent: {command: [echo, hi]}\n"
MALFORMED = {
    "unknown field": ("name: x\n" + GOOD_AGENT + "bogus: 1\n", "`bogus`"),
    "bad duration": (
        "name: x\n" + GOOD_AGENT + "timeouts: {clone: 10 minutes}\n",
        "`clone`",
    ),
    "agent and pipeline": (
        "name: x\n" + GOOD_AGENT + "pipeline: [{name: a, agent: {command: [echo]}}]\n",
        "`pipeline`",
    ),
    "neither agent nor pipeline": ("name: x\n", "`agent`"),
    "bad url": (
        "name: x\n" + GOOD_AGENT + "repository: {url: 'not a url'}\n",
        "$.repository.url",
    ),
    "file url": (
        "name: x\n" + GOOD_AGENT + "repository: {url: 'file:///etc'}\n",
        "$.repository.url",
    ),
    "cancel_after not after warn_after": (
        "name: x\n" + GOOD_AGENT + "hang: {warn_after: 10s, cancel_after: 10s}\n",
        "`cancel_after`",
    ),
    "not yaml": ("{{{: [\n", "not valid YAML or JSON"),
    "empty command (json)": ('{"name": "x", "agent": {"command": []}}', "$.agent.command"),
    "a step with both kinds": (
        "name: x\npipeline: [{name: s1, agent: {command: [echo]}, http: {url: 'http://h'}}]\n",
        "$.pipeline[0]",
    ),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_manifest_exits_2_naming_the_field_and_creates_nothing(
    up: Up, tmp_path: Path, case: str
):
    text, names_the_field = MALFORMED[case]
    before = {view["id"] for view in up.cli_json("task", "ls")}
    done = up.cli("task", "submit", write_manifest(tmp_path / "bad.yaml", text), "--json")
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert names_the_field in done.stderr
    assert done.stdout == ""
    assert {view["id"] for view in up.cli_json("task", "ls")} == before


async def test_a_malformed_request_on_nats_gets_malformed_request_and_creates_nothing(
    up: Up, client: Client
):
    before = {view.id for view in await client.list_tasks()}
    good = {"name": "raw", "agent": {"command": ["echo", "hi"]}}
    payloads = [
        b"this is not json",
        json.dumps({"type": "task.submit", "key": "raw-1", "manifest": good, "x": 1}).encode(),
        json.dumps(
            {"type": "task.submit", "key": "raw-2", "manifest": {**good, "bogus": True}}
        ).encode(),
        json.dumps({"type": "task.submit", "key": "raw-3"}).encode(),
    ]
    nc = await nats.connect(up.url, inbox_prefix=inbox_prefix("operator"))
    try:
        js = nc.jetstream()
        for payload in payloads:
            inbox = nc.new_inbox()
            sub = await nc.subscribe(inbox, max_msgs=1)
            await js.publish(
                client.names.request("task.submit", "default"),
                payload,
                stream=client.names.requests_stream,
                headers={REPLY_HEADER: inbox, "Nats-Msg-Id": uuid.uuid4().hex},
            )
            reply = msgspec.json.decode((await sub.next_msg(timeout=20)).data, type=TaskReply)
            assert not reply.ok and reply.error is not None, payload
            assert reply.error.code == "malformed_request", reply.error
            assert reply.task is None
    finally:
        await nc.close()
    assert {view.id for view in await client.list_tasks()} == before
    for key in ("raw-1", "raw-2", "raw-3"):
        assert await client.task_state(tk.task_id_for("default", key)) is None


# --- 4. pipelines ----------------------------------------------------------------------


def step_events(records: list[Any]) -> list[tuple[str, str]]:
    return [
        (r.envelope.type.removeprefix("task."), r.envelope.event.step_id)
        for r in records
        if r.envelope.type.startswith("task.step_")
    ]


@pytest.mark.cluster
async def test_a_pipeline_runs_its_steps_and_loop_items_in_order_rendering_from_the_ledger(
    client: Client, git_repo: GitRepo, git_daemon: GitDaemon
):
    task_id = await submit(
        client,
        repository={"url": git_daemon.url_for(git_repo.name)},
        pipeline=[
            {"name": "prepare", "agent": sh("echo prepared-$(cat README)")},
            {
                "name": "each",
                "for_each": ["a", "b", "c"],
                "agent": sh(
                    "echo {{item}}-$SANDHOLD_ITEM-$FROM >> items.txt; paste -sd, items.txt",
                    env={"FROM": "{{steps.prepare.output}}"},
                ),
            },
            {
                "name": "final",
                "agent": {
                    "command": ["echo", "{{ steps.prepare.output }}|{{steps.each[2].output}}"]
                },
            },
        ],
    )
    task = await ended(client, task_id)
    assert task.state == "completed", (task.reason, task.detail)
    outputs = {step_id: record.output for step_id, record in task.steps.items()}
    assert outputs == {
        "prepare": "prepared-three\n",
        "each[0]": "a-a-prepared-three\n",
        "each[1]": "a-a-prepared-three,b-b-prepared-three\n",
        "each[2]": "a-a-prepared-three,b-b-prepared-three,c-c-prepared-three\n",
        "final": "prepared-three|a-a-prepared-three,b-b-prepared-three,c-c-prepared-three\n",
    }
    # One at a time: each instance is claimed, dispatched and finished before the next.
    order = ["prepare", "each[0]", "each[1]", "each[2]", "final"]
    expected = [
        (kind, step_id)
        for step_id in order
        for kind in ("step_claimed", "step_dispatched", "step_finished")
    ]
    assert step_events(await client.task_records(task_id)) == expected
    assert [task.steps[s].index for s in order] == [None, 0, 1, 2, None]
    assert len({task.steps[s].command_id for s in order}) == len(order)


# --- 5. retries ----------------------------------------------------------------------------


async def test_a_transient_clone_failure_is_retried_with_backoff_and_succeeds(
    client: Client, git_repo: GitRepo, flaky_proxy: ProxyFactory
):
    proxy = await flaky_proxy(fail_first=2, how="reset")
    task_id = await submit(
        client,
        repository={"url": proxy.url_for(git_repo.name)},
        agent=sh("cat README"),
        retry={"network": 3, "base_delay": "0.2s", "max_delay": "1s"},
    )
    task = await ended(client, task_id)
    assert task.state == "completed", (task.reason, task.detail)
    assert task.commit == git_repo.main and task.steps["agent"].output == "three\n"
    records = await client.task_records(task_id)
    failed = [r for r in records if r.envelope.type == "task.operation_failed"]
    assert [(r.envelope.event.operation, r.envelope.event.attempt) for r in failed] == [
        ("clone", 1),
        ("clone", 2),
    ]
    for record in failed:
        event = record.envelope.event
        assert event.error_class == "network" and event.reason == "network"
        assert event.retry_at is not None and event.retry_at > record.envelope.time
    # The next attempt waited for its recorded backoff.
    staged_at = next(r.envelope.time for r in records if r.envelope.type == "task.staged")
    assert staged_at >= failed[-1].envelope.event.retry_at
    types = [r.envelope.type for r in records]
    assert types.index("task.staged") > types.index("task.operation_failed")
    assert proxy.connections >= 3


async def test_a_bad_ref_fails_at_once_without_a_retry(
    client: Client, git_repo: GitRepo, flaky_proxy: ProxyFactory
):
    proxy = await flaky_proxy(fail_first=0)
    task_id = await submit(
        client,
        repository={"url": proxy.url_for(git_repo.name), "ref": "no-such-branch"},
        agent=sh("cat README"),
    )
    task = await ended(client, task_id)
    assert task.state == "failed" and task.reason == "clone_ref_not_found"
    assert task.failed_stage == "staging"
    [attempt] = task.attempts
    assert attempt.operation == "clone" and attempt.error_class == "permanent"
    assert attempt.retry_at is None
    assert proxy.connections == 1
    assert "task.staged" not in await event_types(client, task_id)
    assert task.sandbox_id is None  # nothing was provisioned


# --- 6. timeouts, each level -------------------------------------------------------------


async def test_an_agent_steps_own_timeout_ends_its_command_timed_out_and_fails_the_task(
    client: Client,
):
    task_id = await submit(client, agent=sh("echo started; exec sleep 60", timeout="1s"))
    task = await ended(client, task_id, timeout=30)
    assert task.state == "failed" and task.reason == "timed_out"
    step = task.steps["agent"]
    assert step.status == "failed" and step.reason == "timed_out"
    assert step.end_state == "timed_out" and step.output == "started\n"
    command = await command_of(client, task, "agent")
    assert command.state == "timed_out" and command.timeout_s == 1.0


async def test_the_running_stage_limit_fails_the_task_with_stage_timeout(client: Client):
    task_id = await submit(client, agent=sh("exec sleep 60"), timeouts={"running": "2s"})
    task = await ended(client, task_id, timeout=30)
    assert task.state == "failed" and task.reason == "stage_timeout"
    assert task.failed_stage == "running"
    running_at = next(
        r.envelope.time
        for r in await client.task_records(task_id)
        if r.envelope.type == "task.stage_entered" and r.envelope.event.stage == "running"
    )
    assert task.finished_at is not None and task.finished_at - running_at < 15
    command = await command_of(client, task, "agent")
    assert command.state == "timed_out"


async def test_the_task_limit_ends_the_task_timed_out(client: Client):
    task_id = await submit(client, agent=sh("exec sleep 60"), timeouts={"task": "4s"})
    task = await ended(client, task_id, timeout=30)
    assert task.state == "timed_out" and task.reason == "timed_out"
    assert task.finished_at is not None and task.finished_at - task.submitted_at < 16
    assert task.steps["agent"].status == "failed"
    command = await command_of(client, task, "agent")
    assert command.state == "timed_out"
    await released(client, task_id)
    assert (await event_types(client, task_id))[-2:] == ["task.timed_out", "task.released"]


async def test_a_clone_that_hangs_is_timed_out_per_attempt_retried_then_failed(
    client: Client, git_repo: GitRepo, flaky_proxy: ProxyFactory
):
    proxy = await flaky_proxy(fail_first=100, how="hang")
    task_id = await submit(
        client,
        repository={"url": proxy.url_for(git_repo.name)},
        agent=sh("cat README"),
        timeouts={"clone": "1s"},
        retry={"network": 2, "base_delay": "0.1s", "max_delay": "0.2s"},
    )
    task = await ended(client, task_id, timeout=40)
    assert task.state == "failed" and task.reason == "clone_timeout"
    assert [(a.operation, a.attempt, a.reason, a.error_class) for a in task.attempts] == [
        ("clone", 1, "timeout", "network"),
        ("clone", 2, "timeout", "network"),
        ("clone", 3, "timeout", "network"),
    ]
    assert [a.retry_at is not None for a in task.attempts] == [True, True, False]
    assert proxy.connections == 3


# --- 7. hang detection --------------------------------------------------------------------


async def test_a_silent_command_is_warned_then_cancelled_and_the_task_fails_hung(
    client: Client,
):
    task_id = await submit(
        client,
        agent=sh("echo one line; exec sleep 60"),
        hang={"warn_after": "1s", "cancel_after": "3s"},
    )
    task = await ended(client, task_id, timeout=30)
    assert task.state == "failed" and task.reason == "hung", task.detail
    records = await client.task_records(task_id)
    warned = [r for r in records if r.envelope.type == "task.hang_warned"]
    assert len(warned) == 1 and warned[0].envelope.event.step_id == "agent"
    assert warned[0].envelope.event.silent_s >= 1.0
    assert task.hang_warnings == 1 and task.steps["agent"].hang_warned
    step = task.steps["agent"]
    assert step.reason == "hung" and step.end_state == "interrupted"
    command = await command_of(client, task, "agent")
    assert command.state == "interrupted" and command.cancel_requested
    claimed_at = step.claimed_at
    assert step.finished_at is not None and step.finished_at - claimed_at >= 3.0


async def test_a_command_that_keeps_printing_is_never_warned(client: Client):
    task_id = await submit(
        client,
        agent=sh("i=0; while [ $i -lt 15 ]; do echo tick $i; i=$((i+1)); sleep 0.2; done"),
        hang={"warn_after": "1s", "cancel_after": "2s"},
    )
    task = await ended(client, task_id, timeout=30)
    assert task.state == "completed", (task.reason, task.detail)
    assert task.hang_warnings == 0 and not task.steps["agent"].hang_warned
    assert "task.hang_warned" not in await event_types(client, task_id)
    assert task.steps["agent"].output.count("tick") == 15


# --- 8. cancel ------------------------------------------------------------------------------


@pytest.mark.cluster
async def test_cancelling_a_running_task_interrupts_its_command(client: Client, up: Up):
    task_id = await submit(client, agent=sh("echo started; exec sleep 60"))

    async def command_running() -> bool:
        state = await client.task_state(task_id)
        record = state.steps.get("agent") if state else None
        if record is None or record.sandbox_id is None:
            return False
        sandbox = await client.sandbox_state(record.sandbox_id)
        command = sandbox.commands.get(record.command_id or "") if sandbox else None
        return command is not None and command.state == "running"

    await wait_until(command_running, timeout=30, what="the agent's command running")
    view = await client.cancel_task(task_id, key=f"cancel-{task_id}")
    assert view.cancel_requested and view.id == task_id
    task = await ended(client, task_id, timeout=30)
    assert task.state == "cancelled" and task.failed_stage == "running"
    assert task.steps["agent"].status == "failed" and task.steps["agent"].reason == "cancelled"

    async def command_ended():
        sandbox = await client.sandbox_state(task.steps["agent"].sandbox_id or "")
        command = sandbox.commands[task.steps["agent"].command_id or ""] if sandbox else None
        return command if command is not None and command.ended else None

    command = await wait_until(command_ended, timeout=30, what="the command's end")
    assert command.state == "interrupted"
    # The same cancel again: the same answer, nothing new in the ledger (once
    # released, nothing else is appended to it).
    await released(client, task_id)
    count = len(await client.task_records(task_id))
    again = await client.cancel_task(task_id, key=f"cancel-{task_id}")
    assert again.state == "cancelled" and again.cancel_requested
    assert len(await client.task_records(task_id)) == count
    assert (await event_types(client, task_id)).count("task.cancel_requested") == 1
    # A cancelled task holds no host: its sandbox is stopped.
    await client.wait_for_phase(task.sandbox_id, {"stopped"}, timeout=30)


async def test_cancelling_a_finished_task_is_rejected(client: Client):
    task_id = await submit(client, agent=sh("echo done"))
    assert (await ended(client, task_id)).state == "completed"
    with pytest.raises(Rejected) as caught:
        await client.cancel_task(task_id)
    assert caught.value.code == "task_finished"
    assert "task.cancel_requested" not in await event_types(client, task_id)


async def test_another_tenant_cannot_see_or_cancel_a_task(client: Client, up: Up):
    task_id = await submit(client, agent=sh("exec sleep 60"))
    other = await connect(up.url, tenant="other")
    try:
        with pytest.raises(Rejected) as caught:
            await other.cancel_task(task_id)
        assert caught.value.code == "task_not_found"
        with pytest.raises(Rejected) as shown:
            await other.show_task(task_id)
        assert shown.value.code == "task_not_found"
        assert task_id not in {view.id for view in await other.list_tasks()}
    finally:
        await other.close()
    state = await client.task_state(task_id)
    assert state is not None and not state.cancel_requested
    await client.cancel_task(task_id)
    assert (await ended(client, task_id, timeout=30)).state == "cancelled"


# --- 9. HTTP tool steps ---------------------------------------------------------------------


class Receiver:
    """A local HTTP server (in a thread) that records each request and answers
    from a script per path: a list of statuses, the last one repeated."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.script: dict[str, list[int]] = {}
        self._lock = threading.Lock()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length).decode() if length else ""
                with receiver._lock:
                    seen = sum(1 for c in receiver.calls if c["path"] == self.path)
                    receiver.calls.append(
                        {
                            "method": self.command,
                            "path": self.path,
                            "key": self.headers.get("Idempotency-Key"),
                            "body": body,
                        }
                    )
                    statuses = receiver.script.get(self.path, [200])
                    status = statuses[min(seen, len(statuses) - 1)]
                reply = f"{self.command} {self.path} -> {status}".encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            do_GET = do_POST = do_PUT = _answer

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}{path}"

    def to(self, path: str) -> list[dict[str, Any]]:
        with self._lock:
            return [c for c in self.calls if c["path"] == path]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    running = Receiver()
    running.thread.start()
    try:
        yield running
    finally:
        running.server.shutdown()
        running.server.server_close()
        running.thread.join(timeout=10)


@pytest.mark.cluster
async def test_an_http_step_sends_its_request_with_an_idempotency_key(
    client: Client, receiver: Receiver
):
    task_id = await submit(
        client,
        pipeline=[
            {"name": "make", "agent": sh("echo made-it")},
            {
                "name": "notify",
                "http": {
                    "url": receiver.url("/hook/{{steps.make.output}}"),
                    "headers": {"X-Step": "{{steps.make.output}}"},
                    "body": '{"result": "{{steps.make.output}}"}',
                },
            },
        ],
    )
    task = await ended(client, task_id)
    assert task.state == "completed", (task.reason, task.detail)
    [call] = receiver.to("/hook/made-it")
    assert call["method"] == "POST" and call["key"] == f"{task_id}:notify:1"
    assert json.loads(call["body"]) == {"result": "made-it"}
    step = task.steps["notify"]
    assert step.status == "finished" and step.http_status == 200
    assert step.output == "POST /hook/made-it -> 200"


async def test_an_http_4xx_fails_the_task_at_once(client: Client, receiver: Receiver):
    receiver.script["/refuse"] = [422]
    task_id = await submit(
        client,
        pipeline=[{"name": "call", "http": {"url": receiver.url("/refuse"), "method": "PUT"}}],
    )
    task = await ended(client, task_id)
    assert task.state == "failed" and task.reason == "http_status"
    assert "HTTP 422" in task.steps["call"].detail
    [attempt] = task.attempts
    assert attempt.error_class == "permanent" and attempt.retry_at is None
    assert len(receiver.to("/refuse")) == 1


async def test_an_http_5xx_is_retried_with_a_new_key_per_attempt(
    client: Client, receiver: Receiver
):
    receiver.script["/flaky"] = [503, 500, 200]
    task_id = await submit(
        client,
        pipeline=[{"name": "call", "http": {"url": receiver.url("/flaky")}}],
        retry={"network": 3, "base_delay": "0.1s", "max_delay": "0.3s"},
    )
    task = await ended(client, task_id)
    assert task.state == "completed", (task.reason, task.detail)
    keys = [c["key"] for c in receiver.to("/flaky")]
    assert keys == [f"{task_id}:call:{n}" for n in (1, 2, 3)]
    assert [(a.operation, a.attempt, a.error_class) for a in task.attempts] == [
        ("call", 1, "network"),
        ("call", 2, "network"),
    ]
    assert all(a.retry_at is not None for a in task.attempts)
    record = task.steps["call"]
    assert record.attempt == 3 and record.status == "finished" and record.http_status == 200


async def test_an_http_5xx_past_the_retry_budget_fails_the_task(client: Client, receiver: Receiver):
    receiver.script["/down"] = [502]
    task_id = await submit(
        client,
        pipeline=[{"name": "call", "http": {"url": receiver.url("/down")}}],
        retry={"network": 1, "base_delay": "0.1s", "max_delay": "0.2s"},
    )
    task = await ended(client, task_id)
    assert task.state == "failed" and task.reason == "http_status"
    assert len(receiver.to("/down")) == 2
    assert [a.retry_at is not None for a in task.attempts] == [True, False]


# --- the examples, against a local repository -------------------------------------------------


def example(name: str, **changes: Any) -> dict[str, Any]:
    data = yaml.safe_load((ROOT / "examples" / name).read_text())
    parse_manifest((ROOT / "examples" / name).read_text())  # valid as shipped
    data["name"] = f"{data['name']}-{uuid.uuid4().hex[:6]}"
    for path, value in changes.items():
        target = data
        *parents, leaf = path.split(".")
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        target[leaf] = value
    return data


async def test_the_task_example_runs_against_a_local_repository(
    client: Client, git_repo: GitRepo, git_daemon: GitDaemon
):
    data = example(
        "task.yaml",
        **{"repository.url": git_daemon.url_for(git_repo.name), "repository.ref": "main"},
    )
    task_id = (await client.submit_task(load_manifest(data))).id
    task = await ended(client, task_id)
    assert task.state == "completed", (task.reason, task.detail)
    assert task.commit == git_repo.main
    assert {a.path for a in task.artifacts} >= {"out/files.txt", "out/status.txt"}
    assert "README" in task.steps["agent"].output


async def test_the_pipeline_example_runs_against_a_local_repository(
    client: Client, git_repo: GitRepo, git_daemon: GitDaemon, receiver: Receiver
):
    data = example(
        "pipeline.yaml",
        **{
            "repository.url": git_daemon.url_for(git_repo.name),
            "repository.ref": "main",
            "pipeline.3.http.url": receiver.url("/hooks/sandhold"),
        },
    )
    task_id = (await client.submit_task(load_manifest(data))).id
    task = await ended(client, task_id)
    assert task.state == "completed", (task.reason, task.detail)
    assert task.steps["check[0]"].output == "README: present\n"
    assert task.steps["check[1]"].output == "LICENSE: missing\n"
    summary = task.steps["summary"].output
    assert summary.startswith("files: 1\n") and "Makefile: missing" in summary
    [call] = receiver.to("/hooks/sandhold")
    assert call["body"] == summary.strip() and call["key"] == f"{task_id}:notify:1"
    assert {a.path for a in task.artifacts} == {"out/checks.txt", "out/summary.txt"}


# --- edges -------------------------------------------------------------------------------------


async def test_a_missing_executable_fails_the_task_at_once_without_a_retry(client: Client):
    task_id = await submit(client, agent={"command": ["no-such-agent-program"]})
    task = await ended(client, task_id)
    assert task.state == "failed" and task.reason == "launch_failed", task.detail
    assert "no-such-agent-program" in task.detail
    assert task.steps["agent"].attempt == 1 and task.attempts == []


async def test_an_agent_sees_the_environment_its_cwd_and_the_task_identity(
    client: Client, git_repo: GitRepo, git_daemon: GitDaemon
):
    served_repo(git_repo, "nested", {"src/app/main.txt": "inside\n", "README": "top\n"})
    task_id = await submit(
        client,
        repository={"url": git_daemon.url_for("nested.git")},
        environment={"SHARED": "from-task", "OVERRIDDEN": "task"},
        agent=sh(
            "cat main.txt; echo $SHARED $OVERRIDDEN $SANDHOLD_TASK_ID $SANDHOLD_STEP "
            "$SANDHOLD_STEP_KEY",
            cwd="src/app",
            env={"OVERRIDDEN": "step"},
        ),
    )
    task = await ended(client, task_id)
    assert task.state == "completed", (task.reason, task.detail)
    assert task.steps["agent"].output == (
        f"inside\nfrom-task step {task_id} agent {task_id}:agent:1\n"
    )


async def test_a_long_output_is_recorded_by_its_tail(client: Client):
    task_id = await submit(client, agent=sh("seq 1 20000"))
    task = await ended(client, task_id)
    assert task.state == "completed", (task.reason, task.detail)
    output = task.steps["agent"].output
    assert len(output.encode()) <= 16 * 1024 and output.endswith("19999\n20000\n")


async def test_a_loop_of_http_calls_sends_each_item(client: Client, receiver: Receiver):
    task_id = await submit(
        client,
        pipeline=[
            {
                "name": "each",
                "for_each": ["x", "y"],
                "http": {"url": receiver.url("/item/{{item}}"), "method": "GET"},
            }
        ],
    )
    task = await ended(client, task_id)
    assert task.state == "completed", (task.reason, task.detail)
    calls = [(c["method"], c["path"], c["key"]) for c in receiver.calls]
    assert calls == [
        ("GET", "/item/x", f"{task_id}:each[0]:1"),
        ("GET", "/item/y", f"{task_id}:each[1]:1"),
    ]


async def test_cancelling_a_task_while_its_clone_hangs_ends_it_in_staging(
    client: Client, git_repo: GitRepo, flaky_proxy: ProxyFactory
):
    proxy = await flaky_proxy(fail_first=100, how="hang")
    task_id = await submit(
        client, repository={"url": proxy.url_for(git_repo.name)}, agent=sh("cat README")
    )
    await wait_until(lambda: proxy.connections >= 1, timeout=30, what="the clone connecting")
    await client.cancel_task(task_id)
    task = await ended(client, task_id, timeout=30)
    assert task.state == "cancelled" and task.failed_stage == "staging"
    assert task.sandbox_id is None and task.attempts == []


async def test_the_task_limit_applies_while_staging_too(
    client: Client, git_repo: GitRepo, flaky_proxy: ProxyFactory
):
    proxy = await flaky_proxy(fail_first=100, how="hang")
    task_id = await submit(
        client,
        repository={"url": proxy.url_for(git_repo.name)},
        agent=sh("cat README"),
        timeouts={"task": "2s"},
    )
    task = await ended(client, task_id, timeout=40)
    assert task.state == "timed_out" and task.failed_stage == "staging"
    assert task.sandbox_id is None
    assert task.finished_at is not None and task.finished_at - task.submitted_at < 3.5


def test_cli_watch_exits_with_each_outcome(up: Up, tmp_path: Path):
    outcomes = {
        "timed_out": ("agent: {command: [sleep, '30']}\ntimeouts: {task: 3s}\n", 124),
        "cancelled": ("agent: {command: [sleep, '30']}\n", 130),
    }
    for state, (body, code) in outcomes.items():
        path = write_manifest(
            tmp_path / f"{state}.yaml", f"name: {state.replace('_', '-')}\n{body}"
        )
        task_id = up.cli_json("task", "submit", path)["id"]
        if state == "cancelled":
            cancelled = up.cli("task", "cancel", task_id, "--json")
            assert cancelled.returncode == 0, cancelled.stderr
        watched = up.cli("task", "watch", task_id)
        assert watched.returncode == code, (state, watched.stdout, watched.stderr)
        assert up.cli_json("task", "show", task_id)["state"] == state


async def test_a_task_can_start_from_another_tasks_snapshot(
    client: Client, git_repo: GitRepo, git_daemon: GitDaemon
):
    first_id = await submit(
        client,
        repository={"url": git_daemon.url_for(git_repo.name)},
        agent=sh("mkdir -p out; echo carried over > out/note.txt"),
        artifacts=["out/*"],
    )
    first = await ended(client, first_id)
    assert first.state == "completed" and first.snapshot_id is not None
    second_id = await submit(
        client, sandbox={"from_snapshot": first.snapshot_id}, agent=sh("cat out/note.txt README")
    )
    second = await ended(client, second_id)
    assert second.state == "completed", (second.reason, second.detail)
    assert second.steps["agent"].output == "carried over\nthree\n"
    assert second.commit is None and second.seed_save_id is None


async def test_a_failed_task_releases_its_sandbox(client: Client):
    task_id = await submit(client, agent=sh("exit 5"))
    task = await ended(client, task_id)
    assert task.state == "failed" and task.steps["agent"].exit_code == 5
    assert task.sandbox_id is not None
    after = await released(client, task_id)
    # Released once its sandbox's stop was decided (decision 071), and its view says so.
    sandbox = await client.sandbox_state(task.sandbox_id)
    assert sandbox is not None and sandbox.phase in ("stopping", "stopped"), sandbox.phase
    assert after.state == "failed" and (await client.show_task(task_id)).released
    view = await client.wait_for_phase(task.sandbox_id, {"stopped"}, timeout=30)
    assert view.phase == "stopped"


def test_cli_lists_a_running_task_and_watch_streams_its_output(up: Up, tmp_path: Path):
    script = "echo first; sleep 2; echo second; sleep 2; echo third"
    path = write_manifest(
        tmp_path / "stream.yaml", f"name: streams\nagent: {{command: [sh, -c, '{script}']}}\n"
    )
    task_id = up.cli_json("task", "submit", path)["id"]
    deadline = time.monotonic() + 30
    while task_id not in {v["id"] for v in up.cli_json("task", "ls", "--state", "running")}:
        assert time.monotonic() < deadline, "the task was never listed as running"
    watched = up.cli("task", "watch", task_id)
    assert watched.returncode == 0, watched.stderr
    out = watched.stdout
    assert out.index("first") < out.index("second") < out.index("third")
    assert out.count("third") >= 1
    assert task_id not in {v["id"] for v in up.cli_json("task", "ls", "--state", "running")}


async def test_the_stage_limit_ends_a_hanging_staging_on_time(
    client: Client, git_repo: GitRepo, flaky_proxy: ProxyFactory
):
    proxy = await flaky_proxy(fail_first=100, how="hang")
    task_id = await submit(
        client,
        repository={"url": proxy.url_for(git_repo.name)},
        agent=sh("cat README"),
        timeouts={"stage": "2s"},
        retry={"network": 3, "base_delay": "0.1s", "max_delay": "0.2s"},
    )
    task = await ended(client, task_id, timeout=40)
    assert task.state == "failed" and task.reason == "stage_timeout", task.reason
    assert task.failed_stage == "staging"
    staging_at = next(
        r.envelope.time
        for r in await client.task_records(task_id)
        if r.envelope.type == "task.stage_entered"
    )
    # No clone attempt outlives the stage: the orchestrator's own work has no
    # host to wait for, so its limit is kept to the second.
    assert task.finished_at is not None and task.finished_at - staging_at < 3.5


@pytest.fixture
def garbage_server() -> Iterator[tuple[str, list[int]]]:
    """A TCP server on loopback answering every request with bytes that are not HTTP."""
    listener = socket.create_server(("127.0.0.1", 0))
    connections: list[int] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                connections.append(1)
                conn.recv(65536)
                conn.sendall(b"this is not http\r\n\r\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/hook", connections
    finally:
        # close() alone does not wake a thread blocked in accept(); shutdown does.
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        thread.join(timeout=10)
        assert not thread.is_alive()


async def test_an_answer_that_is_not_http_fails_the_step_as_a_network_error(
    client: Client, garbage_server: tuple[str, list[int]]
):
    url, connections = garbage_server
    task_id = await submit(
        client,
        pipeline=[{"name": "call", "http": {"url": url}}],
        retry={"network": 1, "base_delay": "0.1s", "max_delay": "0.2s"},
    )
    task = await ended(client, task_id, timeout=30)
    assert task.state == "failed" and task.reason == "http_error", task.detail
    assert [(a.attempt, a.error_class) for a in task.attempts] == [(1, "network"), (2, "network")]
    assert len(connections) == 2


async def test_a_rendered_url_that_cannot_be_sent_fails_the_step_at_once(
    client: Client, receiver: Receiver
):
    task_id = await submit(
        client,
        pipeline=[
            {"name": "make", "agent": sh("echo two words")},
            {"name": "call", "http": {"url": receiver.url("/x/{{steps.make.output}}")}},
        ],
    )
    task = await ended(client, task_id, timeout=30)
    assert task.state == "failed" and task.reason == "http_error", task.detail
    assert len(task.attempts) == 1, task.attempts
    [attempt] = task.attempts
    assert attempt.error_class == "permanent" and attempt.retry_at is None
    assert "InvalidURL" in task.steps["call"].detail
    assert receiver.calls == []


async def test_a_task_cancelled_while_provisioning_leaves_no_sandbox_running(
    client: Client, git_repo: GitRepo, git_daemon: GitDaemon
):
    key = f"prov-{uuid.uuid4().hex[:8]}"
    task_id = tk.task_id_for("default", key)
    cancelled: list[asyncio.Task[Any]] = []

    async def on_event(msg: Any) -> None:
        event = msgspec.json.decode(msg.data)["event"]
        if event["type"] == "task.stage_entered" and event["stage"] == "provisioning":
            cancelled.append(asyncio.ensure_future(client.cancel_task(task_id)))

    # Cancel the moment provisioning begins: the create request is then in flight.
    # No host has room for the sandbox (it waits, pending), so provisioning lasts
    # until the cancel is decided: a quick host could otherwise start it first.
    sub = await client.nc.subscribe(client.names.events("task", task_id), cb=on_event)
    try:
        await client.submit_task(
            manifest(
                repository={"url": git_daemon.url_for(git_repo.name)},
                sandbox={"memory_limit_bytes": 2**60},
                agent=sh("cat README"),
            ),
            key=key,
        )
        task = await ended(client, task_id, timeout=30)
    finally:
        await sub.unsubscribe()
    await asyncio.gather(*cancelled)
    assert task.state == "cancelled" and task.failed_stage == "provisioning", task.failed_stage
    sandbox_id = rq.sandbox_id_for("default", f"{task_id}:sandbox")

    async def settled():
        sandbox = await client.sandbox_state(sandbox_id)
        return sandbox if sandbox is not None and sandbox.phase in ("stopped", "failed") else None

    # The create left before the cancel did (the runner sends it on entering
    # provisioning), so the sandbox exists: it must end stopped, not left waiting
    # to run once a host has room.
    await wait_until(settled, timeout=30, what=f"{sandbox_id} stopped")
    # Then nothing about the task can change: it is released (decision 071).
    await released(client, task_id)


async def test_a_task_with_much_recorded_output_is_still_answered(client: Client):
    """A reply to a submit or cancel is one NATS message (1 MB by default): it
    must fit however much output the task's ledger holds."""
    body = b"x" * 16 * 1024

    class Large(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server API
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Large)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/{{{{item}}}}"
        items = [str(i) for i in range(80)]  # 80 recorded outputs of 16 KiB
        m = manifest(
            pipeline=[{"name": "large", "for_each": items, "http": {"url": url, "method": "GET"}}]
        )
        again = await submitted_again_once_completed(client, m)
        assert len(again.steps) == len(items)
    finally:
        server.shutdown()
        server.server_close()


async def test_a_submit_again_after_the_end_is_answered_with_the_recorded_output(
    client: Client,
):
    """The orchestrator keeps an ended task without its recorded outputs
    (decision 059): the submit's retry is answered from the whole task, read
    back from the log, as it was before the task ended."""
    again = await submitted_again_once_completed(client, manifest(agent=sh("echo kept")))
    assert [step.output for step in again.steps] == ["kept\n"]


async def submitted_again_once_completed(client: Client, m: Any) -> Any:
    """The answer to a submit's retry with the same key, once the task completed."""
    key = f"again-{uuid.uuid4().hex[:8]}"
    view = await client.submit_task(m, key=key)
    task = await ended(client, view.id)
    assert task.state == "completed", (task.reason, task.detail)
    again = await asyncio.wait_for(client.submit_task(m, key=key), 20)
    assert (again.id, again.state) == (view.id, "completed")
    return again


async def test_a_long_output_whose_head_the_output_stream_dropped_is_recorded_by_its_tail(
    up: Up, client: Client
):
    """The OUTPUT stream has limits (age, bytes): a long command's first chunks can
    be gone when it ends. The step's recorded output is still its tail, read
    without the whole output."""
    name = client.names.output_stream
    admin = await connect(up.admin_url)  # stream limits are the admin's
    info = await admin.js.stream_info(name)
    original = info.config
    await admin.js.update_stream(_with(original, max_msgs_per_subject=3))
    try:
        script = "for i in $(seq 1 12); do printf 'line %02d\\n' $i; sleep 0.2; done"
        task_id = await submit(client, agent=sh(script))
        task = await ended(client, task_id)
    finally:
        await admin.js.update_stream(_with(original, max_msgs_per_subject=-1))
        await admin.close()
    assert task.state == "completed", (task.reason, task.detail)
    output = task.steps["agent"].output
    assert output.endswith("line 11\nline 12\n"), repr(output)
    assert "line 01" not in output


def _with(config: Any, **changes: Any) -> Any:
    import dataclasses

    return dataclasses.replace(config, **changes)
