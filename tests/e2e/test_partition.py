"""Hosts as separate machines: a host-agent in its own network namespace, cut
off by taking its link down while its processes keep running."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from sandhold.bus.read import read_subjects
from sandhold.client import Client, connect
from sandhold.domain.requests import command_id_for

from tests.e2e.harness import Host, Up
from tests.support.netns import HostNet
from tests.support.waiting import wait_until

LEASE_TTL, FENCE_MARGIN = 2.0, 1.0


@pytest.fixture
def partitioned(tmp_path: Path) -> Iterator[tuple[Up, Host, Host, HostNet]]:
    up = Up(
        tmp_path / "data",
        "--hosts", "0",
        "--save-interval", "1",
        "--lease-ttl", str(LEASE_TTL),
        "--fence-margin", str(FENCE_MARGIN),
    ).start()  # fmt: skip
    net = HostNet("h1", 1)
    hosts: list[Host] = []
    try:
        net.create(HostNet.ports_of(up.nats_url))
        hosts = [Host(up, "h1", lease_ttl=LEASE_TTL, net=net), Host(up, "h2", lease_ttl=LEASE_TTL)]
        hosts[0].start()
        yield up, hosts[0], hosts[1], net
    finally:
        for host in hosts:
            host.stop()
        net.destroy()
        up.stop()


@pytest.fixture
async def client(partitioned) -> AsyncIterator[Client]:
    async with await connect(partitioned[0].url) as c:
        yield c


async def _live(client: Client, host: str) -> bool:
    hosts = (await client.list_hosts())["hosts"]
    return any(h["host"] == host and h["status"] == "live" for h in hosts)


async def _events(client: Client, sandbox_id: str) -> list:
    names = client.names
    return await read_subjects(client.js, names.events_stream, names.events("sandbox", sandbox_id))


@pytest.mark.timeout(240)
async def test_a_host_cut_off_by_its_network_is_recovered_elsewhere_and_writes_nothing_after(
    partitioned, client: Client
):
    up, h1, h2, net = partitioned
    view = await client.create_sandbox()
    sandbox_id = (await client.wait_for_phase(view.id, {"running"}, timeout=60)).id
    assert (await client.show_sandbox(sandbox_id)).host == "h1"
    h2.start()
    await wait_until(lambda: _live(client, "h2"), timeout=30, what="h2 live")
    await client.exec(sandbox_id, ["sh", "-c", "echo 0 > counter"])
    await client.wait_for(
        sandbox_id, lambda s: s.last_completed_save, timeout=30, what="a completed save"
    )
    ticker = "while true; do n=$(cat counter); echo $((n+1)) > counter; sleep 0.05; done"
    running = asyncio.create_task(client.exec(sandbox_id, ["sh", "-c", ticker], key="ticker"))
    ticker_id = command_id_for(sandbox_id, "ticker")
    await client.wait_for(
        sandbox_id,
        lambda s: (c := s.commands.get(ticker_id)) is not None and c.state == "running" or None,
        timeout=30,
        what="ticker running",
    )

    net.cut()  # the machine is fine; its network is not
    lost = await client.wait_for(
        sandbox_id, lambda s: s if s.lost and s.lost.fenced else None, timeout=30, what="fenced"
    )
    assert lost.phase == "lost"
    ended = await running
    assert ended.command.state == "infrastructure_lost"
    assert h1.process is not None and h1.process.poll() is None, "the agent runs on, cut off"
    # Cut off, it fenced itself: its sandbox's processes are gone, though it lives.
    await wait_until(lambda: not h1.sandbox_pids(), timeout=30, what="h1 fenced itself")

    await client.start_sandbox(sandbox_id)
    back = await client.wait_for_phase(sandbox_id, {"running"}, timeout=60)
    assert (back.host, back.generation) == ("h2", 2)
    recovered = (await client.exec(sandbox_id, ["cat", "counter"])).stdout
    last_seq = (await _events(client, sandbox_id))[-1].seq

    net.heal()  # whatever it held back now arrives
    await wait_until(lambda: _live(client, "h1"), timeout=60, what="h1 renewing again")
    await wait_until(
        lambda: not (h1.root / "sandboxes" / sandbox_id).exists(),
        timeout=30,
        what="its stale copy dropped",
    )
    await client.exec(sandbox_id, ["true"])  # the sandbox works on, on h2
    after = [r for r in await _events(client, sandbox_id) if r.seq > last_seq]
    assert after and all(r.envelope.actor != "host-agent:h1" for r in after)
    assert (await client.exec(sandbox_id, ["cat", "counter"])).stdout == recovered
    view = await client.show_sandbox(sandbox_id)
    assert (view.host, view.generation) == ("h2", 2)
