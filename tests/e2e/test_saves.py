"""Saves through a real `sandhold up`: crash consistency, interrupted saves,
incremental uploads, a failing final save, and recovery of files from a save."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import msgspec
import pytest
from nats.js.api import DiscardPolicy
from nats.js.errors import NotFoundError
from sandhold.client import Client, connect
from sandhold.domain import sandbox as sb
from sandhold.domain import saves as sv
from sandhold.domain.errors import Rejected
from sandhold.domain.views import SaveView
from sandhold.hostagent.saving import LOOK_MAX_NAMES
from sandhold.saves import SaveStore, restore
from sandhold.saves.errors import MissingManifest

from tests.e2e.conftest import running_sandbox
from tests.e2e.harness import Up
from tests.support.waiting import wait_until

MiB = 1024 * 1024

# Writes a counter into f000 ... f099 in order, over and over. At any instant the
# files read n+1 up to some index and n after it, so a save that froze the writer
# holds values differing by at most one, in that shape. A copy taken file by file
# while the writer runs would see the counter move on between files.
FILES = 100
WRITER = r"""
import os
n = 0
while True:
    n += 1
    for i in range(100):
        with open(f"f{i:03d}.tmp", "w") as f:
            f.write(str(n))
        os.replace(f"f{i:03d}.tmp", f"f{i:03d}")
"""

# A job a finished command leaves running: the sandbox is never quiet while it runs.
LEFT_BEHIND = "setsid sleep 600 > /dev/null 2>&1 < /dev/null &"
# One that also writes a file, over and over.
WRITING_JOB = (
    "setsid sh -c 'while true; do date +%s%N > stamp; sleep 0.2; done' "
    "> /dev/null 2>&1 < /dev/null &"
)


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory, topology: tuple[str, ...]) -> Iterator[Up]:
    running = Up(
        tmp_path_factory.mktemp("saves") / "data",
        "--save-interval",
        "1",
        "--save-timeout",
        "8",
        *topology,
    ).start()
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture
async def admin(up: Up) -> AsyncIterator[Client]:
    """For what no service or operator may do: change the save store's limits."""
    async with await connect(up.admin_url) as c:
        yield c


def _new(state: sb.Sandbox, before: sb.Sandbox) -> list[sv.SaveRecord]:
    return [r for r in state.saves.values() if r.id not in before.saves]


def _completed(state: sb.Sandbox) -> list[str]:
    return [s.id for s in state.saves.values() if s.state == "completed"]


async def _counters_in_save(store: SaveStore, save_id: str) -> list[int]:
    """The writer's counter in each of its files; 0 for a file it has not written
    yet (a save may come before its first round ends: its first save is due
    within half an interval of the start)."""
    manifest = await store.get_manifest(save_id)
    entries = {e.path: e for e in manifest.workspace_entries()}
    values = []
    for i in range(FILES):
        entry = entries.get(f"f{i:03d}".encode())
        content = b"".join([await store.get_chunk(d) for d in entry.chunks]) if entry else b"0"
        values.append(int(content))
    return values


@pytest.mark.cluster
async def test_every_completed_save_is_crash_consistent(client: Client):
    sandbox_id = await running_sandbox(client, save_interval_s=1)
    writer = asyncio.create_task(client.exec(sandbox_id, ["python3", "-c", WRITER], key="writer"))
    try:
        state = await client.wait_for(
            sandbox_id,
            lambda s: s if len(_completed(s)) >= 6 else None,
            timeout=90,
            what="six completed saves",
        )
    finally:
        writer.cancel()
    store = SaveStore(client.nc, client.names)
    checked = 0
    for save_id in _completed(state):
        values = await _counters_in_save(store, save_id)
        newest = max(values)
        consistent = min(values) >= newest - 1 and values == sorted(values, reverse=True)
        assert consistent, f"save {save_id} is not crash-consistent: {values}"
        checked += newest > 0  # the writer had begun
    assert checked >= 4  # the first save or two may come before it begins
    froze = [s.freeze_ms for s in state.saves.values() if s.state == "completed"]
    assert all(f is not None and f > 0 for f in froze)  # the freeze window is reported
    await client.stop_sandbox(sandbox_id)


