"""Idle sandboxes through a real `sandhold up`: the saver stops one that has been
idle for its timeout, with its final save; the next command starts it again and
says what that cold start cost; a touch keeps one alive."""

from __future__ import annotations

import subprocess

import pytest
from sandhold.client import Client
from sandhold.domain import sandbox as sb
from sandhold.domain.errors import Rejected
from sandhold.saves import DEFAULT_CACHE_BYTES

from tests.e2e.harness import SANDHOLD, Up
from tests.support.waiting import wait_until


def _reaped(state: sb.Sandbox) -> sb.Sandbox | None:
    final = state.saves.get(state.final_save_id or "")
    if state.phase == "stopped" and state.reason == "idle" and final is not None:
        return state if final.state == "completed" else None
    return None


async def test_an_idle_sandbox_is_stopped_with_its_final_save_and_a_command_wakes_it(
    up: Up, client: Client
):
    view = await client.create_sandbox(idle_timeout_s=2, save_interval_s=3600)
    await client.wait_for_phase(view.id, {"running"}, timeout=30)
    first = await client.exec(view.id, ["sh", "-c", "echo kept > note"])
    assert first.command.state == "exited" and first.command.cold_start is None

    reaped = await client.wait_for(view.id, _reaped, timeout=60, what="stopped for being idle")
    assert reaped.generation == 1
    shown = up.cli_json("sandbox", "show", view.id)
    assert (shown["phase"], shown["reason"]) == ("stopped", "idle")
    assert shown["final_save"]["state"] == "completed"
    assert shown["idle"]["timeout_s"] == 2.0 and shown["idle"]["reaps_at"] is None

    again = await client.exec(view.id, ["cat", "note"], wait_timeout=60)
    assert again.command.state == "exited" and again.stdout == b"kept\n"
    cold = again.command.cold_start
    assert cold is not None and cold.start_ms is not None and cold.start_ms > 0
    # One host: it had the files the final save holds, so nothing was fetched.
    assert (cold.from_save, cold.bytes_fetched) == (None, 0)
    woken = await client.sandbox_state(view.id)
    assert woken is not None and woken.generation == 2


async def test_a_touch_starts_the_idle_time_again(up: Up, client: Client):
    view = await client.create_sandbox(idle_timeout_s=600)
    running = await client.wait_for_phase(view.id, {"running"}, timeout=30)
    assert running.idle is not None and running.idle.reaps_at is not None
    touched = up.cli_json("sandbox", "touch", view.id)
    assert touched["idle"]["since"] > running.idle.since
    assert touched["idle"]["reaps_at"] == touched["idle"]["since"] + 600


async def test_a_sandbox_someone_stopped_is_not_woken_by_a_command(client: Client):
    view = await client.create_sandbox(idle_timeout_s=600)
    await client.wait_for_phase(view.id, {"running"}, timeout=30)
    await client.stop_sandbox(view.id)
    stopped = await client.wait_for_phase(view.id, {"stopped"}, timeout=60)
    assert stopped.reason == ""
    with pytest.raises(Rejected) as refused:
        await client.exec(view.id, ["true"])
    assert refused.value.code == "sandbox_not_running"


async def test_a_stopped_sandbox_kept_for_its_time_is_deleted_and_its_snapshot_stays(
    up: Up, client: Client
):
    """Decision 074: a sandbox created with `--keep-stopped` is deleted by the
    saver once it has been stopped that long; its Snapshot stays."""
    created = up.cli_json("sandbox", "create", "--keep-stopped", "2s", "--wait")
    assert created["keep_stopped_s"] == 2.0 and created["deletes_at"] is None  # running
    sandbox_id = created["id"]
    assert (await client.exec(sandbox_id, ["sh", "-c", "echo kept > note"])).command.exit_code == 0
    snap = await client.snapshot(sandbox_id, "before-stop")
    await client.wait_for_save(sandbox_id, snap.id, timeout=60)
    await client.stop_sandbox(sandbox_id)
    stopped = await client.wait_for_phase(sandbox_id, {"stopped", "deleted"}, timeout=60)
    if stopped.phase == "stopped":  # (else deleted already: 2 s is short)
        assert stopped.deletes_at is not None
    deleted = await client.wait_for(
        sandbox_id,
        lambda s: s if s.phase == "deleted" else None,
        timeout=60,
        what="deleted once kept stopped for 2 s",
    )
    assert deleted.reason == "kept_stopped"
    [asked] = [
        r.envelope for r in await client.sandbox_records(sandbox_id)
        if r.envelope.type == "sandbox.delete_requested"
    ]  # fmt: skip
    settled = deleted.settled_at
    assert asked.actor == "saver" and settled is not None and asked.time >= settled + 2.0
    assert deleted.saves[snap.id].state == "completed"  # the Snapshot stays (decision 060)


def test_the_default_idle_timeout_is_published_in_up_help() -> None:
    shown = subprocess.run(
        [SANDHOLD, "up", "--help"], capture_output=True, text=True, timeout=60, check=True
    )
    assert "--idle-timeout" in shown.stdout and "(default 30m)" in " ".join(shown.stdout.split())


def test_the_cli_default_is_the_domains() -> None:
    from sandhold.cli import main

    assert main.DEFAULT_IDLE_TIMEOUT_S == sb.DEFAULT_IDLE_TIMEOUT_S
    assert main.DEFAULT_CHUNK_CACHE_MB * 2**20 == DEFAULT_CACHE_BYTES


async def test_a_second_restore_of_a_snapshot_on_a_host_comes_from_its_chunk_cache(
    up: Up, client: Client
):
    source = await client.create_sandbox(save_interval_s=3600)
    on = (await client.wait_for_phase(source.id, {"running"}, timeout=30)).host
    made = await client.exec(source.id, ["sh", "-c", "head -c 2000000 /dev/urandom > big"])
    assert made.command.exit_code == 0
    snap = await client.wait_for_save(
        source.id, (await client.snapshot(source.id, "cached")).id, timeout=60
    )
    assert snap.state == "completed"

    restores = []
    for _ in range(2):
        copy = await client.create_sandbox(from_snapshot=snap.id, save_interval_s=3600)
        started = await client.wait_for_phase(copy.id, {"running"}, timeout=60)
        state = await client.sandbox_state(copy.id)
        assert state is not None and state.last_start is not None
        restores.append(state.last_start.restore)
        same = await client.exec(copy.id, ["sha256sum", "big"])
        assert same.stdout == (await client.exec(source.id, ["sha256sum", "big"])).stdout
        assert started.host == on  # one host: the same cache
    first, second = restores
    assert first is not None and second is not None
    chunks = first.cache_hits + first.fetched_chunks
    # The host took the snapshot: what it uploaded was offered to its cache
    # (kept in the cache's own thread long before a copy is placed).
    assert first.cache_hits > 0
    # ...and whatever the first restore still fetched was kept for the second.
    assert second.cache_hits == chunks and second.fetched_chunks == 0

    def shown() -> dict | None:
        [host] = up.cli_json("host", "ls")["hosts"]
        cache = host["chunk_cache"]  # as of the host's last lease renewal
        return cache if cache["hits"] >= chunks + first.cache_hits else None

    cache = await wait_until(shown, timeout=30, interval=0.5, what="host ls to show both restores")
    assert cache["bytes"] > 0
    assert cache["limit_bytes"] == 2048 * 2**20  # sandhold up's published default
