"""Host failure with real processes and real signals: two host-agents run as
their own processes next to `sandhold up --hosts 0`; a host "fails" by kill -9
of its agent and of every process of its sandboxes, as a machine loss would."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from sandhold.client import Client, connect
from sandhold.domain import sandbox as sb
from sandhold.domain.errors import Rejected
from sandhold.domain.requests import command_id_for

from tests.e2e.harness import Host, Up
from tests.support.procs import stopped
from tests.support.waiting import wait_until

LEASE_TTL, FENCE_MARGIN = 2.0, 1.0


@pytest.fixture
def cluster(
    tmp_path: Path, request: pytest.FixtureRequest, topology: tuple[str, ...]
) -> Iterator[tuple[Up, Host, Host]]:
    ttl_marker = request.node.get_closest_marker("lease_ttl")
    lease_ttl = float(ttl_marker.args[0]) if ttl_marker else LEASE_TTL
    up = Up(
        tmp_path / "data",
        "--hosts",
        "0",
        "--save-interval",
        "1",
        "--lease-ttl",
        str(lease_ttl),
        "--fence-margin",
        str(FENCE_MARGIN),
        "--save-timeout",
        "10",
        *topology,
    ).start()
    marker = request.node.get_closest_marker("h1_args")
    hosts = [
        Host(up, "h1", *(marker.args if marker else ()), lease_ttl=lease_ttl),
        Host(up, "h2", lease_ttl=lease_ttl),
    ]
    try:
        hosts[0].start()
        yield up, hosts[0], hosts[1]
    finally:
        for host in hosts:
            host.stop()
        up.stop()


@pytest.fixture
async def client(cluster) -> AsyncIterator[Client]:
    async with await connect(cluster[0].url) as c:
        yield c


async def _running_on_h1_with_h2_waiting(client: Client, cluster, **create) -> str:
    """A sandbox on h1 (the only host when it is created); then h2 joins."""
    up, h1, h2 = cluster
    view = await client.create_sandbox(**create)
    view = await client.wait_for_phase(view.id, {"running"}, timeout=30)
    assert view.host == "h1"
    h2.start()
    await wait_until(lambda: _live(client, "h2"), timeout=30, what="h2 live")
    return view.id


async def _live(client: Client, host: str) -> bool:
    hosts = (await client.list_hosts())["hosts"]
    return any(h["host"] == host and h["status"] == "live" for h in hosts)


async def _saved_after(client: Client, sandbox_id: str, at: float) -> sb.Sandbox:
    """A completed save asked for after `at`, a moment after the writes returned.

    A save asked for earlier can have frozen the files before the writes even when
    it completes later (a loaded three-node cluster takes seconds), so the time
    it was asked for is the one that says what it holds."""
    return await client.wait_for(
        sandbox_id,
        lambda s: s if (c := s.last_completed_save) and c.requested_at > at else None,
        timeout=30,
        what="a save completed after the write",
    )


async def _a_command_running(
    client: Client, argv: list[str], key: str
) -> tuple[str, str, asyncio.Task]:
    """A new running sandbox with `argv` running in it: its id, the command's id
    and the exec that waits for the command's end."""
    view = await client.create_sandbox()
    sandbox_id = (await client.wait_for_phase(view.id, {"running"}, timeout=30)).id
    run = asyncio.create_task(client.exec(sandbox_id, argv, key=key))
    cid = command_id_for(sandbox_id, key)
    await client.wait_for(
        sandbox_id,
        lambda s: s if cid in s.commands and s.commands[cid].state == "running" else None,
        timeout=30,
        what="running",
    )
    return sandbox_id, cid, run


async def _events(client: Client, sandbox_id: str) -> list:
    from sandhold.bus.read import read_subject

    return await read_subject(
        client.js, client.names.events_stream, client.names.events("sandbox", sandbox_id)
    )