async def test_a_quiet_sandbox_is_saved_again_only_once_something_ran(client: Client):
    """Decision 051: a save taken while nothing but the box ran holds the files
    until a command runs; a job left running keeps every interval's save coming."""
    sandbox_id = await running_sandbox(client, save_interval_s=1)
    state = await client.wait_for(
        sandbox_id,
        lambda s: s if sb_view(s).unchanged_since_save else None,
        timeout=30,
        what="a quiet save",
    )
    first = sb_view(state).unchanged_since_save
    assert first is not None and sb_view(state).rpo_s == 0.0
    # Proving that no save comes takes a span of time: three intervals here.
    await asyncio.sleep(3)
    later = await client.sandbox_state(sandbox_id)
    assert later is not None and later.saves.keys() == state.saves.keys()

    await client.exec(sandbox_id, ["sh", "-c", "echo changed > new-file"])
    state = await client.wait_for(
        sandbox_id,
        lambda s: s if sb_view(s).unchanged_since_save not in (None, first) else None,
        timeout=30,
        what="a save after the command, quiet again",
    )
    # The command's file is in a save taken after it (the first that captured it;
    # on a slow machine one may come before the command ended), none during the span.
    assert any(r.changed_bytes > 0 for r in _new(state, later))
    assert all(r.requested_at > state.saves[first].requested_at + 3 for r in _new(state, later))

    job = await client.sandbox_state(sandbox_id)
    await client.exec(sandbox_id, ["sh", "-c", LEFT_BEHIND])
    assert job is not None

    def saved_while_the_job_runs(s: sb.Sandbox) -> list[sv.SaveRecord] | None:
        # The job writes nothing, so these end `unchanged` (decision 067): taken
        # all the same, every interval, as the job could write at any moment.
        ended = [r for r in _new(s, job) if r.state in ("completed", "unchanged")]
        return ended if len(ended) >= 5 else None

    saves = await client.wait_for(
        sandbox_id, saved_while_the_job_runs, timeout=60, what="saves while a job runs"
    )
    assert not any(r.quiet for r in saves)
    state = await client.sandbox_state(sandbox_id)
    assert state is not None and sb_view(state).unchanged_since_save is None
    await client.stop_sandbox(sandbox_id)


@pytest.mark.cluster
async def test_unchanged_files_are_not_uploaded_again(client: Client, up: Up):
    sandbox_id = await running_sandbox(client, save_interval_s=3600)
    script = "for i in 1 2 3 4 5 6 7 8; do head -c 4194304 /dev/urandom > f$i; done"
    assert (await client.exec(sandbox_id, ["sh", "-c", script])).command.exit_code == 0

    async def snap(name: str):
        save = await client.snapshot(sandbox_id, name)
        return await client.wait_for_save(sandbox_id, save.id, timeout=60)

    first = await snap("one")
    assert first.state == "completed" and first.bytes == 32 * MiB
    assert first.uploaded_bytes >= 32 * MiB
    second = await snap("two")
    assert second.state == "completed" and second.uploaded_bytes == 0
    await client.exec(sandbox_id, ["sh", "-c", "head -c 1048576 /dev/urandom > f3"])
    third = await snap("three")
    assert third.state == "completed"
    assert 1 * MiB <= third.uploaded_bytes <= 1 * MiB + 256 * 1024
    await client.stop_sandbox(sandbox_id)


async def _big_change(client: Client, sandbox_id: str, name: str) -> None:
    """Enough new bytes that capture and upload each take a while."""
    result = await client.exec(sandbox_id, ["sh", "-c", f"head -c 314572800 /dev/urandom > {name}"])
    assert result.command.exit_code == 0


async def _snapshot_with_the_saver_stopped(
    up: Up, client: Client, admin: Client, sandbox_id: str, label: str
) -> tuple[int, SaveView]:
    """Request a save and SIGSTOP the saver once it has sent the host the save
    instruction, before the host can take it: the host then captures and uploads
    with no saver to verify. (Stopping the saver once the save is seen `started`
    raced a small save's upload and verification.) Returns the stopped saver's PID."""
    agent, saver = up.service_pid("host-agent:local"), up.service_pid("saver")
    queue = client.names.work("local", saves=True)

    async def queued() -> bool:
        # This save's instruction, not whatever else the queue holds (one left by
        # an earlier test made a count of pending messages say yes too soon).
        try:
            last = await admin.js.get_last_msg(client.names.hostwork_stream, queue)
        except NotFoundError:
            return False
        return msgspec.json.decode(last.data).get("save_id") == save.id

    os.kill(agent, signal.SIGSTOP)  # takes no work until the saver is stopped
    try:
        save = await client.snapshot(sandbox_id, label)
        await wait_until(queued, timeout=30, what="the saver to send the save instruction")
        os.kill(saver, signal.SIGSTOP)
    finally:
        os.kill(agent, signal.SIGCONT)
    return saver, save


