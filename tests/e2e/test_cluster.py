"""`sandhold up --nodes 3`: one JetStream cluster on loopback (R3 streams) and two
instances of every control-plane service, with real kill -9 of nodes, of service
instances and of `up` itself."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sandhold.bus.read import read_subject
from sandhold.client import Client, connect
from sandhold.domain import events as ev
from sandhold.domain.requests import command_id_for
from sandhold.gateway import tokens

from tests.e2e.harness import SANDHOLD, Up, box_inits
from tests.support.procs import alive, process_tree
from tests.support.waiting import wait_until

SERVICES = ("scheduler", "saver", "recovery", "metrics", "orchestrator", "gateway")
LEASE_TTL = 2.0
# How long an accepted command may take to end through a node's kill and the
# hosts' fences: far longer than both (a few seconds), and short enough that a
# command left behind fails the test with its story before pytest's timeout.
END_WAIT_S = 60.0


def _start(data_dir: Path, *extra: str) -> Up:
    return Up(data_dir, "--nodes", "3", *extra).start(timeout=120)


@pytest.fixture(scope="module")
def cup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    """A three-node `up` with two local hosts, shared by the module's tests."""
    data_dir = tmp_path_factory.mktemp("cluster") / "data"
    data_dir.mkdir()
    tokens.create(data_dir / "tokens.json", "default")
    running = _start(
        data_dir,
        "--hosts",
        "2",
        "--save-interval",
        "3600",
        "--lease-ttl",
        str(LEASE_TTL),
        "--fence-margin",
        "1",
    )
    try:
        yield running
    finally:
        running.stop()


def _status(up: Up) -> dict:
    return up.cli_json("cluster", "status")


def _cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


def _preferred_node(pid: int) -> str:
    argv = _cmdline(pid)
    return argv[argv.index("--nats") + 1].split(",")[0]


async def _story(client: Client, sandbox_id: str, key: str) -> str:
    """What the log says of a command that did not end in time: its sandbox's
    phase and every event of it since the command was queued."""
    command_id = command_id_for(sandbox_id, key)
    records = await client.sandbox_records(sandbox_id)
    lines, seen = [], False
    for record in records:
        event = record.envelope.event
        seen = seen or getattr(event, "command_id", None) == command_id
        if seen:
            lines.append(f"  seq {record.seq}: {event!r}")
    state = await client.sandbox_state(sandbox_id)
    phase = (state.phase, state.reason, state.host, state.generation) if state else None
    return f"{key} ({command_id}) has not ended; sandbox {phase}; since queued:\n" + "\n".join(
        lines[:200]
    )


async def _sandbox(client: Client, key: str) -> str:
    view = await client.create_sandbox(key=key)
    await client.wait_for_phase(view.id, {"running"}, timeout=60)
    return view.id


def test_nodes_3_runs_one_cluster_with_r3_streams_and_two_of_every_service(cup: Up):
    runtime = cup.runtime
    nodes = runtime["nats_nodes"]
    assert len(nodes) == 3 and len({n["name"] for n in nodes}) == 3
    assert all(alive(n["pid"]) for n in nodes)
    assert runtime["nats_url"] == ",".join(n["url"] for n in nodes)
    expected = {f"{s}-{i}" for s in SERVICES for i in (1, 2)}
    assert set(runtime["services"]) == expected | {"host-agent:local-1", "host-agent:local-2"}
    # Each instance has every node's URL and prefers a different one.
    for service in SERVICES:
        first, second = (runtime["services"][f"{service}-{i}"] for i in (1, 2))
        assert _preferred_node(first) == nodes[0]["url"]
        assert _preferred_node(second) == nodes[1]["url"]
        assert set(_cmdline(first)[_cmdline(first).index("--nats") + 1].split(",")) == {
            n["url"] for n in nodes
        }

    def replicated() -> dict | None:
        status = _status(cup)
        streams = status["streams"]
        ok = all(
            s["replicas_configured"] == 3
            and s["leader"] in {n["name"] for n in nodes}
            and len(s["replicas"]) == 2
            and all(r["current"] for r in s["replicas"])
            for s in streams
        )
        return status if ok else None

    status = asyncio.run(wait_until(replicated, timeout=30, what="every stream R3, led, current"))
    assert {s["stream"] for s in status["streams"]} >= {"SH_EVENTS", "SH_REQUESTS"}
    assert {i["instance"] for i in status["services"] if i["alive"]} >= expected

    def leases() -> dict | None:
        held = {lease["key"]: lease["holder"] for lease in _status(cup)["leases"]}
        wanted = {"orchestrator.orchestrator-1", "orchestrator.orchestrator-2"}
        duties = {"saver.claim.store", "scheduler.claim.placement"}
        return held if wanted | duties <= set(held) else None

    # Each orchestrator's lease, and each duty held by one of its service's instances.
    held = asyncio.run(wait_until(leases, timeout=30, what="leases and claims held"))
    assert held["saver.claim.store"] in {"saver-1", "saver-2"}
    assert held["scheduler.claim.placement"] in {"scheduler-1", "scheduler-2"}
    created = cup.cli_json("sandbox", "create", "--wait")
    ran = cup.cli("exec", created["id"], "--", "sh", "-c", "echo hello; exit 3")
    assert ran.returncode == 3 and ran.stdout == "hello\n", ran.stderr


