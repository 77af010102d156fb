"""(a) Conditional appends vs plain concurrent publishes.

sandhold: `sandhold.bus.append.append` (expected last subject sequence +
Nats-Msg-Id + type header) of real envelopes across 1,000 sandbox subjects,
each subject written in order by its own writer, at most 256 appends in flight.
Baseline: plain `js.publish(subject, payload)` of the same encoded envelopes to
the same subjects with the same writers and the same concurrency.
A middle row, raw `js.publish` with the same headers `append` sends, splits the
server's fence/de-duplication cost from the Python cost of the wrapper.

Then the latency of one decision of 1-3 events, one after another: `append`'s
fenced appends in sequence (one write and fsync each) against the same events
as one JetStream atomic batch (`Nats-Batch-Id`/`-Sequence`/`-Commit`, nats-server
>= 2.12, a stream with `allow_atomic`; nats-py has no API for it), both on such
a stream.

    uv run python bench/append.py [--quick] [--write]
"""

from __future__ import annotations

import asyncio
import itertools
import time

import msgspec
import nats
from _common import (
    CpuMeter,
    arguments,
    emit,
    encoded_size,
    envelopes_for,
    fsync_probe,
    median,
    nats_server,
    nproc,
    percentile,
    rate,
    sandbox_id,
    table,
    verdict,
)
from nats.js.api import Header, StorageType, StreamConfig
from sandhold.bus.append import append
from sandhold.bus.codec import TYPE_HEADER, encode_envelope
from sandhold.bus.names import Names
from sandhold.bus.streams import ensure_streams

GOAL = 0.7
SUBJECTS = 1000
CONCURRENCY = 256
VARIANTS = ["plain", "headers", "sandhold"]
LABELS = {
    "plain": "baseline: plain `js.publish`",
    "headers": "raw `js.publish` + the same headers",
    "sandhold": "sandhold `append` (fenced)",
}

Plan = list[tuple[str, list]]


async def one_run(
    url: str, server_pid: int | None, variant: str, run: int, plan: Plan
) -> tuple[float, float, float]:
    """Write the whole plan once into a fresh stream: msgs/s, client CPU %, server CPU %."""
    names = Names(f"ba{run}{variant[:2]}")
    nc = await nats.connect(url, name=f"bench-append-{variant}")
    try:
        js = nc.jetstream()
        await ensure_streams(js, names)
        stream = names.events_stream
        sem = asyncio.Semaphore(CONCURRENCY)
        payloads = {e.id: encode_envelope(e) for _, envs in plan for e in envs}

        async def writer(sid: str, envelopes: list) -> None:
            subject = names.events("sandbox", sid)
            expected = 0
            for envelope in envelopes:
                async with sem:
                    if variant == "sandhold":
                        expected = (await append(js, stream, subject, [envelope], expected))[0]
                    elif variant == "headers":
                        headers = {
                            Header.MSG_ID: envelope.id,
                            Header.EXPECTED_LAST_SUBJECT_SEQUENCE: str(expected),
                            TYPE_HEADER: envelope.type,
                        }
                        ack = await js.publish(
                            subject, encode_envelope(envelope), stream=stream, headers=headers
                        )
                        expected = ack.seq
                    else:
                        await js.publish(subject, payloads[envelope.id])

        started = time.perf_counter()
        with CpuMeter(server_pid) as cpu:
            await asyncio.gather(*(writer(sid, envs) for sid, envs in plan))
        elapsed = time.perf_counter() - started
        info = await js.stream_info(stream)
        if info.state.messages != len(payloads):
            raise RuntimeError(f"{variant}: {info.state.messages} stored, {len(payloads)} sent")
        await js.delete_stream(stream)
        return len(payloads) / elapsed, cpu.client, cpu.others[0]
    finally:
        await nc.close()