@pytest.mark.parametrize("stage", ["capture", "upload"])
async def test_host_agent_killed_during_a_save_never_completes_it(
    up: Up, client: Client, stage: str
):
    sandbox_id = await running_sandbox(client, save_interval_s=3600)
    await client.exec(sandbox_id, ["sh", "-c", "echo one > note"])
    base = await client.wait_for_save(
        sandbox_id, (await client.snapshot(sandbox_id, "base")).id, timeout=60
    )
    assert base.state == "completed"
    await _big_change(client, sandbox_id, "blob")

    agent = up.service_pid("host-agent:local")
    save = await client.snapshot(sandbox_id, f"interrupted-{stage}")
    if stage == "upload":
        await client.wait_for(
            sandbox_id,
            lambda s: s if s.saves[save.id].state != "requested" else None,
            timeout=30,
            what="capture to end",
        )
    state = await client.sandbox_state(sandbox_id)
    assert state is not None and state.saves[save.id].state in (
        {"capture": "requested", "upload": "captured"}[stage],
    )
    os.kill(agent, signal.SIGKILL)

    ended = await client.wait_for_save(sandbox_id, save.id, timeout=60)
    assert ended.state == "failed", ended
    view = await client.show_sandbox(sandbox_id)
    assert view.last_completed_save is not None and view.last_completed_save.id == base.id
    # the restarted agent thawed the sandbox: it still runs commands
    await wait_until(lambda: up.service_pid("host-agent:local") != agent, what="restart")
    after = await client.exec(sandbox_id, ["cat", "note"], wait_timeout=60)
    assert after.stdout == b"one\n"
    await client.stop_sandbox(sandbox_id)


async def test_an_uploaded_save_counts_only_once_the_saver_verified_it(
    up: Up, client: Client, admin: Client
):
    sandbox_id = await running_sandbox(client, save_interval_s=3600)
    base = await client.wait_for_save(
        sandbox_id, (await client.snapshot(sandbox_id, "base")).id, timeout=60
    )
    await _big_change(client, sandbox_id, "blob")
    saver, save = await _snapshot_with_the_saver_stopped(
        up, client, admin, sandbox_id, "unverified"
    )
    try:
        state = await client.wait_for(
            sandbox_id,
            lambda s: s if s.saves[save.id].state in ("uploaded", "failed") else None,
            timeout=60,
            what="the upload",
        )
        assert state.saves[save.id].state == "uploaded"
        view = await client.show_sandbox(sandbox_id)
        assert view.last_completed_save is not None and view.last_completed_save.id == base.id
    finally:
        os.kill(saver, signal.SIGKILL)
        os.kill(saver, signal.SIGCONT)
    # the restarted saver verifies it, and only then it counts
    done = await client.wait_for_save(sandbox_id, save.id, timeout=60)
    assert done.state == "completed"
    await client.stop_sandbox(sandbox_id)


async def test_a_manifest_written_over_before_verification_fails_the_save(
    up: Up, client: Client, admin: Client
):
    """The saver verifies the manifest the host recorded (its SHA-256 in
    `save.uploaded`), not whatever the subject holds when it looks."""
    sandbox_id = await running_sandbox(client, save_interval_s=3600)
    await client.exec(sandbox_id, ["sh", "-c", "echo real > note"])
    saver, save = await _snapshot_with_the_saver_stopped(
        up, client, admin, sandbox_id, "overwritten"
    )
    try:  # no verification until the manifest is replaced
        await client.wait_for(
            sandbox_id,
            lambda s: s if s.saves[save.id].state in ("uploaded", "failed") else None,
            timeout=60,
            what="the upload",
        )
        store = SaveStore(admin.nc, admin.names)
        real = await store.get_manifest(save.id)
        assert await store.delete_manifest(save.id)
        await store.put_manifest(msgspec.structs.replace(real, created_at=real.created_at + 1))
    finally:
        os.kill(saver, signal.SIGCONT)
    done = await client.wait_for_save(sandbox_id, save.id, timeout=60)
    assert done.state == "failed" and done.stage == "verify", done
    assert "not the one its save recorded" in done.reason, done.reason
    await client.stop_sandbox(sandbox_id)


@pytest.mark.cluster
async def test_a_failing_final_save_is_reported_apart_from_the_stop(
    up: Up, client: Client, admin: Client
):
    sandbox_id = await running_sandbox(client, save_interval_s=3600)
    await client.exec(sandbox_id, ["sh", "-c", "echo saved > note"])
    base = await client.wait_for_save(
        sandbox_id, (await client.snapshot(sandbox_id, "base")).id, timeout=60
    )
    await client.exec(sandbox_id, ["sh", "-c", "echo lost > note"])

    # The save store fills up: new chunks and manifests are refused, reads still work.
    js = admin.js
    info = await js.stream_info(client.names.saves_stream)
    config = info.config
    config.max_bytes = info.state.bytes
    config.discard = DiscardPolicy.NEW
    await js.update_stream(config)
    try:
        done = up.cli("sandbox", "stop", sandbox_id, "--json")
    finally:
        config.max_bytes = -1
        config.discard = DiscardPolicy.OLD
        await js.update_stream(config)
    outcome = msgspec.json.decode(done.stdout)
    assert outcome["stopped"] is True
    assert outcome["final_save"]["state"] == "failed" and outcome["final_save"]["reason"]
    assert done.returncode == 1  # a stop whose final save failed is not a clean stop
    assert "maximum bytes exceeded" in outcome["final_save"]["reason"]
    view = await client.show_sandbox(sandbox_id)
    assert view.last_completed_save is not None and view.last_completed_save.id == base.id
    assert base.id in view.recoverable_from

    # The host's copy is gone (as after a host loss): the next start restores the
    # last completed save, which holds "saved", not the lost change.
    shutil.rmtree(up.workspace(sandbox_id).parents[2])  # its whole root, fs/
    await client.start_sandbox(sandbox_id)
    await client.wait_for_phase(sandbox_id, {"running"}, timeout=60)
    assert (await client.exec(sandbox_id, ["cat", "note"])).stdout == b"saved\n"
    await client.stop_sandbox(sandbox_id)


