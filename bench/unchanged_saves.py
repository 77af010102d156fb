"""(p) What a command that changed nothing costs, with the save it may bring.

A command on a sandbox may change its files, so a scheduled save follows it
(decision 051) unless its end found every file as the last save holds them
(decision 078, in trees of up to `LOOK_MAX_NAMES` names). This runs N small
sandboxes and N with a tree over that cap, on one `sandhold up`, and round
after round one command on each sandbox of a set, then waits for the save it
brings, if any: "write" changes a file (the save is stored: manifest, upload,
verification — the baseline); "no-op" runs `true` in a small tree (its end
holds the files: no save); "no-op, large tree" runs `true` where the end does
not look (the save finds nothing changed: `save.unchanged`, decision 067).
It reports the CPU each process used per command (and its save), and how each
ended. The command's own cost is in all three.

    uv run python bench/unchanged_saves.py [--quick] [--write] [--sandboxes N]
"""

from __future__ import annotations

import asyncio
from collections import Counter

from _common import arguments, emit, sandhold_up, table
from sandhold.bus.codec import decode_envelope
from sandhold.client import Client, connect
from sandhold.domain import events as ev
from sandhold.domain import sandbox as sb
from sandhold.hostagent.saving import LOOK_MAX_NAMES
from scale import machine_busy_seconds, services_cpu_seconds

WRITE, NOOP, NOOP_LARGE = "write", "no-op", "no-op, large tree"
COMMANDS = {WRITE: ["sh", "-c", "date +%s%N > stamp"], NOOP: ["true"], NOOP_LARGE: ["true"]}
# More names than a command's end looks at (decision 078).
LARGE_TREE = (
    f"mkdir many && cd many && i=0; while [ $i -lt {LOOK_MAX_NAMES + 100} ]; "
    "do : > f$i; i=$((i+1)); done"
)
IN_FLIGHT_AT_ONCE = 8
SAVE_INTERVAL_S = 2.0


async def make(client: Client, count: int, *, large: bool) -> list[str]:
    gate = asyncio.Semaphore(IN_FLIGHT_AT_ONCE)
    fill = f"echo first > stamp && {LARGE_TREE}" if large else "echo first > stamp"

    async def one() -> str:
        async with gate:
            view = await client.create_sandbox(save_interval_s=SAVE_INTERVAL_S)
            await client.wait_for_phase(view.id, {"running"}, timeout=300)
            await client.exec(view.id, ["sh", "-c", fill])
            return view.id

    return list(await asyncio.gather(*(one() for _ in range(count))))


def quiet(state: sb.Sandbox) -> bool | None:
    """Saved, with nothing since that could change a file, and no save under way."""
    return True if sb.unchanged_since(state) and not state.saves_in_flight else None


async def command_and_save(client: Client, sandbox_id: str, argv: list[str]) -> str:
    """Run `argv`, then wait for the first save requested after it to end (none
    when its end held the files, decision 078), watching the sandbox's events as
    they are appended (reading its state back from the log per change would cost
    the server more than the save does)."""
    # (A quiet sandbox is not saved again until something happens: every save
    # requested from here on is the command's.)
    requested: set[str] = set()
    ended: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def on_event(msg) -> None:
        event = decode_envelope(msg.data).event
        if isinstance(event, ev.CommandEnded) and event.files_of and not ended.done():
            ended.set_result("held by its end")
        elif isinstance(event, ev.SaveRequested):
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
        small = await make(client, count, large=False)
        large = await make(client, count, large=True)
        # Past the racy window of their first files: a capture then trusts their stat.
        await asyncio.sleep(2 * SAVE_INTERVAL_S + 1)
        # And every save their creation brought ended (a large tree's first ones
        # take a while), so that a round's CPU is its commands' and saves' alone.
        await asyncio.gather(
            *(client.wait_for(i, quiet, timeout=300, what="a quiet save") for i in small + large)
        )
        gate = asyncio.Semaphore(IN_FLIGHT_AT_ONCE)
        results = []
        for n in range(rounds):
            kind = (WRITE, NOOP, NOOP_LARGE)[n % 3]
            ids = large if kind == NOOP_LARGE else small

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
    rounds = 6 if args.quick else 9
    with sandhold_up("unchanged-saves", "--host-capacity", str(2 * count + 10)) as up:
        results = asyncio.run(measure(up.url, lambda: up.runtime, count, rounds))

    def mean(kind: str, key: str | None = None) -> float:
        picked = [r for r in results if r["kind"] == kind]
        values = [r["machine"] if key is None else r["by"][key] for r in picked]
        return sum(values) / len(values)

    names = list(results[0]["by"])
    rows = [["whole machine", *(f"{mean(kind):.1f}" for kind in COMMANDS)]]
    rows += [[name, *(f"{mean(kind, name):.1f}" for kind in COMMANDS)] for name in names]
    ended = {
        kind: sum((r["states"] for r in results if r["kind"] == kind), Counter())
        for kind in COMMANDS
    }
    headers = ["where", "write (stored save)", "no-op (no save)", "no-op, large tree (unchanged)"]
    body = f"""
{count} small sandboxes and {count} with {LOOK_MAX_NAMES + 100} more names in their tree, of
one `sandhold up` (saves every {SAVE_INTERVAL_S:.0f} s); {rounds} rounds taking turns:
one command on each sandbox of a set ({IN_FLIGHT_AT_ONCE} at once), then the scheduled save
it brings, if any, waited for until it ends. "write" changes a file (the save
is stored and verified: the baseline); "no-op" runs `true` in a small tree
(its end holds the files, decision 078); "no-op, large tree" runs `true`
where the end does not look (the save ends unchanged, decision 067). How each
ended: {"; ".join(f"{kind} {dict(ended[kind])}" for kind in COMMANDS)}.

CPU per command and its save, if any (ms of CPU time, all cores, mean of the rounds):

{table(headers, rows)}
"""
    emit(args, "unchanged_saves", "(p) A command that changed nothing, and its save", body)


if __name__ == "__main__":
    main()
