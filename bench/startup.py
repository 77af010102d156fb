"""(k) A store's start-up at 100k, 1M (and 10M) events in the log: from zero and from a checkpoint.

For each log size N and each shape: N sandbox events (sandboxes × 100:
created, placed, starting, started, then commands queued, dispatched, started,
ended), written with the fenced `append` through a server without per-write
fsync (`BulkLoadServer`, set-up only), then read through one with
`sync_interval: always` started on the same store. Shapes: "all live" (every sandbox
still there: 10× the sandboxes for 10× the log) and "churn" (the last 1,000
sandboxes live, every one before them deleted: an installation that has run
for a while, whose log grows with what it did, not with what exists). Then,
on fresh connections:
  from zero:       `AggregateStore.start()` without a checkpoint: what every
                   service start cost before decision 039 (up to --zero-max
                   events; above it, the fold is estimated from the rate below);
  checkpoint:      the same store with a checkpoint directory folds it all once,
                   writes its checkpoint (time and size reported), then 1,000 more
                   events are appended (a crash's ~30 s of them) and a new store
                   starts from the checkpoint: load, verify against the log, fold
                   the 1,000;
  floor:           reading the checkpoint file's bytes (the disk, no decode);
  metrics fold:    the metrics service's `LogMetrics` from zero, then from its
                   own checkpoint with the same 1,000 events after it.
Above --zero-max the checkpoint is written by folding the same envelopes in
this process (pure `evolve`, what the store would hold) instead of through
NATS, so a 10M run takes minutes rather than an hour.

    uv run python bench/startup.py [--quick] [--write] [--sizes 100000,1000000,10000000]
"""

from __future__ import annotations

import asyncio
import gc
import os
import tempfile
import time
from pathlib import Path

import nats
from _common import (
    BulkLoadServer,
    append_histories,
    arguments,
    emit,
    envelopes_for,
    median,
    rate,
    running,
    sandbox_id,
    table,
    temp_dir,
    verdict,
)
from sandhold.bus import checkpoint
from sandhold.bus.checkpoint import (
    Checkpoint,
    Checkpoints,
    compaction_name,
    fold_version,
    path_for,
)
from sandhold.bus.names import Names
from sandhold.bus.server import NatsServer
from sandhold.bus.store import AggregateStore
from sandhold.bus.streams import ensure_streams
from sandhold.domain import sandbox as sb
from sandhold.domain.fold import fold
from sandhold.metrics.service import MetricsService, follow_log

PER_SANDBOX = 100
LIVE = 1000  # the churned log's sandboxes that still exist
SHAPES = ("churn", "all live")
AFTER = 1000  # events appended after the checkpoint: about 30 s of a busy log
GOAL_FLAT = 2.0  # from the smallest log to the largest, start-up within 2×
GOAL_S = 2.0  # and under 2 s at the largest
NAMES = Names("startup")


def deleted_ones(shape: str, sandboxes: int, tag: str) -> frozenset[str]:
    if shape == "all live":
        return frozenset()
    return frozenset(sandbox_id(i, tag) for i in range(max(0, sandboxes - LIVE)))


async def write_events(
    url: str, sandboxes: range, tag: str, per_sandbox: int, deleted: frozenset[str] = frozenset()
) -> tuple[int, str]:
    """Append each sandbox's history (fenced, 1,000 appends in flight); the
    stream's last sequence and that message's envelope id."""
    nc = await nats.connect(url, name="bench-startup-writer")
    try:
        js = nc.jetstream()
        await ensure_streams(js, NAMES)
        ids = [sandbox_id(i, tag) for i in sandboxes]
        return await append_histories(js, NAMES, ids, per_sandbox, deleted=deleted.__contains__)
    finally:
        await nc.close()


async def start_store(
    url: str, directory: Path | None, *, compact: bool = True
) -> tuple[float, AggregateStore, nats.NATS]:
    """A store as the scheduler runs it (compacted, decision 057; deleted
    sandboxes nothing is left of forgotten, decision 061), or keeping every
    state whole (`compact=False`, as every store did before both)."""
    nc = await nats.connect(url, name="bench-startup-store")
    store: AggregateStore[sb.Sandbox] = AggregateStore(
        nc.jetstream(),
        NAMES,
        "sandbox",
        sb.evolve,
        actor="bench",
        checkpoint_dir=directory,
        compact=sb.compact if compact else None,
        forget=sb.forgettable if compact else None,
    )
    started = time.perf_counter()
    await store.start(timeout=3600)
    return time.perf_counter() - started, store, nc