@pytest.mark.cluster
async def test_host_killed_during_a_long_command(cluster, client: Client):
    up, h1, h2 = cluster
    sandbox_id = await _running_on_h1_with_h2_waiting(client, cluster)
    await client.exec(sandbox_id, ["sh", "-c", "echo v1 > note"])
    # Installed outside the workspace, as root: the whole root is what is saved.
    installed = await client.exec(
        sandbox_id, ["sh", "-c", "echo tool > /usr/local/bin/installed"], user="root"
    )
    assert installed.command.exit_code == 0
    written = time.time()
    saved = await _saved_after(client, sandbox_id, written)
    long = asyncio.create_task(
        client.exec(
            sandbox_id, ["sh", "-c", "echo started; echo ran >> runs; sleep 100"], key="long"
        )
    )
    cid = command_id_for(sandbox_id, "long")
    await client.wait_for(
        sandbox_id,
        lambda s: s if cid in s.commands and s.commands[cid].state == "running" else None,
        timeout=30,
        what="long running",
    )
    await wait_until(lambda: _kept(client, sandbox_id, cid), what="output kept")
    h1.fail()

    result = await asyncio.wait_for(long, 30)
    assert result.command.state == "infrastructure_lost"
    assert result.stdout == b"started\n"  # kept output stays readable
    assert result.command.output_complete is False
    view = await client.show_sandbox(sandbox_id)
    assert view.phase == "lost" and view.lost_host == "h1"
    assert view.recovery is not None and view.recovery["state"] in ("waiting_for_fence", "fenced")
    with pytest.raises(Rejected) as refused:
        await client.snapshot(sandbox_id, "while-lost")
    assert refused.value.code == "sandbox_lost"
    await client.wait_for(
        sandbox_id, lambda s: s if s.lost and s.lost.fenced else None, timeout=30, what="fenced"
    )
    # Nothing reruns by itself.
    state = await client.sandbox_state(sandbox_id)
    assert state is not None and state.phase == "lost" and state.generation == 1
    # Saves went on while the long command ran: the start uses the last one that
    # completed, which is the one after the writes or a later one.
    last = (await client.show_sandbox(sandbox_id)).last_completed_save
    assert last is not None and saved.last_completed_save is not None
    assert (last.completed_at or 0) >= (saved.last_completed_save.completed_at or 0)

    await client.start_sandbox(sandbox_id)
    view = await client.wait_for_phase(sandbox_id, {"running"}, timeout=60)
    assert (view.host, view.generation) == ("h2", 2)
    assert view.recovered_from is not None
    assert view.recovered_from.source == "save"
    assert view.recovered_from.save_id == last.id
    assert view.recovered_from.behind_failure_s is not None
    assert view.recovered_from.behind_failure_s >= 0
    check = await client.exec(sandbox_id, ["sh", "-c", "cat note; cat runs 2>/dev/null || :"])
    assert check.stdout.startswith(b"v1\n")
    tool = await client.exec(sandbox_id, ["cat", "/usr/local/bin/installed"])
    assert tool.stdout == b"tool\n"  # recovered on h2 with the rest of its root
    long_again = (await client.sandbox_state(sandbox_id)).commands[cid]
    assert long_again.state == "infrastructure_lost"  # still the record; never relaunched
    starts = [
        r
        for r in await _events(client, sandbox_id)
        if r.envelope.type == "command.started" and r.envelope.event.command_id == cid
    ]
    assert len(starts) == 1


async def test_a_connection_is_delivered_again_after_recovery_on_another_host(
    cluster, client: Client
):
    up, h1, h2 = cluster
    sandbox_id = await _running_on_h1_with_h2_waiting(client, cluster)
    await client.set_connection(sandbox_id, "github", "token-1")
    seen = await client.exec(sandbox_id, ["cat", "/run/connections/github"])
    assert seen.stdout == b"token-1"
    h1.fail()
    await client.wait_for(
        sandbox_id, lambda s: s if s.lost and s.lost.fenced else None, timeout=30, what="fenced"
    )
    # Set while lost: recorded, delivered with the rest wherever it comes back.
    await client.set_connection(sandbox_id, "npm", "token-2")
    await client.start_sandbox(sandbox_id)
    view = await client.wait_for_phase(sandbox_id, {"running"}, timeout=60)
    assert (view.host, view.generation) == ("h2", 2)
    both = await client.exec(
        sandbox_id, ["sh", "-c", "cat /run/connections/github /run/connections/npm"]
    )
    assert both.stdout == b"token-1token-2"