@pytest.mark.cluster
async def test_a_sandbox_created_from_a_snapshot_has_its_files(client: Client, tmp_path: Path):
    source = await running_sandbox(client, save_interval_s=3600)
    script = (
        "mkdir -p dir/empty && echo hello > dir/file && ln -s dir/file link && "
        "chmod 750 dir && printf '' > zero && head -c 3000000 /dev/urandom > big"
    )
    assert (await client.exec(source, ["sh", "-c", script])).command.exit_code == 0
    snap = await client.wait_for_save(source, (await client.snapshot(source, "m1")).id, timeout=60)
    assert snap.state == "completed"
    # No scheduled save of its own before the last assertion: "only the snapshot".
    copy = await client.create_sandbox(from_snapshot=snap.id, save_interval_s=3600)
    await client.wait_for_phase(copy.id, {"running"}, timeout=60)
    check = "cat dir/file && readlink link && stat -c %a dir && wc -c < zero && test -d dir/empty"
    result = await client.exec(copy.id, ["sh", "-c", check])
    assert result.stdout == b"hello\ndir/file\n750\n0\n", result
    theirs = await client.exec(copy.id, ["sha256sum", "big"])
    ours = await client.exec(source, ["sha256sum", "big"])
    assert theirs.stdout == ours.stdout
    view = await client.show_sandbox(copy.id)
    assert view.recoverable_from.startswith(f"only the snapshot {snap.id}")
    # and the store can restore that snapshot anywhere, verified
    store = SaveStore(client.nc, client.names)
    stats = await restore(store, await store.get_manifest(snap.id), tmp_path / "restored")
    # a namespaced sandbox's save holds its whole root, the workspace in it
    assert (tmp_path / "restored/root/workspace/dir/file").read_bytes() == b"hello\n"
    assert stats is not None
    # An id that names no Snapshot is refused as such (found by the scheduler's
    # index of Snapshots, not a pass over every sandbox's saves).
    other = snap.id[:-1] + ("1" if snap.id[-1] == "0" else "0")
    with pytest.raises(Rejected) as refused:
        await client.create_sandbox(from_snapshot=other)
    assert refused.value.code == "snapshot_not_found"
    for sandbox_id in (source, copy.id):
        await client.stop_sandbox(sandbox_id)


async def test_a_snapshot_whose_manifest_was_written_over_is_not_restored(
    client: Client, admin: Client
):
    """A save records its manifest's SHA-256; a sandbox made from the Snapshot
    restores that manifest or none: one planted in its place (by anyone with the
    right to the subject) fails the start instead of becoming the sandbox's files."""
    source = await running_sandbox(client, save_interval_s=3600)
    assert (await client.exec(source, ["sh", "-c", "echo mine > note"])).command.exit_code == 0
    snap = await client.wait_for_save(source, (await client.snapshot(source, "m2")).id, timeout=60)
    assert snap.state == "completed"
    state = await client.sandbox_state(source)
    assert state is not None and len(state.saves[snap.id].manifest_digest) == 64
    store = SaveStore(admin.nc, admin.names)
    real = await store.get_manifest(snap.id)
    assert await store.delete_manifest(snap.id)
    planted = msgspec.structs.replace(real, created_at=real.created_at + 1)
    await store.put_manifest(planted)
    copy = await client.create_sandbox(from_snapshot=snap.id)
    failed = await client.wait_for_phase(copy.id, {"failed", "running"}, timeout=60)
    assert failed.phase == "failed", failed
    copied = await client.sandbox_state(copy.id)
    assert copied is not None and "not the one its save recorded" in copied.reason, copied.reason
    await client.stop_sandbox(source)