@pytest.mark.timeout(300)
async def test_with_one_instance_of_every_service_killed_its_twin_carries_on(cup: Up):
    """`up` is paused (SIGSTOP) so that it restarts nothing: whatever is served
    after the kill -9 of every service's first instance is served by the second."""
    async with await connect(cup.url) as client:
        on_local_1 = await _sandbox(client, "twins-a")
        assert (await client.show_sandbox(on_local_1)).host in {"local-1", "local-2"}
        assert cup.process is not None
        runtime = cup.runtime
        os.kill(cup.process.pid, signal.SIGSTOP)
        try:
            killed = [runtime["services"][f"{s}-1"] for s in SERVICES]
            for pid in killed:
                os.kill(pid, signal.SIGKILL)
            await wait_until(lambda: not any(alive(p) for p in killed), what="instances gone")
            took: dict[str, float] = {}

            start = time.monotonic()  # the scheduler: a command, end to end
            result = await client.exec(on_local_1, ["sh", "-c", "echo twin"], key="twin-exec")
            assert result.stdout == b"twin\n" and result.command.exit_code == 0
            took["exec (scheduler-2)"] = time.monotonic() - start

            start = time.monotonic()  # the gateway: the same URL, served by gateway-2
            token = tokens.create(cup.data_dir / "tokens.json", "default")[1]
            async with httpx.AsyncClient(
                base_url=cup.gateway_url, headers={"Authorization": f"Bearer {token}"}
            ) as http:
                got = await http.get(f"/api/v1/sandboxes/{on_local_1}", timeout=30)
            assert got.status_code == 200 and got.json()["id"] == on_local_1
            took["GET sandbox (gateway-2)"] = time.monotonic() - start

            start = time.monotonic()  # the saver: a snapshot counts only once verified
            snapshot = await client.snapshot(on_local_1, name="twin", key="twin-snap")
            await client.wait_for(
                on_local_1,
                lambda s: s.saves[snapshot.id].state == "completed" or None,
                timeout=60,
                what="the snapshot verified by saver-2",
            )
            took["snapshot (saver-2)"] = time.monotonic() - start

            start = time.monotonic()  # recovery: its host fails; recovery-2 declares it
            host = (await client.show_sandbox(on_local_1)).host
            agent = runtime["services"][f"host-agent:{host}"]
            os.kill(agent, signal.SIGKILL)
            for pid in box_inits(cup.data_dir / "hosts" / str(host)):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            await client.wait_for_phase(on_local_1, {"lost"}, timeout=60)
            back = await client.exec(on_local_1, ["true"], key="twin-after-loss")
            assert back.command.exit_code == 0
            view = await client.show_sandbox(on_local_1)
            assert view.host != host and view.generation == 2
            took["host lost, recovered (recovery-2)"] = time.monotonic() - start
            print("served with one instance of each service killed:", took)
        finally:
            os.kill(cup.process.pid, signal.SIGCONT)
        # `up` restarts what was killed (the module's other tests need them).
        await wait_until(
            lambda: all(alive(p) for p in cup.runtime["services"].values()),
            timeout=60,
            what="every instance restarted",
        )


