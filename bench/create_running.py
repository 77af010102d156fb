"""(d) create → running through `sandhold up`, next to its floor.

Starts `sandhold up` in a temp data dir; for each of N sandboxes, subscribes to
`sh.ev.sandbox.<id>` (the id follows from the key), calls
`client.create_sandbox(key=...)` and waits for the `sandbox.started` event;
stamps every event and the work message on the way. Then deletes them all, timed
the same way up to `sandbox.deleted`. The floor, in the same run on a fresh
server: the bus alone (one request stored + a request/reply round trip + four
fenced appends + one work publish: the six durable writes create → running
needs), and the host driver's `create_sandbox` alone.

    uv run python bench/create_running.py [--quick] [--write]
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgspec
import nats
from _common import (
    FLOOR_WRITES,
    LATENCY_HEADERS,
    arguments,
    bus_floor,
    emit,
    fsync_probe,
    latency_row,
    median,
    ms,
    nats_server,
    nproc,
    percentile,
    sandhold_up,
    table,
    temp_dir,
    verdict,
)
from sandhold.bus.codec import decode_envelope
from sandhold.bus.names import Names
from sandhold.client import connect
from sandhold.domain import requests as rq
from sandhold.domain.work import AnyWork

work_decoder = msgspec.json.Decoder(AnyWork)

GOAL_P50_MS = 100.0

STEPS = [
    ("request_acked", "request stored (JetStream ack of the publish)"),
    ("sandbox.created", "`sandbox.created` seen (scheduler appended it)"),
    ("reply", "scheduler's reply received by the client"),
    ("sandbox.placed", "`sandbox.placed` seen (reconciler chose the host)"),
    ("start_sandbox", "start work seen on `sh.work.local`"),
    ("sandbox.starting", "`sandbox.starting` seen (host-agent took the work)"),
    ("sandbox.started", "`sandbox.started` seen (host-agent created it): **the figure**"),
]
DELETE_STEPS = [
    ("sandbox.delete_requested", "`sandbox.delete_requested` seen"),
    ("reply", "scheduler's reply received"),
    ("destroy_sandbox", "destroy work seen on `sh.work.local`"),
    ("sandbox.deleted", "`sandbox.deleted` seen (host-agent destroyed it)"),
]


async def measure(url: str, count: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    names = Names("sh")
    client = await connect(url)
    watcher = await nats.connect(url, name="bench-create-watcher")
    stamps: dict[str, dict[str, float]] = {}
    waiting: dict[tuple[str, str], asyncio.Future[float]] = {}

    def stamp(sandbox_id: str, what: str, at: float) -> None:
        stamps.setdefault(sandbox_id, {}).setdefault(what, at)
        future = waiting.get((sandbox_id, what))
        if future is not None and not future.done():
            future.set_result(at)

    async def on_event(msg) -> None:
        at = time.perf_counter()
        envelope = decode_envelope(msg.data)
        stamp(envelope.aggregate_id, envelope.type, at)

    async def on_work(msg) -> None:
        at = time.perf_counter()
        work = work_decoder.decode(msg.data)
        stamp(work.sandbox_id, type(work).__struct_config__.tag, at)

    current: dict[str, float] = {}
    send, publish = client.send, client.js.publish

    async def timed_publish(*args, **kwargs):
        ack = await publish(*args, **kwargs)
        current["request_acked"] = time.perf_counter()
        return ack

    async def timed_send(request):
        reply = await send(request)
        current["reply"] = time.perf_counter()
        return reply

    client.js.publish = timed_publish  # type: ignore[method-assign]
    client.send = timed_send  # type: ignore[method-assign]

    async def one(
        sandbox_id: str,
        call,
        final: str,
        steps: list[tuple[str, str]],
        into: dict[str, list[float]],
    ) -> None:
        sub = await watcher.subscribe(names.events("sandbox", sandbox_id), cb=on_event)
        await watcher.flush()
        done = asyncio.get_running_loop().create_future()
        waiting[(sandbox_id, final)] = done
        stamps.pop(sandbox_id, None)
        current.clear()
        started = time.perf_counter()
        await call()
        await asyncio.wait_for(done, 60)
        await asyncio.sleep(0.005)
        await sub.unsubscribe()
        seen = {**stamps.get(sandbox_id, {}), **current}
        for name, _ in steps:
            if name in seen:
                into[name].append(seen[name] - started)

    try:
        await watcher.subscribe(names.work("local"), cb=on_work)
        await watcher.flush()
        created: dict[str, list[float]] = {name: [] for name, _ in STEPS}
        deleted: dict[str, list[float]] = {name: [] for name, _ in DELETE_STEPS}
        ids = []
        for i in range(count + 2):
            key = f"bench-create-{i}"
            sandbox_id = rq.sandbox_id_for(client.tenant, key)
            target = created if i >= 2 else {name: [] for name, _ in STEPS}  # 2 warm-ups
            await one(
                sandbox_id,
                lambda key=key: client.create_sandbox(key=key),
                "sandbox.started",
                STEPS,
                target,
            )
            ids.append(sandbox_id)
        for sandbox_id in ids:
            await one(
                sandbox_id,
                lambda s=sandbox_id: client.delete_sandbox(s),
                "sandbox.deleted",
                DELETE_STEPS,
                deleted,
            )
        return created, deleted
    finally:
        await watcher.close()
        await client.close()


async def driver_create(root: Path, count: int) -> list[float]:
    """`ProcessDriver.create_sandbox` alone: dirs, the sandbox's cgroups, its box."""
    from sandhold.hostagent.driver import ProcessDriver

    driver = ProcessDriver(root, "bench-create", isolate_tmp=False, warm=0)
    await driver.start()  # the namespaced driver builds its base and probes a box here
    out = []
    try:
        for i in range(count):
            sandbox_id = f"sb-{i:016x}"
            started = time.perf_counter()
            await driver.create_sandbox(sandbox_id, None)
            out.append(time.perf_counter() - started)
            await driver.destroy_sandbox(sandbox_id)
    finally:
        driver.cgroups.remove_host()
        await driver.close()
    return out