async def test_what_root_installs_anywhere_in_the_root_survives_a_snapshot(client: Client):
    source = await running_sandbox(client, save_interval_s=3600)
    as_root = (
        "echo tool > /usr/local/bin/agent-tool && chmod 755 /usr/local/bin/agent-tool && "
        "mkdir -p /opt/sdk && echo 1.2 > /opt/sdk/VERSION && ln /opt/sdk/VERSION /opt/sdk/V && "
        "echo 'export X=1' >> /etc/profile && rm /etc/inputrc && mkfifo /opt/sdk/pipe"
    )
    done = await client.exec(source, ["sh", "-c", as_root], user="root")
    assert done.command.exit_code == 0, done.stderr
    as_user = (
        "echo mine > ~/.agentrc && pip_dir=~/.local/lib && mkdir -p $pip_dir && echo x > $pip_dir/m"
    )
    assert (await client.exec(source, ["sh", "-c", as_user])).command.exit_code == 0
    snap = await client.wait_for_save(
        source, (await client.snapshot(source, "root")).id, timeout=60
    )
    assert snap.state == "completed"
    copy = await client.create_sandbox(from_snapshot=snap.id)
    await client.wait_for_phase(copy.id, {"running"}, timeout=60)
    check = (
        "cat /usr/local/bin/agent-tool /opt/sdk/VERSION ~/.agentrc ~/.local/lib/m; "
        "stat -c %h /opt/sdk/V; test -p /opt/sdk/pipe && echo fifo; "
        "grep -c 'export X=1' /etc/profile; test -e /etc/inputrc || echo inputrc-deleted; "
        "stat -c %U /usr/local/bin/agent-tool ~/.agentrc"
    )
    result = await client.exec(copy.id, ["sh", "-c", check])
    assert result.stdout.decode().split() == [
        "tool", "1.2", "mine", "x", "2", "fifo", "1", "inputrc-deleted", "root", "sandbox",
    ], result  # fmt: skip
    for sandbox_id in (source, copy.id):
        await client.stop_sandbox(sandbox_id)


async def _store_full(admin: Client, full: bool) -> None:
    """Make the save store refuse new messages (as a full disk would), or undo it."""
    info = await admin.js.stream_info(admin.names.saves_stream)
    config = info.config
    config.max_bytes = info.state.bytes if full else -1
    config.discard = DiscardPolicy.NEW if full else DiscardPolicy.OLD
    await admin.js.update_stream(config)


async def test_status_says_failing_when_saves_keep_failing_and_ok_once_one_completes(
    client: Client, admin: Client
):
    sandbox_id = await running_sandbox(client, save_interval_s=1)
    # A job left running that keeps writing: every interval's save is attempted
    # (a quiet one's files stay in its last save, decision 051) and has something
    # to store (one that found nothing changed stores nothing, decision 067).
    await client.exec(sandbox_id, ["sh", "-c", WRITING_JOB], key="job")
    await client.wait_for(
        sandbox_id, lambda s: s if _completed(s) else None, timeout=30, what="a first save"
    )
    await _store_full(admin, True)
    try:
        view = await client.wait_for(
            sandbox_id,
            lambda s: v if (v := sb_view(s)).save_health.state == "failing" else None,
            timeout=60,
            what="status failing",
        )
        assert "maximum bytes" in view.save_health.reason
        assert view.last_completed_save is not None  # the earlier save still counts
    finally:
        await _store_full(admin, False)
    await client.wait_for(
        sandbox_id,
        lambda s: s if sb_view(s).save_health.state == "ok" else None,
        timeout=60,
        what="status ok again",
    )
    await client.stop_sandbox(sandbox_id)


def sb_view(state: sb.Sandbox):
    from sandhold.domain.views import sandbox_view

    return sandbox_view(state, now=time.time())


async def test_gc_removes_expired_saves_and_keeps_every_retained_one_whole(up: Up, client: Client):
    sandbox_id = await running_sandbox(client, save_interval_s=1)
    churn = "while true; do head -c 300000 /dev/urandom > data; sleep 0.3; done"
    writer = asyncio.create_task(client.exec(sandbox_id, ["sh", "-c", churn], key="churn"))
    try:
        await client.wait_for(
            sandbox_id,
            lambda s: s if any(r.state == "expired" for r in s.saves.values()) else None,
            timeout=90,
            what="retention to expire a save",
        )
    finally:
        writer.cancel()
    await client.stop_sandbox(sandbox_id)
    # Settled: stopped, nothing in flight, and retention has caught up (keeps 5).
    state = await client.wait_for(
        sandbox_id,
        lambda s: (
            s
            if s.phase == "stopped"
            and len(_completed(s)) == 5
            and not [
                r for r in s.saves.values() if r.state in ("requested", "captured", "uploaded")
            ]
            else None
        ),
        timeout=60,
        what="no save in flight",
    )
    store = SaveStore(client.nc, client.names)
    gone = [r.id for r in state.saves.values() if r.state == "expired"]
    # With the default grace (an hour), the expired saves' manifests go at once:
    # the saver keeps no record of them (decision 068) but heard them expire.
    done = up.cli("admin", "gc")
    assert done.returncode == 0, done.stderr
    result = msgspec.json.decode(done.stdout)
    assert result["ok"] and result["deleted_manifests"] >= len(gone) > 0, result
    assert result["deleted_chunks"] == 0, "every chunk is younger than the grace"
    for save_id in gone:
        with pytest.raises(Exception, match="manifest"):
            await store.get_manifest(save_id)
    done = up.cli("admin", "gc", "--grace", "0")
    assert done.returncode == 0, done.stderr
    result = msgspec.json.decode(done.stdout)
    assert result["ok"] and result["deleted_chunks"] > 0
    kept = [r.id for r in state.saves.values() if r.state == "completed"]
    assert len(kept) == 5
    for save_id in kept:
        manifest = await store.get_manifest(save_id)
        assert await store.verify(manifest, recheck=manifest.digests) == []


