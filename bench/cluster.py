"""(i) Failover and (j) what three nodes cost, on `sandhold up --nodes 3`.

(i) One thing is killed with SIGKILL — the nats-server node leading the event
log, the scheduler instance the next command would prefer, an orchestrator
instance — and a request of the kind it serves is sent at once: the figure is
the time from the kill to that request's answer (an exec that ended, a task
submit answered). Between rounds `up` restarts what was killed. The baseline
row is the same request with nothing killed, in the same run.

(j) The cost of replication: fenced appends (`sandhold.bus.append.append`,
1,000 subjects, 256 in flight) on one node and on the three-node cluster (R3),
next to plain nats-py `js.publish` of the same messages on the same cluster;
and the exec round trip on `up` and on `up --nodes 3`.

    uv run python bench/cluster.py [--quick] [--write]
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

from _common import (
    ROOT,
    arguments,
    emit,
    envelopes_for,
    median,
    ms,
    nats_server,
    percentile,
    rate,
    sandbox_id,
    sandhold_up,
    table,
    temp_dir,
)
from append import one_run
from sandhold.bus.server import NatsCluster
from sandhold.client import connect
from sandhold.domain.task_manifest import parse_manifest

sys.path.insert(0, str(ROOT))  # the test harness `sandhold_up` runs, and its helpers
from tests.support.procs import alive  # noqa: E402

MANIFEST = parse_manifest(
    b"name: failover\nrepository: {url: 'git://127.0.0.1:9/none.git'}\nagent: {command: ['true']}\n"
)


async def _until(predicate, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("the cluster did not come back in time")
        await asyncio.sleep(0.2)


async def _settled(up, client) -> None:
    """Every process `up` runs is alive again and every stream is led and current."""
    await _until(lambda: all(alive(p) for p in up.runtime["services"].values()))
    await _until(lambda: all(alive(n["pid"]) for n in up.runtime["nats_nodes"]))

    async def current() -> bool:
        for stream in client.names.all_streams:
            try:
                info = await client.js.stream_info(stream)
            except Exception:  # noqa: BLE001 - no leader yet
                return False
            peers = (info.cluster.replicas or []) if info.cluster else []
            if not info.cluster or not info.cluster.leader or len(peers) != 2:
                return False
            if not all(p.current for p in peers):
                return False
        return True

    deadline = time.monotonic() + 120
    while not await current():
        if time.monotonic() > deadline:
            raise TimeoutError("streams not current")
        await asyncio.sleep(0.2)
    await asyncio.sleep(1.0)  # restarted instances announce ready, then pull


async def failover(rounds: int) -> list[list[str]]:
    rows = []
    with sandhold_up("failover", "--nodes", "3") as up:
        async with await connect(up.url) as client:
            sandbox = await client.create_sandbox(key="failover")
            await client.wait_for_phase(sandbox.id, {"running"}, timeout=60)
            n = 0

            failures = 0

            async def served(send) -> None:
                """Until answered: a request in flight when the node died may time
                out; the client sends it again with the same key, as any client would."""
                nonlocal n, failures
                n += 1
                while True:
                    try:
                        await send(f"k{n}")
                        return
                    except Exception as err:  # noqa: BLE001 - counted, then sent again
                        failures += 1
                        print(f"  request failed ({err!r}); again", flush=True)
                        await asyncio.sleep(0.1)

            async def exec_once() -> None:
                await served(lambda key: client.exec(sandbox.id, ["true"], key=key))

            async def submit_once() -> None:
                await served(lambda key: client.submit_task(MANIFEST, key=key))

            async def leader_node() -> int:
                info = await client.js.stream_info(client.names.events_stream)
                assert info.cluster is not None
                [node] = [m for m in up.runtime["nats_nodes"] if m["name"] == info.cluster.leader]
                return int(node["pid"])

            kinds = [
                ("exec, nothing killed (baseline)", None, exec_once),
                ("task submit, nothing killed (baseline)", None, submit_once),
                ("kill -9 the node leading the log → exec served", leader_node, exec_once),
                ("kill -9 scheduler-1 → exec served", "scheduler-1", exec_once),
                ("kill -9 orchestrator-1 → task submit answered", "orchestrator-1", submit_once),
            ]
            quick = client.nc.jetstream(timeout=0.5)

            async def elected(before: str, start: float) -> float:
                """The floor: when the cluster itself has a new leader for the log
                (nats-server's followers wait 4–9 s for a lost one)."""
                while True:
                    try:
                        info = await quick.stream_info(client.names.events_stream)
                        leader = info.cluster.leader if info.cluster else None
                        if leader not in (None, before):
                            return time.perf_counter() - start
                    except Exception:  # noqa: BLE001 - no leader yet
                        pass
                    await asyncio.sleep(0.05)

            for label, victim, request in kinds:
                took: list[float] = []
                floor: list[float] = []
                failures = 0
                for r in range(rounds):
                    await _settled(up, client)
                    pid = None
                    election = None
                    if callable(victim):
                        info = await client.js.stream_info(client.names.events_stream)
                        assert info.cluster is not None and info.cluster.leader is not None
                        pid = await victim()
                    elif victim is not None:
                        pid = int(up.runtime["services"][victim])
                    start = time.perf_counter()
                    if pid is not None:
                        os.kill(pid, signal.SIGKILL)
                    if callable(victim):
                        election = asyncio.create_task(elected(info.cluster.leader, start))
                    await request()
                    took.append(time.perf_counter() - start)
                    if election is not None:
                        floor.append(await election)
                    print(
                        f"{label} round {r + 1}: {ms(took[-1])} ms"
                        + (f" (new leader after {ms(floor[-1])} ms)" if floor else ""),
                        flush=True,
                    )
                rows.append(
                    [
                        label,
                        str(len(took)),
                        ms(median(floor)) if floor else "—",
                        ms(median(took)),
                        ms(percentile(took, 99)),
                        ms(max(took)),
                        str(failures),
                    ]
                )
    return rows


async def appends(rounds: int) -> list[list[str]]:
    plan = [(sid, envelopes_for(sid, 4)) for sid in (sandbox_id(i, "cluster") for i in range(1000))]
    results: dict[str, list[float]] = {"one": [], "three": [], "raw3": []}
    with nats_server("cluster-one") as server:
        await one_run(server.admin_url, server.pid, "sandhold", 90, plan[:100])  # warm
        for r in range(rounds):
            results["one"].append((await one_run(server.admin_url, None, "sandhold", r, plan))[0])
    with temp_dir("cluster-three") as data:
        cluster = NatsCluster(data)
        cluster.start()
        try:
            # (one_run makes the streams, which waits for the new cluster's leaders)
            await one_run(cluster.admin_urls, None, "sandhold", 91, plan[:100])  # warm
            for r in range(rounds):
                for variant, key in (("sandhold", "three"), ("plain", "raw3")):
                    value = (await one_run(cluster.admin_urls, None, variant, r, plan))[0]
                    results[key].append(value)
                    print(f"appends {key} round {r + 1}: {rate(value)} msgs/s", flush=True)
        finally:
            cluster.stop()
    labels = {
        "one": "sandhold `append`, one node (R1)",
        "three": "sandhold `append`, three nodes (R3)",
        "raw3": "baseline: plain `js.publish`, three nodes (R3)",
    }
    return [
        [labels[k], rate(median(v)), f"{min(v):,.0f}–{max(v):,.0f}"] for k, v in results.items()
    ]


async def exec_latency(count: int) -> list[list[str]]:
    rows = []
    for label, args in (
        ("`up` (one node)", ()),
        ("`up --nodes 3` (R3, two of each)", ("--nodes", "3")),
    ):
        with sandhold_up("cluster-exec", *args) as up:
            async with await connect(up.url) as client:
                sandbox = await client.create_sandbox(key="exec")
                await client.wait_for_phase(sandbox.id, {"running"}, timeout=60)
                for i in range(5):  # warm
                    await client.exec(sandbox.id, ["true"], key=f"w{i}")
                took = []
                for i in range(count):
                    start = time.perf_counter()
                    await client.exec(sandbox.id, ["true"], key=f"e{i}")
                    took.append(time.perf_counter() - start)
        rows.append([label, str(count), ms(median(took)), ms(percentile(took, 99))])
    return rows


async def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    rounds = 3 if args.quick else 7
    assert ROOT.exists()
    failed_over = await failover(rounds)
    emit(
        args,
        "failover",
        "(i) Failover on `up --nodes 3`: kill -9 → the next request served",
        "Time from the kill to the answer of a request sent at once and, when an attempt "
        "fails (a timeout while the cluster elects), sent again with the same key until "
        "answered (`up` restarts what was killed between rounds; every stream led and "
        "current before each).\n\n"
        + table(
            [
                "what",
                "rounds",
                "new leader p50 ms (floor)",
                "served p50 ms",
                "p99 ms",
                "max ms",
                "attempts that failed",
            ],
            failed_over,
        )
        + "\n\nAn orchestrator's *tasks* move to its twin after its lease "
        "(`--lease-ttl` + `--fence-margin`, decision 036); the row above is its "
        "request service, which the twin takes at once.",
    )
    append_rows = await appends(rounds)
    exec_rows = await exec_latency(50 if args.quick else 200)
    emit(
        args,
        "cluster",
        "(j) What three nodes cost: appends and exec round trip",
        "Fenced appends of the same 4,000 envelopes (1,000 subjects, 256 in flight), "
        f"median of {rounds} runs:\n\n"
        + table(["writer", "msgs/s (median)", "range"], append_rows)
        + "\n\nExec round trip (`client.exec(sid, ['true'])`, one at a time):\n\n"
        + table(["deployment", "n", "p50 ms", "p99 ms"], exec_rows),
    )


if __name__ == "__main__":
    asyncio.run(main())
