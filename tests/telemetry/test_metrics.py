"""`/metrics` after a scripted run through `sandhold up` (real services, real
sandboxes): tasks that succeed, fail, hang, get cancelled and time out, a
save, a host lost and a sandbox recovered; the counts per label are right,
the task histogram counts every finished task, and a restarted metrics
service shows the same numbers (they are folded from the log)."""

from __future__ import annotations

import asyncio
import os
import signal
import urllib.request
import uuid
from collections import Counter
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from sandhold.client import Client, connect
from sandhold.domain import task as tk
from sandhold.domain.task_manifest import load_manifest

from tests.e2e.harness import Up
from tests.support.waiting import wait_until

Series = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str) -> Series:
    with urllib.request.urlopen(url, timeout=10) as answer:
        text = answer.read().decode()
    series: Series = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            wanted = {(k, v) for k, v in sample.labels.items() if not k.startswith("otel_")}
            series[(sample.name, frozenset(wanted))] = sample.value
    return series


def value(series: Series, name: str, **labels: str) -> float:
    return series.get((name, frozenset(labels.items())), 0.0)


def metrics_url(up: Up, service: str = "metrics") -> str:
    return up.runtime["metrics"][service]


async def submit(client: Client, **fields: Any) -> str:
    fields.setdefault("name", f"t-{uuid.uuid4().hex[:8]}")
    view = await client.submit_task(load_manifest(fields))
    return view.id


async def ended(client: Client, task_id: str) -> tk.Task:
    return await client.wait_for_task(
        task_id, lambda s: s if s.terminal else None, timeout=90, what=f"{task_id} to end"
    )


def sh(script: str) -> dict[str, Any]:
    return {"command": ["sh", "-c", script]}


async def test_metrics_after_a_scripted_run(tmp_path) -> None:
    up = Up(tmp_path / "data", "--hosts", "2", "--lease-ttl", "2", "--fence-margin", "1").start()
    try:
        client = await connect(up.url)
        try:
            await scripted_run(up, client)
        finally:
            await client.close()
    finally:
        up.stop()


