"""Node faults on a real three-node JetStream cluster (`sync_interval: always`,
R3): what the Jepsen analysis of NATS 2.12 found lost — acknowledged writes —
must all be in the log after a node, the stream's leader, is killed -9 mid-write."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest
from sandhold.bus.append import WrongSequence, append
from sandhold.bus.names import Names
from sandhold.bus.read import read_subjects
from sandhold.bus.server import NatsCluster
from sandhold.bus.streams import ensure_streams
from sandhold.domain.envelope import wrap
from sandhold.domain.errors import InfraError
from sandhold.domain.events import SandboxCreated, SandboxStopRequested

from tests.support.waiting import wait_until

WRITERS = 4


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[NatsCluster]:
    running = NatsCluster(tmp_path / "cluster")
    running.start()
    try:
        yield running
    finally:
        running.stop()


def _event(sandbox_id: str, n: int):
    if n == 0:
        return SandboxCreated(sandbox_id=sandbox_id, request_key="k", request_digest="d")
    return SandboxStopRequested(request_key=f"stop-{n}", request_digest="d")


async def _leader(js, stream: str) -> str | None:
    with contextlib.suppress(Exception):
        info = await js.stream_info(stream)
        return info.cluster.leader if info.cluster else None
    return None


@pytest.mark.timeout(180)
async def test_every_acknowledged_append_survives_kill_9_of_the_leader(cluster: NatsCluster):
    names = Names("faults")
    nc = await nats.connect(cluster.admin_urls, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    try:
        js = nc.jetstream()
        await ensure_streams(js, names, replicas=3)
        stream = names.events_stream
        acked: dict[str, int] = {}  # message id -> the sequence its ack gave
        stop = asyncio.Event()

        async def writer(w: int) -> None:
            sandbox_id = f"sb-{w:016x}"
            subject = names.events("sandbox", sandbox_id)
            expected, n = 0, 0
            while not stop.is_set():
                [envelope] = wrap(
                    [_event(sandbox_id, n)],
                    aggregate_id=sandbox_id,
                    id_base=f"w{w}:{n}",
                    actor="test",
                    causation_id="c",
                    correlation_id="c",
                    time=time.time(),
                )
                try:
                    [seq] = await append(js, stream, subject, [envelope], expected)
                except WrongSequence:
                    raise  # this loop is the subject's only writer: a lost append shows here
                except (InfraError, nats.errors.Error):
                    await asyncio.sleep(0.05)  # the cluster is electing: the same append again
                    continue
                acked[envelope.id] = seq
                expected, n = seq, n + 1

        writers = [asyncio.create_task(writer(w)) for w in range(WRITERS)]
        await wait_until(lambda: len(acked) >= 40, timeout=60, what="appends before the kill")
        leader_name = await _leader(js, stream)
        [leader] = [n for n in cluster.nodes if n.name == leader_name]
        leader.kill()
        before = len(acked)
        await wait_until(
            lambda: len(acked) >= before + 40, timeout=60, what="appends under a new leader"
        )
        assert await _leader(js, stream) != leader_name
        leader.start()  # back on its port and store; it catches up
        await wait_until(lambda: len(acked) >= before + 80, timeout=60, what="appends after")
        stop.set()
        await asyncio.gather(*writers)

        async def all_current() -> bool:
            info = await js.stream_info(stream)
            peers = info.cluster.replicas or [] if info.cluster else []
            return len(peers) == 2 and all(p.current for p in peers)

        await wait_until(all_current, timeout=60, what="every replica current")
        assert _missing(acked, await _stored(js, stream)) == {}
        # Once more from another node's copy: kill whichever node leads now.
        second = await _leader(js, stream)
        [leading] = [n for n in cluster.nodes if n.name == second]
        leading.kill()
        await wait_until(lambda: _other_leader(js, stream, second), timeout=60, what="a leader")
        assert _missing(acked, await _stored(js, stream)) == {}
        leading.start()
    finally:
        await nc.close()


async def _stored(js, stream: str) -> dict[str, int]:
    return {r.envelope.id: r.seq for r in await read_subjects(js, stream, "faults.ev.>")}


def _missing(acked: dict[str, int], stored: dict[str, int]) -> dict[str, int]:
    """Appends whose ack was given but that are not in the log where the ack said.
    (The log may hold more: an append whose ack was lost in the failover.)"""
    return {i: seq for i, seq in acked.items() if stored.get(i) != seq}


async def _other_leader(js, stream: str, not_this: str) -> bool:
    leader = await _leader(js, stream)
    return leader is not None and leader != not_this
