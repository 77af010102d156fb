"""(m) Tail latency under load: exec `true` on a full host with sandboxes waiting for room.

Through `sandhold up` (the default driver, one host of the default capacity):
  baseline: exec `true` on the only sandbox, nothing else on the machine;
  loaded:   64 sandboxes running (the host's capacity) and 136 more waiting for
            room, every running one saved every 30 s (the default); exec `true`
            round-robin over the running ones, one after another, for --seconds.
Reports p50/p90/p99/max and how many execs took over 100 ms and over 1 s, and
the waiting sandboxes' status reasons.

    uv run python bench/load.py [--quick] [--write] [--seconds 90]
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

from _common import arguments, emit, median, percentile, sandhold_up, table, verdict
from sandhold.client import Client, connect

CAPACITY = 64
WAITING = 136
GOAL_P99_S = 0.050


async def execs(
    client: Client, sandboxes: list[str], seconds: float, tag: str
) -> list[tuple[float, float]]:
    """(seconds since the start, latency) of each exec, one after another."""
    out: list[tuple[float, float]] = []
    started = time.perf_counter()
    i = 0
    while time.perf_counter() - started < seconds:
        sandbox_id = sandboxes[i % len(sandboxes)]
        sent = time.perf_counter()
        result = await client.exec(sandbox_id, ["true"], key=f"exec-{tag}-{i}")
        out.append((sent - started, time.perf_counter() - sent))
        if result.command.state != "exited":
            raise RuntimeError(f"{sandbox_id}: {result.command.state}")
        i += 1
    return out


def row(label: str, values: list[float]) -> list[str]:
    ms = [v * 1000 for v in values]
    return [
        label,
        f"{len(ms):,}",
        f"{median(ms):.1f}",
        f"{percentile(ms, 90):.1f}",
        f"{percentile(ms, 99):.1f}",
        f"{max(ms):.0f}",
        f"{sum(1 for v in ms if v > 100)}",
        f"{sum(1 for v in ms if v > 1000)}",
    ]


async def measure(
    url: str, seconds: float, baseline_s: float
) -> tuple[list[str], list[str], str, str]:
    client = await connect(url)
    try:
        first = await client.create_sandbox(key="load-0")
        await client.wait_for_phase(first.id, {"running"}, timeout=120)
        alone = [lat for _, lat in await execs(client, [first.id], baseline_s, "alone")]
        created = [first.id]
        for i in range(1, CAPACITY + WAITING):
            created.append((await client.create_sandbox(key=f"load-{i}")).id)
        running: list[str] = [first.id]
        deadline = time.monotonic() + 600
        while len(running) < CAPACITY and time.monotonic() < deadline:
            views = await client.list_sandboxes()
            running = [v.id for v in views if v.phase == "running"]
            await asyncio.sleep(1)
        print(f"{len(running)} running, {len(created) - len(running)} waiting", flush=True)
        loaded = await execs(client, running, seconds, "loaded")
        reasons = Counter(
            v.reason or "(none)" for v in await client.list_sandboxes() if v.phase == "pending"
        )
        slow = [f"{at:.1f}s: {lat * 1000:.0f} ms" for at, lat in loaded if lat > 0.1]
        return (
            row("baseline: one sandbox, nothing else", alone),
            row(
                f"{len(running)} running, {len(created) - len(running)} waiting",
                [lat for _, lat in loaded],
            ),
            ", ".join(f"`{r}` × {n}" for r, n in reasons.most_common()),
            "; ".join(slow[:40]) + (" …" if len(slow) > 40 else ""),
        )
    finally:
        await client.close()


def main() -> None:
    args = arguments(
        __doc__.splitlines()[0],
        extra=lambda p: p.add_argument("--seconds", type=float, default=0.0),
    )
    seconds = args.seconds or (20.0 if args.quick else 90.0)
    with sandhold_up("load") as up:
        base, loaded, reasons, slow = asyncio.run(measure(up.url, seconds, min(seconds, 15.0)))  # type: ignore[attr-defined]
    p99 = float(loaded[4]) / 1000
    body = f"""
One `sandhold up` (the default driver, one host of capacity {CAPACITY}, saves
every 30 s), exec `true` one after another; ms. The baseline runs first, on the
only sandbox; then {CAPACITY + WAITING - 1} more are created, and the loaded
run goes round the running ones for {seconds:.0f} s.

{table(["run", "execs", "p50", "p90", "p99", "max", "> 100 ms", "> 1 s"], [base, loaded])}

Goal: p99 ≤ {GOAL_P99_S * 1000:.0f} ms under load → {p99 * 1000:.1f} ms {verdict(p99 <= GOAL_P99_S)}

The waiting sandboxes' status reasons: {reasons}.

Execs over 100 ms (seconds into the loaded run: latency): {slow or "none"}.
"""
    emit(args, "load", "(m) Tail latency under load: a full host, sandboxes waiting", body)


if __name__ == "__main__":
    main()