async def decision_latency(url: str, samples: int) -> list[list[str]]:
    """p50/p90 ms of one decision of k events: k fenced appends in sequence vs
    one atomic batch carrying the same headers (the fence on its first message)."""
    nc = await nats.connect(url, name="bench-append-decision")
    try:
        js = nc.jetstream()
        stream = "DECIDE"
        await js.add_stream(
            StreamConfig(
                name=stream,
                subjects=["decide.>"],
                storage=StorageType.FILE,
                allow_atomic=True,
                allow_direct=True,
                duplicate_window=120.0,
            )
        )
        try:
            subjects = (f"decide.sandbox.{i}" for i in itertools.count())
            # queued, dispatched, started
            envelopes = envelopes_for(sandbox_id(0, "decide"), 8)[4:7]

            async def in_sequence(k: int) -> None:
                # Ids of their own: the stream would take a repeated id for a retry.
                subject = next(subjects)
                fresh = [msgspec.structs.replace(e, id=f"{e.id}:{subject}") for e in envelopes[:k]]
                await append(js, stream, subject, fresh, 0)

            async def as_batch(k: int) -> None:
                subject, batch = next(subjects), f"b{time.perf_counter_ns()}"
                for n, envelope in enumerate(envelopes[:k], start=1):
                    headers = {
                        "Nats-Batch-Id": batch,
                        "Nats-Batch-Sequence": str(n),
                        Header.MSG_ID: f"{envelope.id}:{batch}",
                        TYPE_HEADER: envelope.type,
                    }
                    if n == 1:
                        headers[Header.EXPECTED_LAST_SUBJECT_SEQUENCE] = "0"
                    if n < k:
                        await nc.publish(subject, encode_envelope(envelope), headers=headers)
                        continue
                    headers["Nats-Batch-Commit"] = "1"
                    ack = await nc.request(subject, encode_envelope(envelope), headers=headers)
                    if b'"error"' in ack.data:
                        raise RuntimeError(f"batch refused: {ack.data!r}")

            rows = []
            for k in (1, 2, 3):
                times: dict[str, list[float]] = {"seq": [], "batch": []}
                for i in range(samples):
                    # Alternated, so neither gets the quieter moments.
                    for name, run in sorted(
                        (("seq", in_sequence), ("batch", as_batch)), reverse=bool(i % 2)
                    ):
                        started = time.perf_counter()
                        await run(k)
                        times[name].append((time.perf_counter() - started) * 1000)
                rows.append(
                    [
                        str(k),
                        f"{median(times['seq']):.2f} / {percentile(times['seq'], 90):.2f}",
                        f"{median(times['batch']):.2f} / {percentile(times['batch'], 90):.2f}",
                    ]
                )
            return rows
        finally:
            await js.delete_stream(stream)
    finally:
        await nc.close()


