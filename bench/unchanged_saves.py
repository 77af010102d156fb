"""(p) What a scheduled save costs when the command before it changed nothing.

Every command on a sandbox is followed by a scheduled save (decision 051 stops
them only while nothing at all happens). This runs N sandboxes of one
`sandhold up` and, round after round, one command on each, then waits for the
save it brings: in "write" rounds the command changes a file (the save is
stored: manifest, upload, verification — the baseline), in "no-op" rounds it
runs `true` (the save finds nothing changed: `save.unchanged`, decision 067).
It reports the CPU each process used per command-and-save, and how the saves
ended. The command's own cost is in both.

    uv run python bench/unchanged_saves.py [--quick] [--write] [--sandboxes N]
"""

from __future__ import annotations

import asyncio
from collections import Counter

from _common import arguments, emit, sandhold_up, table
from sandhold.bus.codec import decode_envelope
from sandhold.client import Client, connect
from sandhold.domain import events as ev
from scale import machine_busy_seconds, services_cpu_seconds

COMMANDS = {"write": ["sh", "-c", "date +%s%N > stamp"], "no-op": ["true"]}
IN_FLIGHT_AT_ONCE = 8
SAVE_INTERVAL_S = 2.0


async def make(client: Client, count: int) -> list[str]:
    gate = asyncio.Semaphore(IN_FLIGHT_AT_ONCE)

    async def one() -> str:
        async with gate:
            view = await client.create_sandbox(save_interval_s=SAVE_INTERVAL_S)
            await client.wait_for_phase(view.id, {"running"}, timeout=300)
            await client.exec(view.id, ["sh", "-c", "echo first > stamp"])
            return view.id

    return list(await asyncio.gather(*(one() for _ in range(count))))


async def command_and_save(client: Client, sandbox_id: str, argv: list[str]) -> str:
    """Run `argv`, then wait for the first save requested after it to end,
    watching the sandbox's events as they are appended (reading its state back
    from the log per change would cost the server more than the save does)."""
    # (A quiet sandbox is not saved again until something happens: every save
    # requested from here on is the command's.)
    requested: set[str] = set()
    ended: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def on_event(msg) -> None:
        event = decode_envelope(msg.data).event
        if isinstance(event, ev.SaveRequested):
            requested.add(event.save_id)
        elif isinstance(event, tuple(ENDS)) and event.save_id in requested and not ended.done():
            ended.set_result(ENDS[type(event)])

    sub = await client.nc.subscribe(client.names.events("sandbox", sandbox_id), cb=on_event)
    try:
        await client.exec(sandbox_id, argv)
        return await asyncio.wait_for(ended, timeout=120)
    finally:
        await sub.unsubscribe()


ENDS: dict[type, str] = {
    ev.SaveCompleted: "completed",
    ev.SaveUnchanged: "unchanged",
    ev.SaveFailed: "failed",
}


async def measure(url: str, runtime, count: int, rounds: int) -> list[dict]:
    client = await connect(url)
    try:
        ids = await make(client, count)
        # Past the racy window of their first files: a capture then trusts their stat.
        await asyncio.sleep(2 * SAVE_INTERVAL_S + 1)
        gate = asyncio.Semaphore(IN_FLIGHT_AT_ONCE)
        results = []
        for n in range(rounds):
            kind = "write" if n % 2 == 0 else "no-op"

            async def one(sandbox_id: str, kind: str = kind) -> str:
                async with gate:
                    return await command_and_save(client, sandbox_id, COMMANDS[kind])

            busy, before = machine_busy_seconds(), services_cpu_seconds(runtime())
            states = Counter(await asyncio.gather(*(one(i) for i in ids)))
            busy = machine_busy_seconds() - busy
            after = services_cpu_seconds(runtime())
            results.append(
                {
                    "kind": kind,
                    "states": states,
                    "machine": busy / count * 1000,
                    "by": {k: (after[k] - before[k]) / count * 1000 for k in after},
                }
            )
            print(kind, dict(states), f"{busy / count * 1000:.1f} ms CPU per command+save")
        return results
    finally:
        await client.close()


def main() -> None:
    args = arguments(
        __doc__.splitlines()[0],
        extra=lambda p: p.add_argument("--sandboxes", type=int, default=0),
    )
    count = args.sandboxes or (30 if args.quick else 100)
    rounds = 4 if args.quick else 6
    with sandhold_up("unchanged-saves", "--host-capacity", str(count + 10)) as up:
        results = asyncio.run(measure(up.url, lambda: up.runtime, count, rounds))

    def mean(kind: str, key: str | None = None) -> float:
        picked = [r for r in results if r["kind"] == kind]
        values = [r["machine"] if key is None else r["by"][key] for r in picked]
        return sum(values) / len(values)

    names = list(results[0]["by"])
    rows = [["whole machine", f"{mean('write'):.1f}", f"{mean('no-op'):.1f}"]]
    rows += [[name, f"{mean('write', name):.1f}", f"{mean('no-op', name):.1f}"] for name in names]
    ended = {
        kind: sum((r["states"] for r in results if r["kind"] == kind), Counter())
        for kind in COMMANDS
    }
    body = f"""
{count} sandboxes of one `sandhold up` (saves every {SAVE_INTERVAL_S:.0f} s), {rounds} rounds
alternating: one command on each sandbox ({IN_FLIGHT_AT_ONCE} at once), then the
scheduled save it brings, waited for until it ends. "write" changes a file (the
save is stored and verified: the baseline); "no-op" runs `true`. How the saves
ended: write {dict(ended["write"])}, no-op {dict(ended["no-op"])}.

CPU per command and its save (ms of CPU time, all cores, mean of the rounds):

{table(["where", "write (stored save)", "no-op"], rows)}
"""
    emit(args, "unchanged_saves", "(p) A save after a command that changed nothing", body)


if __name__ == "__main__":
    main()