@pytest.mark.timeout(300)
async def test_kill_9_of_the_events_leader_loses_no_acknowledged_command(cup: Up):
    """Commands sent while the node leading the log is killed: each one answered
    is in the log, and none runs twice for its key, re-sent or not."""
    status = _status(cup)
    [events] = [s for s in status["streams"] if s["stream"] == "SH_EVENTS"]
    [leader] = [n for n in cup.runtime["nats_nodes"] if n["name"] == events["leader"]]
    async with await connect(cup.url) as client:
        sandbox_id = await _sandbox(client, "leader-kill")
        answered: dict[str, int] = {}
        failed: list[str] = []

        async def send(i: int) -> None:
            key = f"k{i}"
            try:
                result = await client.exec(
                    sandbox_id, ["sh", "-c", f"exit {i % 7}"], key=key, wait_timeout=END_WAIT_S
                )
                answered[key] = result.command.exit_code
            except TimeoutError:
                # Accepted, and no end for END_WAIT_S: not a request lost in flight
                # but a command left behind. Fail now, with its story.
                raise AssertionError(await _story(client, sandbox_id, key)) from None
            except Exception:  # noqa: BLE001 - a request in flight when the node died
                failed.append(key)

        async def load() -> None:
            for i in range(40):
                await send(i)

        sender = asyncio.create_task(load())
        await wait_until(lambda: len(answered) >= 5, timeout=60, what="commands before the kill")
        os.kill(leader["pid"], signal.SIGKILL)
        await sender
        # `up` starts the node again; it rejoins and catches up.
        await wait_until(
            lambda: (
                [n for n in cup.runtime["nats_nodes"] if n["name"] == leader["name"]][0]["pid"]
                != leader["pid"]
            ),
            timeout=30,
            what="the node restarted",
        )
        assert len(answered) >= 5
        # Every key again: an answered one gives the same record; one that failed
        # in flight runs at most once. The election outlasts the hosts' lease
        # (LEASE_TTL): a host may fence itself, and a command in flight on it
        # then ends as a host loss says (never run again, never a second run).
        ended: dict[str, str] = {}
        for i in range(40):
            key = f"k{i}"
            try:
                again = await client.exec(
                    sandbox_id, ["sh", "-c", f"exit {i % 7}"], key=key, wait_timeout=END_WAIT_S
                )
            except TimeoutError:
                raise AssertionError(await _story(client, sandbox_id, key)) from None
            ended[key] = again.command.state
            if again.command.state == "exited":
                assert again.command.exit_code == i % 7
            else:
                assert again.command.state in ("unknown", "infrastructure_lost"), again.command
            if key in answered:
                assert answered[key] == again.command.exit_code
        events = await read_subject(
            client.js, client.names.events_stream, client.names.events("sandbox", sandbox_id)
        )
        started: dict[str, int] = {}
        ends: dict[str, list[ev.CommandEnded]] = {}
        for record in events:
            event = record.envelope.event
            if isinstance(event, ev.CommandStarted):
                started[event.command_id] = started.get(event.command_id, 0) + 1
            if isinstance(event, ev.CommandEnded):
                ends.setdefault(event.command_id, []).append(event)
        for i in range(40):
            command_id = command_id_for(sandbox_id, f"k{i}")
            # (A command that ended at once has no start reported: decision 095.)
            assert started.get(command_id, 0) <= 1, f"k{i}"
            [end] = ends[command_id]
            if ended[f"k{i}"] == "exited":
                assert end.pid is not None, f"k{i}: an exit names the process that ran"
        if any(state != "exited" for state in ended.values()):
            # only where the sandbox's host was lost meanwhile
            assert any(isinstance(r.envelope.event, ev.SandboxLost) for r in events)


@pytest.mark.timeout(300)
async def test_kill_9_of_up_leaves_no_node_behind_and_the_store_keeps_its_layout(
    tmp_path: Path,
):
    first = _start(tmp_path / "data")
    try:
        runtime = first.runtime
        pids = [n["pid"] for n in runtime["nats_nodes"]] + list(runtime["services"].values())
        sandbox_id = first.cli_json("sandbox", "create", "--wait")["id"]
        tree = process_tree(pids)
        assert first.process is not None
        os.kill(first.process.pid, signal.SIGKILL)
        await wait_until(
            lambda: not [p for p in tree if alive(p)],
            timeout=60,
            interval=0.2,
            what="every node and instance of the killed up to end",
        )
    finally:
        first.stop()
    # The data dir holds a cluster's log: a single node would start on an empty one.
    refused = subprocess.run(
        [SANDHOLD, "--data-dir", str(tmp_path / "data"), "up"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 1 and "--nodes 3" in refused.stderr, refused.stderr
    second = _start(tmp_path / "data")
    try:
        assert second.cli_json("sandbox", "show", sandbox_id)["id"] == sandbox_id
        ran = second.cli("exec", sandbox_id, "--", "true")
        assert ran.returncode == 0, ran.stderr
    finally:
        second.stop()