async def _kept(client: Client, sandbox_id: str, command_id: str) -> bool:
    output = await client.read_output(sandbox_id, command_id)
    return output["stdout"] == b"started\n"


async def test_a_command_dispatched_to_a_host_that_dies_before_confirming_ends_unknown(
    cluster, client: Client
):
    up, h1, h2 = cluster
    sandbox_id = await _running_on_h1_with_h2_waiting(client, cluster)
    os.kill(h1.pid, signal.SIGSTOP)  # it will never confirm the launch
    run = asyncio.create_task(client.exec(sandbox_id, ["true"], key="never-confirmed"))
    cid = command_id_for(sandbox_id, "never-confirmed")
    await client.wait_for(
        sandbox_id,
        lambda s: s if cid in s.commands and s.commands[cid].state == "dispatched" else None,
        timeout=30,
        what="dispatched",
    )
    h1.fail()
    result = await asyncio.wait_for(run, 30)
    assert result.command.state == "unknown"
    assert "possibly run" in result.command.reason


@pytest.mark.parametrize(
    "own_ttl", [pytest.param(None, id="same-ttl"), pytest.param("30", id="agent-configured-longer")]
)
@pytest.mark.cluster
async def test_a_paused_host_resuming_after_recovery_changes_nothing(
    cluster, client: Client, own_ttl: str | None
):
    """Also when the agent was told a longer lease TTL than recovery uses: it
    follows the TTL recovery publishes, so it never fences later than that."""
    up, h1, h2 = cluster
    if own_ttl is not None:
        h1.stop()
        h1.extra = ["--lease-ttl", own_ttl]
        h1.start()
        await wait_until(lambda: _live(client, "h1"), timeout=30, what="h1 back")
    sandbox_id = await _running_on_h1_with_h2_waiting(client, cluster)
    await client.exec(sandbox_id, ["sh", "-c", "echo 0 > counter"])
    written = time.time()
    await _saved_after(client, sandbox_id, written)
    ticker = "while true; do n=$(cat counter); echo $((n+1)) > counter; sleep 0.05; done"
    asyncio.create_task(client.exec(sandbox_id, ["sh", "-c", ticker], key="ticker"))
    await client.wait_for(
        sandbox_id,
        lambda s: (
            s
            if s.commands.get(command_id_for(sandbox_id, "ticker"))
            and s.commands[command_id_for(sandbox_id, "ticker")].state == "running"
            else None
        ),
        timeout=30,
        what="ticker",
    )
    os.kill(h1.pid, signal.SIGSTOP)  # cut off: its processes keep running, it cannot renew
    await client.wait_for(
        sandbox_id,
        lambda s: s if s.lost and s.lost.fenced else None,
        timeout=30,
        what="lost and fenced",
    )
    await client.start_sandbox(sandbox_id)
    await client.wait_for_phase(sandbox_id, {"running"}, timeout=60)
    recovered = await client.exec(sandbox_id, ["cat", "counter"])
    recovered_value = recovered.stdout
    last_seq = (await _events(client, sandbox_id))[-1].seq

    os.kill(h1.pid, signal.SIGCONT)  # the zombie wakes up
    await wait_until(lambda: not h1.sandbox_pids(), timeout=30, what="zombie processes gone")
    await wait_until(
        lambda: not (h1.root / "sandboxes" / sandbox_id).exists(),
        timeout=30,
        what="stale copy dropped",
    )
    await client.exec(sandbox_id, ["true"])  # the sandbox keeps working on h2
    after = [r for r in await _events(client, sandbox_id) if r.seq > last_seq]
    assert after and all(r.envelope.actor != "host-agent:h1" for r in after)
    again = await client.exec(sandbox_id, ["cat", "counter"])
    assert again.stdout == recovered_value  # h1 never touched h2's files
    view = await client.show_sandbox(sandbox_id)
    assert (view.host, view.generation) == ("h2", 2)