async def test_a_deleted_sandboxs_saves_are_collected_and_its_snapshots_kept(
    up: Up, client: Client
):
    """Decision 060: a deleted sandbox's files are discarded, so its saves go too
    (their manifests, and chunks nothing retained names); a Snapshot stays, and
    a sandbox can still be created from it."""
    source = await running_sandbox(client, save_interval_s=1)
    assert (
        await client.exec(source, ["sh", "-c", "head -c 200000 /dev/urandom > kept"])
    ).command.exit_code == 0
    snap = await client.wait_for_save(source, (await client.snapshot(source, "m1")).id, timeout=60)
    assert snap.state == "completed"
    digest = (await client.exec(source, ["sha256sum", "kept"])).stdout
    # Content only the saves after the Snapshot hold: their chunks must go.
    assert (
        await client.exec(source, ["sh", "-c", "head -c 300000 /dev/urandom > gone"])
    ).command.exit_code == 0
    after = time.time()
    await client.wait_for(
        source,
        lambda s: s if any(
            r.kind == "scheduled" and r.state == "completed" and r.requested_at > after
            for r in s.saves.values()
        ) else None,
        timeout=60,
        what="a scheduled save holding `gone`",
    )  # fmt: skip
    await client.delete_sandbox(source)
    state = await client.wait_for(
        source,
        lambda s: (
            s
            if s.phase == "deleted"
            and not [
                r
                for r in s.saves.values()
                if r.kind != "snapshot"
                and r.state in ("requested", "captured", "uploaded", "completed")
            ]
            else None
        ),  # fmt: skip
        timeout=60,
        what="every save but the Snapshot expired",
    )
    expired = [r.id for r in state.saves.values() if r.state == "expired"]
    assert expired and state.saves[snap.id].state == "completed"
    done = up.cli("admin", "gc", "--grace", "0")
    assert done.returncode == 0, done.stderr
    result = msgspec.json.decode(done.stdout)
    assert result["ok"] and result["deleted_chunks"] > 0, result
    store = SaveStore(client.nc, client.names)
    for save_id in expired:
        with pytest.raises(Exception, match="manifest"):  # (as the test above)
            await store.get_manifest(save_id)
    manifest = await store.get_manifest(snap.id)
    assert await store.verify(manifest, recheck=manifest.digests) == []
    copy = await client.create_sandbox(from_snapshot=snap.id, save_interval_s=3600)
    await client.wait_for_phase(copy.id, {"running"}, timeout=60)
    assert (await client.exec(copy.id, ["sha256sum", "kept"])).stdout == digest
    assert (await client.exec(copy.id, ["test", "!", "-e", "gone"])).command.exit_code == 0

    # Decision 069: the deleted sandbox's Snapshot is deleted too (the CLI; a
    # retry answers the same). Retention drops it; the copy made from it still
    # holds its files until the copy goes.
    done = up.cli("snapshot", source, "--delete", snap.id, "--key", "unsnap", "--json")
    assert done.returncode == 0, done.stderr
    shown = msgspec.json.decode(done.stdout)
    assert (shown["id"], shown["kind"], shown["name"]) == (snap.id, "scheduled", None)
    again = await client.delete_snapshot(source, snap.id, key="unsnap")
    assert again.id == snap.id
    with pytest.raises(Rejected) as refusal:
        await client.delete_snapshot(source, snap.id, key="unsnap-again")
    assert refusal.value.code == "snapshot_not_found"
    await client.wait_for(
        source,
        lambda s: s if s.saves[snap.id].state == "expired" else None,
        timeout=30,
        what="retention to drop the deleted Snapshot",
    )
    with pytest.raises(Rejected) as refusal:
        await client.create_sandbox(from_snapshot=snap.id)
    assert refusal.value.code == "snapshot_not_found"
    assert up.cli("admin", "gc", "--grace", "0").returncode == 0
    await store.get_manifest(snap.id)  # the copy's starting point: kept while it exists
    await client.delete_sandbox(copy.id)
    await client.wait_for_phase(copy.id, {"deleted"}, timeout=60)
    done = up.cli("admin", "gc", "--grace", "0")
    assert done.returncode == 0 and msgspec.json.decode(done.stdout)["ok"], done.stderr
    with pytest.raises(Exception, match="manifest"):
        await store.get_manifest(snap.id)


