"""The read model: rows and position in one transaction, redelivery changes
nothing, a rebuild from scratch equals the incremental one, and `replay
--verify` catches a row that does not match the log."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from pathlib import Path

import httpx
import msgspec
import pytest
from sandhold.bus.names import Names
from sandhold.bus.read import read_subjects
from sandhold.gateway.readmodel import TABLES, ReadModel

from tests.gateway.conftest import Gw, nats_client, running_sandbox
from tests.gateway.test_tasks_http import YAML
from tests.support.waiting import wait_until


def dump(path: Path) -> dict[str, list[tuple]]:
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
        out = {t: sorted(db.execute(f"SELECT * FROM {t}").fetchall()) for t in TABLES}
        out["position"] = db.execute("SELECT value FROM meta WHERE key='position'").fetchall()
    return out


async def _activity(http: httpx.AsyncClient) -> tuple[str, str]:
    """A sandbox with commands, a Snapshot and a stop with its final save; a task."""
    sandbox_id = await running_sandbox(http)
    base = f"/api/v1/sandboxes/{sandbox_id}"
    for i in range(3):
        await http.post(f"{base}/commands", json={"argv": ["sh", "-c", f"echo {i}"]})
    snap = (await http.post(f"{base}/snapshots", json={"name": "rm-test"})).json()

    async def settled():
        save = (await http.get(f"{base}/saves/{snap['id']}")).json()
        return save["state"] in ("completed", "failed")

    await wait_until(settled, timeout=60, what="the snapshot")
    stopped = (await http.post(f"{base}/stop", params={"wait": 60})).json()
    assert stopped["settled"], stopped
    task = await http.post(
        "/api/v1/tasks", content=YAML, headers={"Content-Type": "application/yaml"}
    )
    task_id = task.json()["id"]

    async def task_done():
        shown = (await http.get(f"/api/v1/tasks/{task_id}")).json()
        return shown["state"] == "completed"

    await wait_until(task_done, timeout=90, what="the task")
    return sandbox_id, task_id


async def _log_end(gw: Gw) -> int:
    async with nats_client(gw, "default") as client:
        info = await client.js.stream_info(client.names.events_stream)
    return info.state.last_seq


async def test_a_rebuild_from_scratch_equals_the_incremental_read_model(gw: Gw, tmp_path: Path):
    async with gw.http("default") as http:
        await _activity(http)
    for _ in range(5):  # until no event lands between the two reads
        end = await _log_end(gw)
        await wait_until(lambda e=end: gw.position() >= e, timeout=30, what="the read model")
        incremental = dump(gw.read_model)
        fresh = ReadModel(tmp_path / f"fresh-{end}.sqlite", Names("sh"))
        await fresh.open()
        async with nats_client(gw, "default") as client:
            counts = await fresh.rebuild(client.js)
        await fresh.close()
        if counts["position"] == int(incremental["position"][0][0]):
            break
    rebuilt = dump(tmp_path / f"fresh-{end}.sqlite")
    assert rebuilt == incremental
    assert counts["sandboxes"] >= 2 and counts["commands"] >= 4 and counts["tasks"] >= 1

    # the operator's way: the gateway drops its rows and replays the log
    done = gw.up.cli("admin", "rebuild-read-model")
    assert done.returncode == 0, done.stderr
    result = msgspec.json.decode(done.stdout)
    assert result["ok"] and result["sandboxes"] == counts["sandboxes"]
    after = dump(gw.read_model)
    if after["position"] == incremental["position"]:
        assert after == incremental


async def test_rows_and_position_move_together_and_redelivery_changes_nothing(
    gw: Gw, tmp_path: Path
):
    async with gw.http("default") as http:
        sandbox_id = await running_sandbox(http)
        await http.post(f"/api/v1/sandboxes/{sandbox_id}/commands", json={"argv": ["true"]})
    async with nats_client(gw, "default") as client:
        raw = await read_subjects(client.js, client.names.events_stream, "sh.ev.>", raw=True)
    triples = [(m.metadata.sequence.stream, m.subject, m.data) for m in raw]
    half = len(triples) // 2

    once = ReadModel(tmp_path / "once.sqlite", Names("sh"))
    await once.open()
    assert await once.apply(triples) == len(triples)
    await once.close()

    model = ReadModel(tmp_path / "twice.sqlite", Names("sh"))
    await model.open()
    assert await model.apply(triples[:half]) == half
    # a batch that fails midway leaves neither rows nor position behind
    poisoned = [*triples[half:-1], (triples[-1][0], triples[-1][1], None)]
    with pytest.raises(TypeError):
        await model.apply(poisoned)  # type: ignore[arg-type]
    assert model.position == triples[half - 1][0]
    await model.close()
    assert dump(tmp_path / "twice.sqlite")["position"] == [(str(triples[half - 1][0]),)]

    model = ReadModel(tmp_path / "twice.sqlite", Names("sh"))
    await model.open()  # a restart: continues from the committed position
    assert await model.apply(triples) == len(triples) - half  # redelivered ones skipped
    assert await model.apply(triples) == 0
    await model.close()
    assert dump(tmp_path / "twice.sqlite") == dump(tmp_path / "once.sqlite")


async def test_replay_verify_catches_a_corrupted_row(gw: Gw):
    async with gw.http("default") as http:
        sandbox_id, task_id = await _activity(http)
    await wait_until(
        lambda: gw.up.cli("replay", "sandbox", sandbox_id, "--verify").returncode == 0, timeout=30
    )
    ok = gw.up.cli("replay", "sandbox", sandbox_id, "--verify")
    assert ok.returncode == 0 and "matches the log" in ok.stdout, ok.stdout + ok.stderr
    assert gw.up.cli("replay", "task", task_id, "--verify").returncode == 0

    with contextlib.closing(sqlite3.connect(gw.read_model, timeout=10)) as db, db:
        db.execute(
            "UPDATE commands SET state = 'running' WHERE sandbox_id = ? AND rowid = "
            "(SELECT min(rowid) FROM commands WHERE sandbox_id = ?)",
            (sandbox_id, sandbox_id),
        )
        db.execute("UPDATE tasks SET state = 'failed' WHERE id = ?", (task_id,))
    bad = gw.up.cli("replay", "sandbox", sandbox_id, "--verify")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert (
        "DIFFERENT commands" in bad.stdout
        and "state: log 'exited', read model 'running'" in bad.stdout
    )
    bad_task = gw.up.cli("replay", "task", task_id, "--verify")
    assert bad_task.returncode == 1 and "DIFFERENT tasks" in bad_task.stdout

    replayed = gw.up.cli("replay", "task", task_id)
    assert replayed.returncode == 0 and "completed" in replayed.stdout, replayed.stderr
    timeline = gw.up.cli("history", "task", task_id).stdout
    for what in ("task.submitted", "task.step_claimed", "task.completed", "orchestrator"):
        assert what in timeline, what

    assert gw.up.cli("admin", "rebuild-read-model").returncode == 0
    assert gw.up.cli("replay", "sandbox", sandbox_id, "--verify").returncode == 0
    assert gw.up.cli("replay", "task", task_id, "--verify").returncode == 0


async def test_a_list_waits_for_the_log_not_for_the_read_models_pace(gw: Gw, tmp_path: Path):
    """Once caught up, the read model takes what came in batches, at most every
    pace (decision 087); a reader asking for the log's end has it fetched now.
    With a minute's pace, each wait below is far shorter."""
    async with gw.http("default") as http:
        sandbox_id = await running_sandbox(http)
    model = ReadModel(tmp_path / "paced.sqlite", Names("sh"), pace_s=60.0)
    await model.open()
    try:
        async with nats_client(gw, "default") as client:
            following = asyncio.create_task(model.follow(client.js))
            try:
                assert await model.wait_for(await model.log_end(client.js), 20), "caught up"
                async with gw.http("default") as http:
                    done = await http.post(
                        f"/api/v1/sandboxes/{sandbox_id}/commands", json={"argv": ["true"]}
                    )
                assert done.status_code == 202, done.text  # queued: appended to the log
                end = await model.log_end(client.js)
                assert await model.wait_for(end, 20), "it waited for its pace"
            finally:
                following.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await following
    finally:
        await model.close()
    rows = dump(tmp_path / "paced.sqlite")
    assert int(rows["position"][0][0]) >= end