async def test_a_host_failing_during_a_save_recovers_from_the_previous_one(cluster, client: Client):
    up, h1, h2 = cluster
    sandbox_id = await _running_on_h1_with_h2_waiting(client, cluster, save_interval_s=3600)
    await client.exec(sandbox_id, ["sh", "-c", "echo before > note"])
    previous = await client.wait_for_save(
        sandbox_id, (await client.snapshot(sandbox_id, "previous")).id, timeout=60
    )
    assert previous.state == "completed"
    await client.exec(
        sandbox_id, ["sh", "-c", "echo after > note; head -c 314572800 /dev/urandom > blob"]
    )
    half = await client.snapshot(sandbox_id, "half")
    h1.fail()
    failed = await client.wait_for_save(sandbox_id, half.id, timeout=60)
    assert failed.state == "failed"
    await client.wait_for(
        sandbox_id, lambda s: s if s.lost and s.lost.fenced else None, timeout=30, what="fenced"
    )
    result = await client.exec(sandbox_id, ["cat", "note"], wait_timeout=60)
    assert result.stdout == b"before\n"
    view = await client.show_sandbox(sandbox_id)
    assert view.recovered_from is not None and view.recovered_from.save_id == previous.id


async def test_a_sandbox_whose_first_save_never_completed_recovers_its_base_image(
    cluster, client: Client
):
    up, h1, h2 = cluster
    sandbox_id = await _running_on_h1_with_h2_waiting(client, cluster, save_interval_s=3600)
    await client.exec(sandbox_id, ["sh", "-c", "echo unsaved > note"])
    view = await client.show_sandbox(sandbox_id)
    assert view.recoverable_from.startswith("only the base image")
    h1.fail()
    await client.wait_for(
        sandbox_id, lambda s: s if s.lost and s.lost.fenced else None, timeout=30, what="fenced"
    )
    result = await client.exec(sandbox_id, ["sh", "-c", "ls -A"], wait_timeout=60)
    assert result.stdout == b""  # the base image: empty
    view = await client.show_sandbox(sandbox_id)
    assert view.recovered_from is not None and view.recovered_from.source == "base image"


async def test_services_killed_during_a_recovery_recover_it_exactly_once(cluster, client: Client):
    up, h1, h2 = cluster
    sandbox_id = await _running_on_h1_with_h2_waiting(client, cluster)
    h1.fail()
    os.kill(up.service_pid("recovery"), signal.SIGKILL)  # before it even saw the loss
    await client.wait_for(
        sandbox_id,
        lambda s: s if s.lost and s.lost.fenced else None,
        timeout=60,
        what="fenced, by the restarted recovery service",
    )
    scheduler = up.service_pid("scheduler")

    async def requests_stored() -> int:
        return (await client.js.stream_info(client.names.requests_stream)).state.last_seq

    async def requests_stored_after(seq: int) -> bool:
        return await requests_stored() > seq

    before = await requests_stored()
    start = asyncio.create_task(client.start_sandbox(sandbox_id))
    # The start is stored (acked by JetStream) when the scheduler dies: it must be
    # decided by the next one, however far the first one got with it.
    await wait_until(
        lambda: requests_stored_after(before), timeout=30, what="the start request stored"
    )
    os.kill(scheduler, signal.SIGKILL)
    os.kill(up.service_pid("saver"), signal.SIGKILL)
    await asyncio.wait_for(start, 60)
    await client.wait_for_phase(sandbox_id, {"running"}, timeout=60)
    placements = [
        r for r in await _events(client, sandbox_id) if r.envelope.type == "sandbox.placed"
    ]
    assert [r.envelope.event.generation for r in placements] == [1, 2]
    assert (await client.exec(sandbox_id, ["true"])).command.state == "exited"
    hosts = json.loads(up.cli("host", "ls", "--json").stdout)
    assert hosts["lease_ttl_s"] == LEASE_TTL and hosts["fence_margin_s"] == FENCE_MARGIN
    statuses = {h["host"]: h["status"] for h in hosts["hosts"]}
    assert statuses["h1"] in ("lost", "fenced") and statuses["h2"] == "live"