async def test_a_command_for_a_sandbox_whose_files_are_gone_is_not_launched_and_the_save_brings_it_back(  # noqa: E501
    up: Up, client: Client
):
    """The host's copy of a running sandbox is wiped under a live agent (a disk
    lost, an `rm -rf`): the next command never starts and says so, and the
    sandbox is lost on that host, so the command after it runs on its last
    completed save. (Before: the instruction came back until max_deliver and the
    command stayed `dispatched`.)"""
    sandbox_id = await running_sandbox(client, save_interval_s=3600)
    await client.exec(sandbox_id, ["sh", "-c", "echo kept > note"])
    await client.wait_for_save(
        sandbox_id, (await client.snapshot(sandbox_id, "kept")).id, timeout=60
    )
    shutil.rmtree(up.data_dir / "hosts" / "local" / "sandboxes" / sandbox_id)

    gone = await client.exec(sandbox_id, ["true"], wait_timeout=60)
    assert gone.command.state == "not_launched", gone.command
    assert "files are gone from host local" in gone.command.reason
    lost = await client.wait_for(
        sandbox_id, lambda s: s.lost, timeout=30, what="its host to declare it lost"
    )
    assert (lost.host, lost.generation) == ("local", gone.command.generation)

    again = await client.exec(sandbox_id, ["cat", "note"], wait_timeout=90)
    assert again.command.state == "exited" and again.stdout == b"kept\n", again.command
    view = await client.show_sandbox(sandbox_id)
    assert view.phase == "running" and view.generation > gone.command.generation
    await client.stop_sandbox(sandbox_id)


async def test_a_scheduled_save_that_finds_nothing_changed_stores_nothing(
    client: Client, tmp_path: Path
):
    """Decision 067: after a command that changed no file, the scheduled save
    ends `unchanged`: no manifest, no upload, no verification; the last completed
    save stays the restore point and holds the files as of that capture."""
    sandbox_id = await running_sandbox(client, save_interval_s=1)
    # More names than a command's end looks at (decision 078), so that the end of
    # `true` leaves the question to the scheduled save.
    many = LOOK_MAX_NAMES + 100
    fill = f"mkdir many && cd many && i=0; while [ $i -lt {many} ]; do : > f$i; i=$((i+1)); done"
    await client.exec(sandbox_id, ["sh", "-c", f"echo kept > note && {fill}"])
    # A file written within a second of a save's capture is read again by the
    # next capture (the racy-window rule), so one save after the write may still
    # be stored; one a command later no longer is.
    found = None
    for _ in range(4):
        ran = await client.exec(sandbox_id, ["true"])
        ended_at = ran.command.ended_at or time.time()
        after = await client.sandbox_state(sandbox_id)
        assert after is not None
        # Its end did not hold the files (decision 078): the save after it decides.
        last = after.last_completed_save
        assert last is None or last.confirmed_at != ran.command.ended_at

        def settled_after(s: sb.Sandbox, ended_at: float = ended_at) -> sv.SaveRecord | None:
            late = [r for r in s.saves.values() if r.requested_at > ended_at]
            done = [r for r in late if r.state not in sv.IN_FLIGHT]
            return done[-1] if done else None

        save = await client.wait_for(sandbox_id, settled_after, timeout=60, what="a save")
        assert save.state in ("completed", "unchanged"), save
        if save.state == "unchanged":
            found = save
            break
    assert found is not None, "every save after a no-op command was stored"
    state = await client.sandbox_state(sandbox_id)
    assert state is not None and state.last_completed_save is not None
    parent = state.last_completed_save
    assert parent.id == found.parent_id and parent.confirmed_at == found.captured_at

    store = SaveStore(client.nc, client.names)
    with pytest.raises(MissingManifest):
        await store.get_manifest(found.id)  # nothing was stored under its id
    await restore(store, await store.get_manifest(parent.id), tmp_path / "restored")
    assert (tmp_path / "restored/root/workspace/note").read_bytes() == b"kept\n"
    view = await client.show_sandbox(sandbox_id)
    assert view.last_completed_save is not None
    assert view.last_completed_save.confirmed_at == found.captured_at
    await client.stop_sandbox(sandbox_id)


async def test_a_host_keeps_little_for_a_sandboxs_saves_and_nothing_once_it_is_deleted(
    up: Up, client: Client
):
    """The host's spool keeps the parent manifest the next save walks against
    (and the one before, until the newest completes): not one file per save,
    which filled it for a sandbox saved every interval for days."""
    sandbox_id = await running_sandbox(client, save_interval_s=3600)
    spool = up.data_dir / "hosts" / "local" / "spool" / sandbox_id
    for n in range(4):
        await client.exec(sandbox_id, ["sh", "-c", f"echo {n} > note"])
        save = await client.snapshot(sandbox_id, f"n{n}")
        assert (await client.wait_for_save(sandbox_id, save.id, timeout=60)).state == "completed"
    state = await client.sandbox_state(sandbox_id)
    assert state is not None
    parent = state.saves[save.id].parent_id
    kept = sorted(str(p.relative_to(spool)) for p in spool.rglob("*"))
    assert kept == sorted(["manifests", f"manifests/{parent}", f"manifests/{save.id}"])
    await client.delete_sandbox(sandbox_id)
    await client.wait_for_phase(sandbox_id, {"deleted"}, timeout=60)
    assert not spool.exists()