async def close(store: AggregateStore, nc: nats.NATS, *, keep_checkpoint: bool = False) -> None:
    if not keep_checkpoint:
        store._checkpoints = None  # noqa: SLF001 - its stop must not write one
    await store.stop()
    await nc.close()


def checkpoints_in_process(
    directories: dict[bool, Path],
    sandboxes: int,
    tag: str,
    last: tuple[int, str],
    *,
    deleted: frozenset[str] = frozenset(),
) -> float:
    """The checkpoints a store would write after folding these sandboxes,
    compacted (`directories[True]`) and kept whole (`directories[False]`),
    folded here once (pure evolve; compacting the fold is compacting after
    every event, a property tested in tests/domain/test_compaction.py): for
    logs too long to fold through NATS in a bench run. The compacted one's
    write time."""
    states: dict[bool, dict[str, sb.Sandbox | None]] = {True: {}, False: {}}
    for i in range(sandboxes):
        sid = sandbox_id(i, tag)
        state = fold(sb.evolve, envelopes_for(sid, PER_SANDBOX, deleted=sid in deleted), None)
        if False in directories:
            states[False][sid] = state
        if state is not None:
            state = sb.compact(state)
            if sb.forgettable(state):
                continue
        states[True][sid] = state
    written = 0.0
    for compact, directory in directories.items():
        checkpoint = Checkpoint(
            version=fold_version(),
            stream=NAMES.events_stream,
            kind="sandbox",
            position=last[0],
            last_event_seq=last[0],
            last_event_id=last[1],
            states=states[compact],
            # the store only compares them with later sequences
            seqs=dict.fromkeys(states[compact], last[0]),
            traces={},
            compaction=compaction_name(sb.compact if compact else None),
        )
        started = time.perf_counter()
        Checkpoints(path_for(directory, "sandbox"), sb.Sandbox | None).write(checkpoint)
        if compact:
            written = time.perf_counter() - started
        del checkpoint
    return written


async def metrics_start(url: str, directory: Path) -> tuple[float, MetricsService]:
    """The metrics service's fold as it starts (decision 062): from its checkpoint
    in `directory` when there is a good one, else from zero; the time to have
    folded what the log holds."""
    os.environ[checkpoint.ENV] = str(directory)
    service = MetricsService(url, NAMES)
    nc = await nats.connect(url, name="bench-startup-metrics")
    try:
        started = time.perf_counter()
        await service._load(nc.jetstream(), directory / "metrics.checkpoint")  # noqa: SLF001
        follower = await follow_log(nc.jetstream(), NAMES, service.folded, timeout=3600)
        elapsed = time.perf_counter() - started
        await follower.stop()
    finally:
        await nc.close()
    return elapsed, service


async def measure_on_fresh_log(
    size: int, zero_max: int, rounds: int, shape: str
) -> dict[str, object]:
    """The log written through a `BulkLoadServer`, measured on a server with
    `sync_interval: always` started on the same store."""
    sandboxes = size // PER_SANDBOX
    tag = f"s{size}"
    deleted = deleted_ones(shape, sandboxes, tag)
    with temp_dir("startup") as data:
        started = time.perf_counter()
        with running(BulkLoadServer(data / "nats"), stop_timeout=600) as loader:
            last = await write_events(loader.admin_url, range(sandboxes), tag, PER_SANDBOX, deleted)
        print(
            f"{size:,} ({shape}): wrote {last[0]:,} events in {time.perf_counter() - started:.0f}s",
            flush=True,
        )
        with running(NatsServer(data / "nats")) as server:
            return await measure(server.admin_url, size, last, zero_max, rounds, shape)


async def stream_last_seq(url: str) -> int:
    nc = await nats.connect(url, name="bench-startup-check")
    try:
        info = await nc.jetstream().stream_info(NAMES.events_stream)
        return int(info.state.last_seq)
    finally:
        await nc.close()