async def test_eager_recovery_brings_the_sandbox_back_once_fenced(cluster, client: Client):
    up, h1, h2 = cluster
    sandbox_id = await _running_on_h1_with_h2_waiting(client, cluster, recovery="eager")
    h1.fail()
    view = await client.wait_for(
        sandbox_id,
        lambda s: sb_view(s) if s.phase == "running" and s.generation == 2 else None,
        timeout=60,
        what="eager recovery without any request",
    )
    assert view.host == "h2" and view.recovered_from is not None


# Restarted "within the lease" means the new agent process renews before the
# TTL runs out: its start (the imports alone take ~0.9 s here, twice that on a
# loaded CI machine) must fit, or the host is rightly declared lost (CI, once).
@pytest.mark.lease_ttl(10.0)
async def test_agent_killed_alone_with_its_supervisor_gone_ends_the_command_unknown(
    cluster, client: Client
):
    """Agent restart is not host failure: a command whose outcome the restarted
    agent cannot establish (its supervisor vanished without an exit record) ends
    `unknown`; nothing is declared lost."""
    up, h1, h2 = cluster
    sandbox_id, cid, run = await _a_command_running(client, ["sleep", "60"], "orphan")
    supervisor = json.loads(
        (h1.root / "sandboxes" / sandbox_id / "commands" / cid / "supervisor.json").read_text()
    )
    os.kill(h1.pid, signal.SIGKILL)
    h1.process.wait()
    os.kill(supervisor["pid"], signal.SIGKILL)
    h1.start()  # back well within the lease: re-adopts, not a host failure
    result = await asyncio.wait_for(run, 60)
    assert result.command.state == "unknown"
    state = await client.sandbox_state(sandbox_id)
    assert state is not None and state.phase == "running" and state.generation == 1


async def test_a_host_back_from_its_fence_before_recovery_judged_it_declares_the_loss(
    cluster, client: Client
):
    """NATS away for everyone, then back for everyone at once: the host that fenced
    itself (it killed its sandboxes' processes) can register a new epoch before
    recovery judges the old one, and then the host's lease looks fine to it. The
    host says the loss itself; nobody did, and the command it killed stayed
    `running` for ever (a task waiting on it never ended: CI)."""
    up, h1, h2 = cluster
    sandbox_id, cid, run = await _a_command_running(client, ["sleep", "600"], "killed")
    recovery_pid = up.service_pid("recovery")
    os.kill(recovery_pid, signal.SIGSTOP)  # it judges nothing until the host is back
    try:
        os.kill(h1.pid, signal.SIGSTOP)
        try:
            # Stopped first (a kill returns before every thread stops): "down" is
            # then a lapse the agent's own clock sees too when it runs again.
            await wait_until(lambda: stopped(h1.pid), timeout=30, what="h1 stopped")
            await wait_until(
                lambda: _status_of(client, "h1", {"down"}), timeout=30, what="h1's lease lapsed"
            )
        finally:
            os.kill(h1.pid, signal.SIGCONT)  # it notices the gap: fences itself, comes back
        assert h1.process is not None and h1.process.poll() is None, "h1 is gone"
        await wait_until(
            lambda: _epoch_of(client, "h1", at_least=2), timeout=30, what="h1 back, new epoch"
        )
    finally:
        os.kill(recovery_pid, signal.SIGCONT)
    state = await client.wait_for(
        sandbox_id,
        lambda s: s if s.commands[cid].ended and s.lost and s.lost.fenced else None,
        timeout=30,
        what="the killed command ended and the sandbox lost",
    )
    assert state.commands[cid].state == "infrastructure_lost"
    assert (state.phase, state.lost.host, state.lost.generation) == ("lost", "h1", 1)
    await wait_until(lambda: not h1.sandbox_pids(), timeout=30, what="its processes gone")
    run.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await run


async def _status_of(client: Client, host: str, statuses: set[str]) -> bool:
    hosts = (await client.list_hosts())["hosts"]
    return any(h["host"] == host and h["status"] in statuses for h in hosts)