def steps_table(steps: list[tuple[str, str]], values: dict[str, list[float]]) -> str:
    rows, previous = [], 0.0
    for name, label in steps:
        if not values[name]:
            rows.append([label, "0", "–", "–", "–"])
            continue
        at = median(values[name])
        rows.append(
            [
                label,
                str(len(values[name])),
                ms(at),
                ms(at - previous),
                ms(percentile(values[name], 99)),
            ]
        )
        previous = at
    return table(
        ["milestone (time since the call)", "n", "p50 ms", "step (Δ p50) ms", "p99 ms"], rows
    )


async def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    count = 20 if args.quick else 50
    disk, _ = fsync_probe()
    print(disk)
    with temp_dir("create-driver") as root:
        driver = await driver_create(root, count)
    with sandhold_up("create") as up:
        created, deleted = await measure(up.url, count)
    with nats_server("create-floor") as server:
        floor = await bus_floor(server.admin_url, count)
    running = created["sandbox.started"]
    p50, p99 = percentile(running, 50) * 1000, percentile(running, 99) * 1000
    floor_sum = (percentile(floor, 50) + percentile(driver, 50)) * 1000
    at = {name: median(v) if v else float("nan") for name, v in created.items()}
    body = f"""
{count} sandboxes created one after another (after 2 warm-ups) with the Python
client against `sandhold up` (one scheduler, one host-agent, nats-server with
`sync_interval: always`); each timed from `create_sandbox` to the
`sandbox.started` event on `sh.ev.sandbox.<id>` (subscribed before the call).
Then all deleted, timed to `sandbox.deleted`. Floors measured in the same run:
the driver's `create_sandbox` before `sandhold up` starts, the bus alone on a
fresh server after it stopped. {disk}.

{
        table(
            ["", "value"],
            [
                ["create → running p50 / p99 (ms)", f"{p50:.1f} / {p99:.1f}"],
                ["goal", f"p50 ≤ {GOAL_P50_MS:.0f} ms"],
                ["verdict", verdict(p50 <= GOAL_P50_MS)],
                [
                    "vs floor (bus + driver create, p50)",
                    f"{p50:.1f} ms vs {floor_sum:.1f} ms = {p50 / floor_sum:.1f}×",
                ],
            ],
        )
    }

{
        table(
            LATENCY_HEADERS,
            [
                latency_row("sandhold: `create_sandbox` → `sandbox.started` seen", running),
                latency_row(
                    "sandhold: `delete_sandbox` → `sandbox.deleted` seen",
                    deleted["sandbox.deleted"],
                ),
                latency_row(
                    f"floor: bus only ({FLOOR_WRITES} fsync'd writes + 1 round trip)", floor
                ),
                latency_row("floor: `ProcessDriver.create_sandbox` alone", driver),
            ],
        )
    }

Where create → running goes:

{steps_table(STEPS, created)}

Where delete → deleted goes:

{steps_table(DELETE_STEPS, deleted)}

Reading: create → running is the request (stored, decided: `sandbox.created`,
reply), the reconciler's placement (`sandbox.placed`, then on its next pass the
start work), and the host-agent (`sandbox.starting`, driver `create_sandbox`,
`sandbox.started`): {FLOOR_WRITES} fsync'd writes in sequence, three Python
processes and nats-server on {nproc()} cores. Against the floor of
{floor_sum:.1f} ms (bus writes + driver), the extra {p50 - floor_sum:.1f} ms is hops
and scheduling: the scheduler appends `sandbox.placed` and publishes the work in
two reconciler passes ({ms(at["start_sandbox"] - at["sandbox.placed"])} ms between
them), the agent takes the work {ms(at["sandbox.starting"] - at["start_sandbox"])} ms after
it is published, and `sandbox.started` follows `sandbox.starting` by
{ms(at["sandbox.started"] - at["sandbox.starting"])} ms (driver create + one append).
"""
    emit(args, "create_running", "(d) create → running", body)


if __name__ == "__main__":
    asyncio.run(main())