async def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    per_subject = 5 if args.quick else 10
    rounds = 1 if args.quick else 7
    plan = [
        (sid, envelopes_for(sid, per_subject))
        for sid in (sandbox_id(i, "append") for i in range(SUBJECTS))
    ]
    total = SUBJECTS * per_subject
    size = encoded_size([e for _, envs in plan for e in envs])
    disk, fsync_ms = fsync_probe()
    print(disk)
    results: dict[str, list[float]] = {v: [] for v in VARIANTS}
    cpus: dict[str, list[tuple[float, float]]] = {v: [] for v in VARIANTS}
    with nats_server("append") as server:
        warm = [(sid, envs[:2]) for sid, envs in plan[:200]]  # not counted
        for variant in VARIANTS:
            await one_run(server.admin_url, server.pid, variant, 99, warm)
        decisions = await decision_latency(server.admin_url, 100 if args.quick else 300)
        for run in range(rounds):
            # Rotate the order each round so no variant always runs first or last.
            order = VARIANTS[run % 3 :] + VARIANTS[: run % 3]
            for variant in order:
                value, client, srv = await one_run(server.admin_url, server.pid, variant, run, plan)
                results[variant].append(value)
                cpus[variant].append((client, srv))
                print(
                    f"round {run + 1}/{rounds} {variant:9s} {rate(value)} msgs/s "
                    f"(client CPU {client:.0f}%, server CPU {srv:.0f}%)",
                    flush=True,
                )
    paired = {
        v: [a / b for a, b in zip(results[v], results["plain"], strict=True)] for v in VARIANTS
    }
    rows = []
    for variant in VARIANTS:
        rows.append(
            [
                LABELS[variant],
                rate(median(results[variant])),
                f"{median(paired[variant]):.2f}×",
                f"{min(paired[variant]):.2f}–{max(paired[variant]):.2f}",
                " / ".join(rate(v) for v in results[variant]),
                f"{median([c for c, _ in cpus[variant]]):.0f}%",
                f"{median([s for _, s in cpus[variant]]):.0f}%",
            ]
        )
    ratio = median(paired["sandhold"])
    headers_ratio = median(paired["headers"])
    plain_rate = median(results["plain"])
    busiest = max(
        max(median([c for c, _ in cpus[v]]), median([x for _, x in cpus[v]])) for v in VARIANTS
    )
    cpu_note = (
        "neither process is CPU-bound (CPU columns)."
        if busiest < 80
        else f"one process is near a full core ({busiest:.0f}%): CPU is part of the limit."
    )
    grouping = (
        "about one fsync per message (no group commit)"
        if 1000 / plain_rate >= 0.7 * fsync_ms
        else "the server groups several messages per fsync"
    )
    body = f"""
{total:,} appends per run ({SUBJECTS:,} sandbox subjects × {per_subject} events,
envelopes of ~{size:.0f} B from `wrap`: created, placed, starting, started, then
commands queued, dispatched, started, ended), each subject written in order by its
own writer, {CONCURRENCY} appends in flight (`asyncio.gather` + semaphore), one
connection, a fresh stream per run. {rounds} round(s), the variants' order rotated
each round; "vs baseline" is the median of the per-round ratios to the baseline
run of the same round. {disk}.

{
        table(
            [
                "variant",
                "msgs/s (median)",
                "vs baseline",
                "ratio range",
                "runs (msgs/s)",
                "client CPU",
                "server CPU",
            ],
            rows,
        )
    }

CPU is % of one core over the run (client = this Python process, server =
nats-server), from `/proc`; the machine has {nproc()} cores.

Goal: sandhold ≥ {GOAL}× the baseline's msgs/s → {ratio:.2f}× {verdict(ratio >= GOAL)}

Reading: {cpu_note} With
`sync_interval: always` the server writes and fsyncs each message before it
acknowledges it: {1000 / plain_rate:.2f} ms per message at the baseline's rate against
a {fsync_ms:.2f} ms fsync (p50, probe above) — {grouping} with {CONCURRENCY} in
flight, so all variants are bounded by the disk, and the spread between runs of
one variant (runs column) is the disk's. The headers alone —
expected last subject sequence and `Nats-Msg-Id`, so the server checks the
subject's last sequence and records a de-duplication entry — give
{headers_ratio:.2f}× of the plain rate; sandhold's wrapper (envelope encoding, a
header dict per call, the returned list) is {ratio / headers_ratio:.2f}× of that
raw-headers row. There are no conflicts here (one writer per subject), so the
10071 path (one extra direct get) is not timed.

One decision's events, written one after another ({100 if args.quick else 300}
decisions of each size, alternating; ms p50 / p90, from the first publish to the
last ack), each decision on a subject of its own:

{table(["events in the decision", "fenced appends in sequence", "one atomic batch"], decisions)}

Whether a decision of several events should go as one write (issue 15): not on
this server. An atomic batch is held by the server until its commit and then
stored; its fixed cost is several fsync'd appends' worth, so every decision
here (at most three events) is quicker as appends in sequence.
"""
    emit(args, "append", "(a) Conditional appends vs plain publishes", body)


if __name__ == "__main__":
    asyncio.run(main())