async def test_a_workspace_removed_from_inside_fails_the_launch_there_and_can_be_made_again(
    up: Up, client: Client
):
    """The sandbox's root removed its /workspace: not a lost copy. A command
    whose working directory it was cannot start and says why; one elsewhere
    runs, and can make it again; the sandbox stays where it is, on its files."""
    sandbox_id = await running_sandbox(client, save_interval_s=3600)
    wrote = await client.exec(sandbox_id, ["sh", "-c", 'echo kept > "$HOME/note"'])
    assert wrote.command.exit_code == 0, wrote.stderr
    removed = await client.exec(sandbox_id, ["rm", "-rf", "/workspace"], user="root", cwd="/")
    assert removed.command.exit_code == 0, removed.stderr
    failed = await client.exec(sandbox_id, ["true"], wait_timeout=60)
    assert failed.command.state == "launch_failed", failed.command
    assert "working directory does not exist: /workspace" in failed.command.reason
    state = await client.sandbox_state(sandbox_id)
    assert state is not None and state.phase == "running" and state.lost is None
    # Stopped and started again (its final save holds the removal): it starts.
    await client.stop_sandbox(sandbox_id)
    await client.wait_for_phase(sandbox_id, {"stopped"}, timeout=60)
    await client.start_sandbox(sandbox_id)
    await client.wait_for_phase(sandbox_id, {"running"}, timeout=60)
    still = await client.exec(sandbox_id, ["true"], wait_timeout=60)
    assert still.command.state == "launch_failed", "what its root removed stays removed"
    remade = await client.exec(
        sandbox_id,
        ["sh", "-c", "mkdir /workspace && chown 1000:1000 /workspace"],
        user="root",
        cwd="/",
    )
    assert remade.command.exit_code == 0, remade.stderr
    again = await client.exec(sandbox_id, ["sh", "-c", 'pwd && cat "$HOME/note"'])
    assert (again.command.exit_code, again.stdout) == (0, b"/workspace\nkept\n"), again
    await client.stop_sandbox(sandbox_id)


async def test_a_command_that_changed_nothing_brings_no_save(client: Client):
    """Decision 078: a command that ends with nothing left running in its sandbox
    and every file as the last completed save holds them (its host looks, at the
    end) leaves that save holding them, as of the end: no save is due for it. A
    command that wrote a file is not held so, and its change is saved."""
    sandbox_id = await running_sandbox(client, save_interval_s=1)

    def quiet_and_settled(s: sb.Sandbox) -> str | None:
        return None if s.saves_in_flight else sb_view(s).unchanged_since_save

    # A file written within a second of a save's capture is not trusted by the
    # look (the racy-window rule): the save or two after the sandbox's start may
    # hold such files, and the save after the next command then holds none.
    held_by_end = None
    for _ in range(4):
        held = await client.wait_for(sandbox_id, quiet_and_settled, timeout=30, what="a save")
        ran = await client.exec(sandbox_id, ["true"])
        state = await client.sandbox_state(sandbox_id)
        assert state is not None and state.last_completed_save is not None
        if state.last_completed_save.confirmed_at == ran.command.ended_at:
            held_by_end = held
            break
    assert held_by_end is not None, "no end of `true` found the files unchanged"
    assert state.last_completed_save.id == held_by_end
    assert sb_view(state).unchanged_since_save == held_by_end and sb_view(state).rpo_s == 0.0
    # Proving that no save comes takes a span of time: three intervals here.
    await asyncio.sleep(3)
    later = await client.sandbox_state(sandbox_id)
    assert later is not None and later.saves.keys() == state.saves.keys()

    wrote = await client.exec(sandbox_id, ["sh", "-c", "echo changed > new-file"])
    state = await client.sandbox_state(sandbox_id)
    assert state is not None and state.last_completed_save is not None
    assert state.last_completed_save.confirmed_at != wrote.command.ended_at
    saved = await client.wait_for(
        sandbox_id,
        lambda s: s if sb_view(s).unchanged_since_save not in (None, held_by_end) else None,
        timeout=30,
        what="a save of the change",
    )
    assert saved.last_completed_save is not None
    assert saved.last_completed_save.captured_at is not None
    assert saved.last_completed_save.captured_at >= (wrote.command.ended_at or 0)
    await client.stop_sandbox(sandbox_id)
