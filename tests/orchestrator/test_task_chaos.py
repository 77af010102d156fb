"""The seed's chaos test, for real: ten tasks, the orchestrator and the scheduler
killed with SIGKILL mid-execution and restarted; every task completes, every
agent command ran exactly once, and no finished step ran again."""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from pathlib import Path

import pytest
from sandhold.client import connect
from sandhold.domain.task_manifest import load_manifest

from tests.e2e.harness import RunLog, Up
from tests.orchestrator.conftest import GitDaemon, GitRepo, git
from tests.support.waiting import wait_until

TASKS = 10


@pytest.fixture
def counter(tmp_path: Path) -> RunLog:
    """Where the steps count their runs (inside their sandboxes; see RunLog)."""
    return RunLog(tmp_path / "data", f".chaos-{uuid.uuid4().hex[:12]}")


def _manifest(url: str, counter: RunLog, i: int) -> dict:
    def step(name: str, seconds: float) -> dict:
        # Every run leaves a line in the sandbox's own log: the count is the truth.
        script = f"echo {name} >> {counter.inside(f'-{i}')}; cat README; sleep {seconds}"
        return {"name": name, "agent": {"command": ["sh", "-c", script]}}

    return {
        "name": f"chaos-{i}",
        "repository": {"url": url, "ref": "main"},
        "pipeline": [step("prepare", 0), step("work", 4), step("finish", 0)],
        "retry": {"base_delay": 0.2},
    }


def _lines(counter: RunLog, i: int) -> list[str]:
    return counter.lines(f"-{i}")


# Its own deadlines (90 s to get mid-run, 180 s to finish) say what is late; the
# suite's 120 s default would cut a slow but correct recovery on a loaded machine.
@pytest.mark.timeout(400)
async def test_ten_tasks_survive_the_orchestrator_and_scheduler_killed_mid_run(
    tmp_path: Path, git_repo: GitRepo, git_daemon: GitDaemon, counter: RunLog
):
    assert git("rev-parse", "main", cwd=git_repo.path) == git_repo.main
    up = Up(tmp_path / "data").start()
    try:
        client = await connect(up.url)
        try:
            ids = [
                (
                    await client.submit_task(
                        load_manifest(_manifest(git_daemon.url_for(git_repo.name), counter, i)),
                        key=f"chaos-{i}",
                    )
                ).id
                for i in range(TASKS)
            ]

            async def mid_run() -> bool:
                # Some tasks have finished a step and are inside their long one.
                states = [await client.task_state(i) for i in ids]
                return (
                    sum(
                        1
                        for s in states
                        if s is not None
                        and s.steps.get("prepare", None) is not None
                        and s.steps["prepare"].status == "finished"
                        and "work" in s.steps
                    )
                    >= 3
                )

            await wait_until(mid_run, timeout=90, interval=0.2, what="tasks inside their work step")
            killed = {name: up.service_pid(name) for name in ("orchestrator", "scheduler")}
            for pid in killed.values():
                os.kill(pid, signal.SIGKILL)
            await wait_until(
                lambda: all(up.service_pid(n) != pid for n, pid in killed.items()),
                timeout=30,
                what="both restarted",
            )

            try:
                finals = await asyncio.gather(
                    *(
                        client.wait_for_task(
                            i, lambda s: s if s.terminal else None, timeout=180, what="the end"
                        )
                        for i in ids
                    )
                )
            except TimeoutError:
                # Say where each task stood, so a stuck one can be understood.
                for task_id in ids:
                    s = await client.task_state(task_id)
                    if s is not None:
                        steps = {r.id: (r.status, r.attempt, r.reason) for r in s.steps.values()}
                        print(task_id, s.state, s.reason, steps, s.attempts)
                raise
            assert [s.state for s in finals] == ["completed"] * TASKS, [
                (s.id, s.state, s.reason, s.detail) for s in finals
            ]
            for i, state in enumerate(finals):
                # Every agent command ran exactly once: once per step, in order.
                assert _lines(counter, i) == ["prepare", "work", "finish"], i
                assert all(r.attempt == 1 for r in state.steps.values())
                assert all(r.status == "finished" for r in state.steps.values())
                assert state.steps["prepare"].output.strip() == "three"  # README at main
                records = await client.task_records(state.id)
                claims = [
                    r.envelope.event for r in records if r.envelope.type == "task.step_claimed"
                ]
                assert [c.step_id for c in claims] == ["prepare", "work", "finish"]
                sandbox = await client.sandbox_state(state.sandbox_id or "")
                assert sandbox is not None and len(sandbox.commands) == 3
        finally:
            await client.close()
    finally:
        up.stop()