async def _epoch_of(client: Client, host: str, *, at_least: int) -> bool:
    hosts = (await client.list_hosts())["hosts"]
    return any(
        h["host"] == host and isinstance(e := h["epoch"], int) and e >= at_least for h in hosts
    )


def sb_view(state: sb.Sandbox):
    from sandhold.domain.views import sandbox_view

    return sandbox_view(state, now=time.time())


async def test_a_sandbox_waiting_for_room_is_placed_when_a_slot_frees(tmp_path: Path):
    up = Up(tmp_path / "data", "--hosts", "0").start()
    host = Host(up, "small", "--capacity", "1", lease_ttl=LEASE_TTL)
    client = await connect(up.url)
    try:
        host.start()
        first = await client.create_sandbox()
        await client.wait_for_phase(first.id, {"running"}, timeout=30)
        second = await client.create_sandbox()
        # It says what it waits for, once the scheduler tried.
        waiting = await client.wait_for(
            second.id, lambda s: s if s.reason else None, timeout=30, what="a reason"
        )
        assert (waiting.phase, waiting.reason) == ("pending", "no host has room: 1/1")
        await client.stop_sandbox(first.id)
        await client.wait_for_phase(first.id, {"stopped"}, timeout=30)
        view = await client.wait_for_phase(second.id, {"running"}, timeout=30)
        assert (view.host, view.reason) == ("small", "")
    finally:
        await client.close()
        host.stop()
        up.stop()


# --- tasks on a host that dies -----------------------------------------------------

# The first attempt outlives the host; a retry (a new key, so a new command) ends at once.
_LONG_FIRST_ATTEMPT = 'case "$SANDHOLD_STEP_KEY" in *:1) sleep 120;; *) echo recovered;; esac'


@pytest.mark.parametrize("policy", ["fail", "recover_and_retry"])
async def test_a_task_step_on_a_lost_host_is_never_rerun_silently(
    cluster, client: Client, policy: str
):
    from sandhold.domain.task_manifest import load_manifest

    up, h1, h2 = cluster
    manifest = {
        "name": "on-a-dying-host",
        "agent": {"command": ["sh", "-c", _LONG_FIRST_ATTEMPT]},
        "on_infrastructure_lost": policy,
        "retry": {"base_delay": 0.1},
    }
    view = await client.submit_task(load_manifest(manifest))
    task = await client.wait_for_task(
        view.id,
        lambda s: s if "agent" in s.steps and s.sandbox_id else None,
        timeout=60,
        what="the agent step claimed",
    )
    step = task.steps["agent"]
    assert step.sandbox_id is not None and step.command_id is not None
    await client.wait_for(
        step.sandbox_id,
        lambda s: (
            s
            if s.commands.get(step.command_id) and s.commands[step.command_id].state == "running"
            else None
        ),
        timeout=60,
        what="the command running on h1",
    )
    h2.start()
    await wait_until(lambda: _live(client, "h2"), timeout=30, what="h2 live")
    h1.fail()
    final = await client.wait_for_task(
        view.id, lambda s: s if s.terminal else None, timeout=90, what="the task's end"
    )
    losses = [a for a in final.attempts if a.error_class == "infrastructure_lost"]
    assert len(losses) == 1 and losses[0].attempt == 1
    if policy == "fail":
        assert (final.state, final.reason) == ("failed", "infrastructure_lost")
        assert final.steps["agent"].end_state == "infrastructure_lost"
        assert final.steps["agent"].attempt == 1
        assert losses[0].retry_at is None
    else:
        assert final.state == "completed", (final.reason, final.detail)
        again = final.steps["agent"]
        assert again.attempt == 2 and again.output.strip() == "recovered"
        assert again.command_id != step.command_id
        assert losses[0].retry_at is not None
        sandbox = await client.sandbox_state(step.sandbox_id)
        assert sandbox is not None and sandbox.recovered_from is not None
        assert sandbox.commands[step.command_id].state == "infrastructure_lost"
        assert sandbox.commands[again.command_id].host == "h2"
