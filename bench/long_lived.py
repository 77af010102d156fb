"""(o) One long-lived sandbox: what each event costs the services at 10, 1,000
and 10,000 commands in its history (and, in a second table, saves).

For one sandbox whose history has C ended commands (4 events each, the shapes
of (b)), then one more command's four events, pure CPU (no NATS), best of
several rounds, µs per event:
  evolve:      `sandbox.evolve` (every service's fold);
  plan:        the scheduler's `plan` (run after every change of the sandbox);
  view:        `sandbox_view` (the gateway and CLI per read, the console per row);
  read model:  the gateway's write per event: `changed_commands` and the
               sandbox row (`sandbox_row`, its JSON) that it stores;
  baseline:    one pass over every command asking whether it ended, the least
               that any step going through all of them pays (what `plan`, the
               view and the read model did before the indexes of issue 15).

    uv run python bench/long_lived.py [--quick] [--write]
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
from _common import arguments, emit, envelopes_for, sandbox_id, table, verdict
from sandhold.bus.codec import encode_envelope
from sandhold.bus.names import Names
from sandhold.domain import events as ev
from sandhold.domain import fingerprints, pmap
from sandhold.domain import sandbox as sb
from sandhold.domain.envelope import Envelope, wrap
from sandhold.domain.fold import fold
from sandhold.domain.reconcile import plan
from sandhold.domain.saver import awaiting_verification, due_save, expired, save_work, timed_out
from sandhold.domain.views import sandbox_view
from sandhold.gateway.readmodel import ReadModel, changed_commands, changed_saves, sandbox_row

SIZES = (10, 1_000, 10_000)
GOAL_FLAT = 2.0  # per event at 10,000 commands within 2x of that at 10


def _host(_: sb.Sandbox) -> str | None:
    return "local"


_ENCODER = msgspec.msgpack.Encoder(enc_hook=pmap.enc_hook)
_COMMAND = msgspec.json.Decoder(sb.Command)


def kept_kib(state: sb.Sandbox) -> tuple[float, float]:
    """KiB of the state as a checkpoint stores it: whole (the client, `replay`)
    and compacted (what every service keeps, decisions 057 and 068)."""
    return (
        len(_ENCODER.encode(state)) / 1024,
        len(_ENCODER.encode(sb.compact(state))) / 1024,
    )


def best_per_call(step: Callable[[], object], calls: int, rounds: int) -> float:
    """µs per call, best of `rounds` (the machine is shared)."""
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(calls):
            step()
        best = min(best, (time.perf_counter() - started) / calls)
    return best * 1e6


def measure(commands: int, rounds: int) -> dict[str, float]:
    sid = sandbox_id(commands, "long")
    envelopes = envelopes_for(sid, 4 + 4 * (commands + 1))
    history, last = envelopes[:-4], envelopes[-4:]
    before = fold(sb.evolve, history, None)
    assert before is not None and len(before.commands) == commands
    # The four states of the next command, each with the state before it.
    pairs: list[tuple[sb.Sandbox, sb.Sandbox]] = []
    by_old: dict[int, Envelope] = {}  # the event that made each pair's new state
    state = before
    for envelope in last:
        after = sb.evolve(state, envelope)
        assert after is not None
        pairs.append((state, after))
        by_old[id(state)] = envelope
        state = after

    def each(step: Callable[[sb.Sandbox, sb.Sandbox], object]) -> Callable[[], None]:
        def run() -> None:
            for old, new in pairs:
                step(old, new)

        return run

    touched = {str(getattr(e.event, "command_id", "")) for e in last}
    now = time.time()
    steps: dict[str, Callable[[sb.Sandbox, sb.Sandbox], object]] = {
        "evolve": lambda old, _new: sb.evolve(old, by_old[id(old)]),
        "plan": lambda _old, new: plan(new, _host),
        "view": lambda _old, new: sandbox_view(new, now=now),
        "read model": lambda old, new: (changed_commands(old, new, touched), sandbox_row(new, 1)),
        "baseline": lambda _old, new: [c for c in new.commands.values() if not c.ended],
    }
    calls = max(3, 3000 // max(1, commands // 10))
    timed = {
        name: best_per_call(each(step), calls, rounds) / len(pairs) for name, step in steps.items()
    }
    whole, kept = kept_kib(before)
    # As decision 085 found it: compacted, but every request key held exactly.
    exact = msgspec.structs.replace(sb.compact(before), requests=before.requests, forgotten_keys=())
    return {
        **timed, "whole KiB": whole, "kept KiB": kept,
        "exact KiB": len(_ENCODER.encode(exact)) / 1024,
    }  # fmt: skip


def _save_events(save_id: str) -> list[ev.AnyEvent]:
    host = "local"
    return [
        ev.SaveRequested(save_id=save_id, kind="scheduled", host=host, generation=1),
        ev.SaveCaptured(
            save_id=save_id, host=host, generation=1, freeze_ms=1.0,
            freeze_method="freezer", changed_bytes=4096,
        ),
        ev.SaveUploaded(
            save_id=save_id, host=host, generation=1, total_bytes=1 << 20, files=100,
            uploaded_bytes=4096, uploaded_chunks=1, manifest_bytes=2048, duration_ms=5.0,
        ),
        ev.SaveCompleted(save_id=save_id, total_bytes=1 << 20, files=100),
    ]  # fmt: skip


def measure_saves(saves: int, rounds: int) -> dict[str, float]:
    """The same for a sandbox with `saves` scheduled saves behind it, all but the
    last five expired by retention (the saver's default `--keep-last`)."""
    sid = sandbox_id(saves, "saved")
    state = fold(sb.evolve, envelopes_for(sid, 4), None)
    assert state is not None
    t0 = time.time() - 30.0 * (saves + 1)

    def applied(state: sb.Sandbox, events: list[ev.AnyEvent], i: int) -> sb.Sandbox:
        for envelope in wrap(
            events, aggregate_id=sid, id_base=f"s{i}", actor="bench", causation_id="b",
            correlation_id="b", time=t0 + 30.0 * i,
        ):  # fmt: skip
            new = sb.evolve(state, envelope)
            assert new is not None
            state = new
        return state

    for i in range(saves):
        state = applied(state, _save_events(f"sv-{i}"), i)
        if i >= 5:
            state = applied(state, [ev.SavesExpired(save_ids=[f"sv-{i - 5}"])], i)
    assert len(state.saves) == saves
    envelopes = wrap(
        _save_events("sv-next"), aggregate_id=sid, id_base="next", actor="bench",
        causation_id="b", correlation_id="b", time=time.time(),
    )  # fmt: skip
    now = time.time() + 60.0
    requested = sb.evolve(state, envelopes[0])
    assert requested is not None

    def reacts() -> None:  # the saver, after each change of the sandbox
        save_work(requested)
        awaiting_verification(requested)
        expired(requested, keep_last=5)

    def tick() -> None:  # the saver's schedule, every tick
        due_save(state, now=now, cause="bench")
        timed_out(state, now=now, timeout_s=600.0)

    def written() -> None:  # the read model
        changed_saves(state, requested, [envelopes[0].event.save_id])  # type: ignore[union-attr]
        sandbox_row(requested, 1)

    steps: dict[str, Callable[[], object]] = {
        "evolve": lambda: [sb.evolve(state, e) for e in envelopes[:1]],
        "tick": tick,
        "reacts": reacts,
        "plan": lambda: plan(state, _host),
        "view": lambda: sandbox_view(state, now=now),
        "read model": written,
    }
    calls = max(3, 3000 // max(1, saves // 10))
    timed = {name: best_per_call(step, calls, rounds) for name, step in steps.items()}
    whole, kept = kept_kib(state)
    return {**timed, "whole KiB": whole, "kept KiB": kept}


def main() -> None:
    args = arguments(__doc__)
    rounds = 3 if args.quick else 7
    results = {n: measure(n, rounds) for n in SIZES}
    names = ["evolve", "plan", "view", "read model", "baseline"]
    rows = [
        [f"{n:,}", *(f"{results[n][name]:.1f}" for name in names),
         f"{sum(results[n][k] for k in names[:4]):.1f}",
         f"{results[n]['whole KiB']:,.1f}", f"{results[n]['kept KiB']:,.1f}",
         f"{results[n]['exact KiB']:,.1f}"]
        for n in SIZES
    ]  # fmt: skip
    small, large = results[SIZES[0]], results[SIZES[-1]]
    ours = [k for k in names if k != "baseline"]
    growth = sum(large[k] for k in ours) / sum(small[k] for k in ours)
    headers = [
        "commands in its history", "evolve µs/event", "plan", "view", "read model",
        "baseline: a pass over all", "sandhold total", "whole KiB", "kept KiB",
        "kept, every key exact",
    ]  # fmt: skip
    intro = __doc__.split("    uv run")[0].split("\n", 2)[2].strip()
    body = f"""
{intro}

{table(headers, rows)}

Goal: per event at {SIZES[-1]:,} commands within {GOAL_FLAT:.0f}× of that at {SIZES[0]}
→ {growth:.2f}× {verdict(growth <= GOAL_FLAT)}; a pass over every command grows
{large["baseline"] / small["baseline"]:.0f}× over the same range. The last three columns
are the state's size as a checkpoint stores it (msgpack): whole; as every service keeps it
(`sandbox.compact`: no ended command, decision 057; the newest
{2 * fingerprints.BLOCK - 1:,} request keys at most, older ones as 8-byte
fingerprints, decision 085); and as it was kept
before decision 085, every key exact. At {SIZES[-1]:,} commands a service keeps
{large["kept KiB"]:,.1f} KiB against {large["exact KiB"]:,.1f} with every key exact.
"""
    saved = {n: measure_saves(n, rounds) for n in SIZES}
    save_names = ["evolve", "tick", "reacts", "plan", "view", "read model"]
    save_rows = [
        [f"{n:,}", *(f"{saved[n][k]:.1f}" for k in save_names)] for n in SIZES
    ]  # fmt: skip
    timed_names = save_names
    save_growth = sum(saved[SIZES[-1]][k] for k in timed_names) / sum(
        saved[SIZES[0]][k] for k in timed_names
    )
    save_rows = [
        [*row, f"{saved[n]['whole KiB']:,.1f}", f"{saved[n]['kept KiB']:,.1f}"]
        for row, n in zip(save_rows, SIZES, strict=True)
    ]
    kept_growth = saved[SIZES[-1]]["kept KiB"] / saved[SIZES[0]]["kept KiB"]
    save_headers = ["saves in its history", "evolve µs/event", *save_names[1:]]
    save_headers += ["whole KiB", "kept KiB"]
    body += f"""
The same for a sandbox with that many scheduled saves behind it (all but the
last five expired by retention, as the saver's default keeps them), µs per
call: `evolve` of the next save's request; the saver's tick (`due_save` and
`timed_out`, every tick for every running sandbox); its reaction to a change
(`save_work`, `awaiting_verification`, `expired`); `plan`; `sandbox_view`; the
read model's write (`changed_saves` and the sandbox row); then the state's size
as a checkpoint stores it (msgpack), whole and as every service keeps it
(`sandbox.compact`: decision 068 drops the saves nothing names):

{table(save_headers, save_rows)}

Goal (the same): within {GOAL_FLAT:.0f}× from {SIZES[0]} to {SIZES[-1]:,} saves →
{save_growth:.2f}× {verdict(save_growth <= GOAL_FLAT)}. Decision 055 made the saves a
persistent map with indexes, as 053 did the commands; the read model's sandbox
row holds only the saves its view reads (`named_saves`: under way, completed,
Snapshots, the failure streak), each save having a row of its own. What a
service keeps grows {kept_growth:.2f}× over the same range (the whole state
{saved[SIZES[-1]]["whole KiB"] / saved[SIZES[0]]["whole KiB"]:.0f}×).
"""
    read_backs = {n: asyncio.run(measure_read_back(n, rounds)) for n in SIZES}
    back_rows = [
        [f"{n:,}", f"{read_backs[n]['read back']:.2f}", f"{read_backs[n]['every row']:.2f}",
         f"{read_backs[n]['kept KiB']:,.1f}", f"{read_backs[n]['whole KiB']:,.1f}"]
        for n in SIZES
    ]  # fmt: skip
    back_growth = read_backs[SIZES[-1]]["read back"] / read_backs[SIZES[0]]["read back"]
    from_middle = read_backs[SIZES[-1]]["read back"] / read_backs[SIZES[1]]["read back"]
    every_growth = read_backs[SIZES[-1]]["every row"] / read_backs[SIZES[0]]["every row"]
    body += f"""
The gateway's read model, holding that sandbox's rows in SQLite (its
commands, one row each, fed through `ReadModel.apply`): a read-back after a
cache miss (`_load`, ms, best of {rounds}: the sandbox's row and its unended
commands' rows, decision 072), next to reading every command row of the
sandbox and decoding it (what a read-back did before); then the state the
cache keeps (`kept_in_cache`) and the whole state, KiB as msgpack:

{
        table(
            [
                "commands in its history",
                "read-back ms",
                "baseline: every row ms",
                "cached KiB",
                "whole KiB",
            ],
            back_rows,
        )
    }

From {SIZES[0]} to {SIZES[-1]:,} commands a read-back grows {back_growth:.1f}× (from
{SIZES[1]:,}: {from_middle:.1f}×); reading every row grows {every_growth:.0f}×. (Not one of the
issue's goals: each size is a database of its own, and a small one is all in
SQLite's page cache.)
"""
    emit(args, "long_lived", "(o) One long-lived sandbox: cost per event", body)


async def measure_read_back(commands: int, rounds: int) -> dict[str, float]:
    """A read model holding a sandbox with `commands` ended commands (and one
    running): a read-back of it after a cache miss, against every row read."""
    sid = sandbox_id(commands, "rows")
    envelopes = envelopes_for(sid, 4 + 4 * commands + 2)  # the last one running
    triples = [
        (n, f"sh.ev.sandbox.{sid}", encode_envelope(e)) for n, e in enumerate(envelopes, start=1)
    ]
    with tempfile.TemporaryDirectory(prefix="sandhold-bench-rows-") as tmp:
        model = ReadModel(Path(tmp) / "rows.sqlite", Names("sh"))
        await model.open()
        try:
            for start in range(0, len(triples), 500):
                await model.apply(triples[start : start + 500])
            key = ("sandbox", sid)
            best, every = float("inf"), float("inf")
            for _ in range(rounds):
                model._cache.clear()  # noqa: SLF001 - a cache miss, as after a restart
                started = time.perf_counter()
                state, _ = await model._load(key)  # noqa: SLF001
                best = min(best, time.perf_counter() - started)
                started = time.perf_counter()
                rows = await model.query(
                    "SELECT id, record FROM commands WHERE sandbox_id = ? ORDER BY queued_at, id",
                    (sid,),
                )
                pmap.PMap((r[0], _COMMAND.decode(r[1])) for r in rows)
                every = min(every, time.perf_counter() - started)
        finally:
            await model.close()
    whole = fold(sb.evolve, envelopes, None)
    assert whole is not None and state is not None and len(state.commands) == 1
    return {
        "read back": best * 1000,
        "every row": every * 1000,
        "kept KiB": len(_ENCODER.encode(state)) / 1024,
        "whole KiB": len(_ENCODER.encode(whole)) / 1024,
    }


if __name__ == "__main__":
    main()