async def measure(
    url: str, size: int, last: tuple[int, str], zero_max: int, rounds: int, shape: str
) -> dict[str, object]:
    sandboxes = size // PER_SANDBOX
    tag = f"s{size}"
    deleted = deleted_ones(shape, sandboxes, tag)
    live = sandboxes - len(deleted)
    if await stream_last_seq(url) != last[0]:
        raise RuntimeError("the log written by the bulk loader is not the log read back")
    result: dict[str, object] = {"size": size, "shape": shape, "live": live, "written": last[0]}
    with tempfile.TemporaryDirectory(prefix="sandhold-bench-startup-") as tmp:
        directory = Path(tmp)
        whole_directory = directory / "whole"  # the same, kept whole (before decision 057)
        if size <= zero_max:
            zero, store, nc = await start_store(url, directory)
            result["zero"] = zero
            written = time.perf_counter()
            await store.checkpoint()
            result["write"] = time.perf_counter() - written
            await close(store, nc)
            print(f"{size:,}: from zero {zero:.1f}s", flush=True)
            result["metrics_zero"], service = await metrics_start(url, directory)
            await service.checkpoint()
            wanted = {False: whole_directory}
        else:
            wanted = {True: directory, False: whole_directory}
        written = checkpoints_in_process(wanted, sandboxes, tag, last, deleted=deleted)
        result.setdefault("write", written)
        result["bytes"] = path_for(directory, "sandbox").stat().st_size
        result["whole_bytes"] = path_for(whole_directory, "sandbox").stat().st_size
        # A crash's worth of events after the checkpoint (10 sandboxes × 100).
        await write_events(
            url, range(sandboxes, sandboxes + AFTER // PER_SANDBOX), tag, PER_SANDBOX
        )
        times, whole_times, folded = [], [], 0
        for _ in range(rounds):
            for compact, into in ((True, times), (False, whole_times)):
                gc.collect()
                elapsed, store, nc = await start_store(
                    url, directory if compact else whole_directory, compact=compact
                )
                into.append(elapsed)
                if store.folded != AFTER:
                    raise RuntimeError(f"folded {store.folded} events at start, not {AFTER}")
                folded = store.folded
                held = (live if compact else sandboxes) + AFTER // PER_SANDBOX
                if len(store.ids()) != held:
                    raise RuntimeError(f"started with {len(store.ids())} sandboxes, not {held}")
                await close(store, nc)
                del store
        if size <= zero_max:
            metrics_times = []
            for _ in range(rounds):
                elapsed, service = await metrics_start(url, directory)
                if service.from_checkpoint == 0:
                    raise RuntimeError("the metrics fold did not start from its checkpoint")
                metrics_times.append(elapsed)
            result["metrics"] = median(metrics_times)
        result["checkpoint"] = median(times)
        result["whole"] = median(whole_times)
        result["runs"] = times
        result["folded"] = folded
        floor = time.perf_counter()
        path_for(directory, "sandbox").read_bytes()
        result["floor"] = time.perf_counter() - floor
    print(f"{size:,} ({shape}): from the checkpoint {result['checkpoint']:.2f}s", flush=True)
    return result


async def main() -> None:
    args = arguments(
        __doc__.splitlines()[0],
        extra=lambda p: (
            p.add_argument("--sizes", default="", help="log sizes, comma separated"),
            p.add_argument("--zero-max", type=int, default=1_000_000),
            p.add_argument(
                "--shapes",
                default=",".join(SHAPES),
                help=f"comma separated, of: {', '.join(SHAPES)} (the goal is the churned log's)",
            ),
        ),
    )
    default = "20000,100000" if args.quick else "100000,1000000"
    sizes = [int(s) for s in (args.sizes or default).split(",")]
    rounds = 1 if args.quick else 3
    results = []
    shapes = [s for s in SHAPES if s in args.shapes.split(",")]
    if "churn" not in shapes:
        raise SystemExit("--shapes must include churn: the goal is judged on it")
    for shape in shapes:
        for size in sizes:  # each size and shape on a log of its own
            results.append(await measure_on_fresh_log(size, args.zero_max, rounds, shape))
    rows = []
    for r in results:
        zero = r.get("zero")
        rows.append(
            [
                str(r["shape"]),
                f"{r['live']:,}",
                f"{r['written']:,}",
                f"{zero:.1f}" if isinstance(zero, float) else "not run",
                f"{rate(r['written'] / zero)}/s" if isinstance(zero, float) else "",
                f"{r['checkpoint']:.2f}",
                " / ".join(f"{t:.2f}" for t in r["runs"]),  # type: ignore[attr-defined]
                f"{r['folded']:,}",
                f"{r['bytes'] / 1e6:.1f}",
                f"{r['whole']:.2f}",
                f"{r['whole_bytes'] / 1e6:.1f}",
                f"{r['write']:.2f}",
                f"{r['floor'] * 1000:.0f}",
                f"{r['metrics_zero']:.1f}" if "metrics_zero" in r else "not run",
                f"{r['metrics']:.2f}" if "metrics" in r else "not run",
            ]
        )
    churn = [r for r in results if r["shape"] == "churn"]
    first, last = churn[0], churn[-1]
    flat = last["checkpoint"] / first["checkpoint"]
    fast = last["checkpoint"] <= GOAL_S
    live = [r for r in results if r["shape"] == "all live"]
    live_note = ""
    if live:
        live_flat = live[-1]["checkpoint"] / live[0]["checkpoint"]
        live_note = (
            f"The log whose sandboxes all exist ({live[0]['live']:,} → {live[-1]['live']:,}): "
            f"{live_flat:.1f}×\nfrom the smallest to the largest (a start grows with the "
            "sandboxes that exist; memory per\nsandbox is bench j's)."
        )
    body = f"""
Per log size, a fresh `nats-server`: the sandbox events written with the
fenced `append` ({PER_SANDBOX} per sandbox) through a server without
`sync_interval: always` (set-up only: fsync'd one by one, ten million take an
hour here), then that server stopped and one with `sync_interval: always`
started on the same store for everything measured: the store's start
without a checkpoint (from zero), and from a checkpoint with
{AFTER:,} events appended after it, {rounds} start(s), median. Floor = reading
the checkpoint file's bytes. A log above {args.zero_max:,} events is not folded
from zero here (it would take as long again as the write): its checkpoint is
folded in this process from the same envelopes.

{
        table(
            [
                "shape",
                "sandboxes that exist",
                "events in the log",
                "start from zero (s)",
                "fold rate",
                "start from checkpoint (s, median)",
                "runs (s)",
                "events folded at start",
                "checkpoint MB",
                "kept whole: start (s)",
                "kept whole: MB",
                "checkpoint write (s)",
                "floor: read the file (ms)",
                "metrics fold: from zero (s)",
                "metrics fold: from its checkpoint (s)",
            ],
            rows,
        )
    }

Goal: flat (within {GOAL_FLAT}× from {first["size"]:,} to {last["size"]:,} events, the churned
log: {LIVE:,} sandboxes exist at every size) → {flat:.1f}× {verdict(flat <= GOAL_FLAT)}; under
{GOAL_S:.0f} s at {last["size"]:,} → {last["checkpoint"]:.2f} s {verdict(fast)}.
{live_note}

The store is compacted as the scheduler, the saver and recovery run theirs
(decision 057: ended commands dropped, their request keys kept; decision 061:
a deleted sandbox nothing is left of forgotten); "kept whole" is the same
start from a checkpoint of whole states (every ended command, every deleted
sandbox), as every store kept them before, in the same run.

The metrics service's fold (its own checkpoint, decision 062) is started the
same way: from zero after the write, then from its checkpoint with the
{AFTER:,} events after it ({rounds} start(s), median; not run above
{args.zero_max:,} events).

Reading: a start from a checkpoint costs decoding the checkpoint (which grows
with the number of sandboxes that exist and what each keeps, not with the
events that made them, nor with the sandboxes deleted) plus the events after
it; from zero it grows with the whole log.
"""
    emit(args, "startup", "(k) Start-up: from zero and from a checkpoint", body)


if __name__ == "__main__":
    asyncio.run(main())