async def scripted_run(up: Up, client: Client) -> None:
    # --- tasks: one of each end ---------------------------------------------------
    succeeds = await submit(client, agent=sh("echo done"))
    fails = await submit(client, agent=sh("exit 3"))
    hangs = await submit(
        client, agent=sh("sleep 60"), hang={"warn_after": "1s", "cancel_after": "2s"}
    )
    times_out = await submit(client, agent=sh("sleep 60"), timeouts={"task": "3s"})
    cancelled = await submit(client, agent=sh("sleep 60"))
    await client.wait_for_task(
        cancelled, lambda s: s if s.state == "running" else None, timeout=60, what="running"
    )
    await client.cancel_task(cancelled)
    tasks = [succeeds, fails, hangs, times_out, cancelled]
    finished = await asyncio.gather(*(ended(client, t) for t in tasks))
    states = {t.id: t.state for t in finished}
    assert states == {
        succeeds: "completed",
        fails: "failed",
        hangs: "failed",  # reason "hung": cancelled by the hang policy, the step failed
        times_out: "timed_out",
        cancelled: "cancelled",
    }
    hang_warnings = sum(t.hang_warnings for t in finished)
    assert hang_warnings >= 1

    # --- a save, then its host fails ------------------------------------------------
    sandbox = await client.create_sandbox()
    view = await client.wait_for_phase(sandbox.id, {"running"}, timeout=30)
    await client.exec(sandbox.id, ["sh", "-c", "head -c 100000 /dev/urandom > data"])
    timed_out = await client.exec(sandbox.id, ["sleep", "10"], timeout_s=0.5)
    assert timed_out.command.state == "timed_out"
    save = await client.snapshot(sandbox.id, "before-loss")
    assert (await client.wait_for_save(sandbox.id, save.id, timeout=60)).state == "completed"
    agent = up.service_pid(f"host-agent:{view.host}")
    os.kill(agent, signal.SIGSTOP)  # its lease stops: recovery declares the host lost
    try:
        await client.wait_for_phase(sandbox.id, {"lost"}, timeout=30)
    finally:
        os.kill(agent, signal.SIGKILL)  # gone for good (sandhold up starts a new one)
    # A command brings it back on the other host.
    recovered = await client.exec(sandbox.id, ["true"], wait_timeout=60)
    assert recovered.command.state == "exited"

    # --- what /metrics says ----------------------------------------------------------
    lost_sandboxes = (
        sum(1 for s in await client.list_sandboxes() if s.recovered_from is not None) or 1
    )
    # Commands by end state as the sandboxes' own fold has them (the task that
    # timed out ended its command `timed_out` too).
    ends: Counter[str] = Counter()
    for listed in await client.list_sandboxes(include_deleted=True):
        state = await client.sandbox_state(listed.id)
        assert state is not None
        ends.update(c.state for c in state.commands.values() if c.ended)
    assert ends["timed_out"] >= 1
    expected_counts = {
        ("tasks_submitted_total", ()): 5,
        ("tasks_completed_total", (("status", "completed"),)): 1,
        ("tasks_completed_total", (("status", "failed"),)): 2,
        ("tasks_completed_total", (("status", "timed_out"),)): 1,
        ("tasks_completed_total", (("status", "cancelled"),)): 1,
        ("task_hang_warnings_total", ()): hang_warnings,
        **{("sandhold_commands_ended_total", (("state", k),)): v for k, v in ends.items()},
        ("sandhold_saves_completed_total", (("kind", "snapshot"),)): 1,
        ("sandhold_hosts_lost_total", ()): 1,
        ("tasks_active", ()): 0,
        ("tasks_running", ()): 0,
    }

    last: dict[str, Any] = {}

    def settled() -> bool:
        series = scrape(metrics_url(up))
        last["got"] = {k: value(series, k[0], **dict(k[1])) for k in expected_counts}
        last["series"] = series
        return last["got"] == expected_counts and recovery_seen(series)

    def recovery_seen(series: Series) -> bool:
        return value(series, "sandhold_recovery_seconds_count") >= 1

    try:
        await wait_until(settled, timeout=30, interval=0.5, what="the metrics to settle")
    except AssertionError:
        assert last.get("got") == expected_counts  # shows which count is off
        raise
    series = last["series"]
    # Each task's duration is in the histogram, by status, and nowhere else.
    for status, count in (("completed", 1), ("failed", 2), ("timed_out", 1), ("cancelled", 1)):
        assert value(series, "task_duration_seconds_count", status=status) == count
    assert sum(
        v for (name, _), v in series.items() if name == "task_duration_seconds_count"
    ) == len(finished)
    assert (
        value(series, "sandhold_save_freeze_seconds_count", method="cgroup")
        + value(series, "sandhold_save_freeze_seconds_count", method="sigstop")
        >= 1
    )
    assert value(series, "sandhold_save_uploaded_bytes_total") >= 100_000
    assert value(series, "sandhold_sandboxes_lost_total") >= lost_sandboxes
    assert value(series, "sandhold_save_lag_seconds", sandbox=sandbox.id) > 0
    # The scheduler's own endpoint: request latency by request type.
    scheduler = scrape(metrics_url(up, "scheduler"))
    assert (
        value(
            scheduler,
            "sandhold_message_latency_seconds_count",
            consumer="requests",
            type="command.run",
        )
        >= 3
    )
    assert value(scheduler, "sandhold_replies_total", outcome="ok") >= 5

    # --- the same numbers after the metrics service restarts ----------------------------
    # Every count folded from the log (not the process's own, nor the count of
    # events by type: the killed host-agent's successor registers meanwhile).
    counters = {
        k: v
        for k, v in series.items()
        if k[0].endswith(("_total", "_count", "_sum"))
        and not k[0].startswith(("process_", "python_", "sandhold_events_"))
    }
    os.kill(up.service_pid("metrics"), signal.SIGKILL)

    def restarted() -> Series | None:
        try:
            again = scrape(metrics_url(up))
        except OSError:
            return None  # not listening yet
        return again if value(again, "tasks_submitted_total") == 5 else None

    again = await wait_until(restarted, timeout=30, interval=0.5, what="a new metrics service")
    assert {k: v for k, v in again.items() if k in counters} == counters
