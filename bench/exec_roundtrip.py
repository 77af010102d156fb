"""(c) `client.exec(sid, ["true"])` round trip through `sandhold up`, next to its floor.

Starts `sandhold up` (nats-server + scheduler + host-agent) in a temp data dir,
creates a sandbox, waits for running, then runs N sequential
`client.exec(sid, ["true"])` with the Python client: request → end state seen.
A second connection subscribes to the sandbox's event subject and stamps each
event's arrival, which splits the round trip into its steps. The floors, in the
same run: spawning `true` (subprocess.run and asyncio), and the bus alone (the
durable writes and the round trip one request needs, no services).

    uv run python bench/exec_roundtrip.py [--quick] [--write]
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgspec
import nats
from _common import (
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
    spawn_floor,
    table,
    temp_dir,
    timed_true,
    verdict,
)
from sandhold.bus.codec import decode_envelope
from sandhold.bus.names import Names
from sandhold.client import connect
from sandhold.domain import requests as rq
from sandhold.domain.work import AnyWork

work_decoder = msgspec.json.Decoder(AnyWork)

GOAL_P50_MS = 15.0
# A `true`'s events: queued (which dispatches it on a running sandbox, decision
# 098) and ended; its start goes unreported, as it ends within moments of it
# (decision 095). With the request and the work message, four fsync'd writes.
EXEC_APPENDS = 2
FLOOR_WRITES = EXEC_APPENDS + 2
GOAL_P99_MS = 50.0
WARMUP = 5

# Milestones of one exec, in order, as seen by the bench.
STEPS = [
    ("request_acked", "request stored (JetStream ack of the publish)"),
    ("command.queued", "`command.queued` seen (scheduler appended it; it dispatches, 098)"),
    ("reply", "scheduler's reply received by the client"),
    ("work", "work message seen on `sh.work.local` (scheduler published it)"),
    ("supervisor_took", "supervisor took the command (`started_at` in its exit.json)"),
    ("command.started", "`command.started` seen (none for a command ended at once, 095)"),
    ("supervisor_done", "supervisor recorded the exit (`ended_at`, then fsync)"),
    ("command.ended", "`command.ended` seen (host reported the exit)"),
    ("returned", "`client.exec` returned"),
]


async def measure(
    url: str, count: int, host_root: Path, *, watch_url: str
) -> tuple[list[float], dict[str, list[float]]]:
    names = Names("sh")
    client = await connect(url)
    # As the admin: the work subjects are the hosts' and the scheduler's alone.
    watcher = await nats.connect(watch_url, name="bench-exec-watcher")
    try:
        sandbox = await client.create_sandbox(key="bench-exec")
        await client.wait_for_phase(sandbox.id, {"running"}, timeout=60)
        stamps: dict[str, dict[str, float]] = {}

        async def on_event(msg) -> None:
            at = time.perf_counter()
            envelope = decode_envelope(msg.data)
            command_id = getattr(envelope.event, "command_id", None)
            if command_id is not None:
                stamps.setdefault(command_id, {}).setdefault(envelope.type, at)

        async def on_work(msg) -> None:
            at = time.perf_counter()
            work = work_decoder.decode(msg.data)
            command_id = getattr(work, "command_id", None)
            if command_id is not None:
                stamps.setdefault(command_id, {}).setdefault("work", at)

        await watcher.subscribe(names.events("sandbox", sandbox.id), cb=on_event)
        # A core subscription also sees what is published into the HOSTWORK stream.
        await watcher.subscribe(names.work("local"), cb=on_work)
        await watcher.flush()

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

        wall_offset = time.time() - time.perf_counter()
        totals: list[float] = []
        steps: dict[str, list[float]] = {name: [] for name, _ in STEPS}
        for i in range(WARMUP + count):
            key = f"bench-exec-{i}"
            command_id = rq.command_id_for(sandbox.id, key)
            current.clear()
            started = time.perf_counter()
            result = await client.exec(sandbox.id, ["true"], key=key, wait_timeout=30)
            current["returned"] = time.perf_counter()
            if result.command.state != "exited" or result.command.exit_code != 0:
                raise RuntimeError(f"exec {i}: {result.command!r}")
            if i < WARMUP:
                continue
            totals.append(current["returned"] - started)
            await asyncio.sleep(0.005)  # late event deliveries on the watcher
            seen = {**stamps.get(command_id, {}), **current}
            # The supervisor's own wall-clock times, read from the host's files.
            exit_file = host_root / "sandboxes" / sandbox.id / "commands" / command_id / "exit.json"
            record = msgspec.json.decode(exit_file.read_bytes())
            seen["supervisor_took"] = record["started_at"] - wall_offset
            seen["supervisor_done"] = record["ended_at"] - wall_offset
            for name, _ in STEPS:
                if name in seen:
                    steps[name].append(seen[name] - started)
        await client.delete_sandbox(sandbox.id)
        return totals, steps
    finally:
        await watcher.close()
        await client.close()


# (label, cgroups detected, private /tmp, pause between commands in s)
DRIVER_VARIANTS = [
    ("as the host-agent runs it (detected cgroups, private /tmp)", True, True, 0.3),
    ("without the private /tmp (`isolate_tmp=False`)", True, False, 0.3),
    ("without cgroups (`NoCgroups`)", False, True, 0.3),
    ("without both", False, False, 0.3),
    ("as the host-agent runs it, back to back (10 ms pause)", True, True, 0.01),
]


async def driver_split(root: Path, count: int) -> tuple[list[list[str]], list[dict[str, float]]]:
    """The host side alone: `ProcessDriver` in this process, no NATS, `true` run
    `count` times in sequence per variant; p50 ms of launch → started → exit.
    A 0.3 s pause is one command on an idle host; 10 ms runs them back to back.
    Each command's supervisor is given back as its end is reported, and runs
    the next one (decision 088): no refill once the pool is warm."""
    from sandhold.hostagent.driver import NoCgroups, ProcessDriver

    rows = []
    p50s: list[dict[str, float]] = []
    sid = "sb-00000000000be4c0"
    for n, (label, cgroups, isolate_tmp, pause) in enumerate(DRIVER_VARIANTS):
        driver = ProcessDriver(
            root / str(n),
            "bench-driver",
            isolate_tmp=isolate_tmp,
            cgroups=None if cgroups else NoCgroups("bench"),
        )
        await driver.start()
        try:
            await driver.create_sandbox(sid, None)
            phases: dict[str, list[float]] = {"launch": [], "started": [], "exit": [], "all": []}
            for i in range(WARMUP + count):
                launch, started, exit_ = await timed_true(driver, sid, f"cmd-{i:016x}")
                if i >= WARMUP:
                    for name, value in (
                        ("launch", launch),
                        ("started", started),
                        ("exit", exit_),
                        ("all", launch + started + exit_),
                    ):
                        phases[name].append(value)
                await asyncio.sleep(pause)
            caps = driver.capabilities()
            p50s.append({n: percentile(v, 50) for n, v in phases.items()})
            rows.append(
                [
                    label,
                    f"{caps['cgroup']}, tmp {caps['tmp_isolation']}",
                    *(ms(percentile(phases[n], 50)) for n in ("launch", "started", "exit", "all")),
                    ms(percentile(phases["all"], 99)),
                ]
            )
        finally:
            try:
                await driver.destroy_sandbox(sid)
                driver.cgroups.remove_host()
            finally:
                await driver.close()
    return rows, p50s


def supervisor_spawn_probe(root: Path, count: int = 10) -> tuple[list[float], list[float]]:
    """Seconds to start one warm supervisor (a refill of the pool, once none is
    idle): forked by the zygote, as the pool does it, and as a new Python
    process (where there is no zygote) that imports the supervisor module."""
    from sandhold.hostagent.driver.pool import Zygote, spawn_supervisor

    root.mkdir(parents=True, exist_ok=True)
    zygote = Zygote(root)
    try:
        runs: tuple[list[float], list[float]] = ([], [])
        for _ in range(count):
            for out, parent in zip(runs, (zygote, None), strict=True):
                started = time.perf_counter()
                supervisor = spawn_supervisor(root, parent)
                out.append(time.perf_counter() - started)
                supervisor.dismiss()  # EOF on its stdin: an idle supervisor exits by itself
                time.sleep(0.05)
        return runs
    finally:
        zygote.close()


def cgroup_attach_probe(root: Path, count: int = 20) -> list[list[str]] | None:
    """Moving a forked child into a command's cgroups, with the driver's detected
    backend, back to back and with a pause before each like between two execs:
    its pid written into each `cgroup.procs` (what the supervisor's child did
    before decision 052), and the child moving itself with `join_self` (what it
    does now: "0" into each `tasks` on v1). None without cgroups."""
    import os
    import signal
    import struct

    from sandhold.hostagent.driver import ProcessDriver
    from sandhold.hostagent.driver.cgroups import join_self

    driver = ProcessDriver(root, "bench-cgroup", isolate_tmp=False, warm=0)
    if driver.cgroups.kind == "none":
        return None
    sid = "sb-00000000000c6001"
    rows = []

    def by_pid(procs: list[str], child: int, report: int) -> float:
        started = time.perf_counter()
        for path in procs:
            with open(path, "w") as f:
                f.write(str(child))
        return time.perf_counter() - started

    def by_itself(procs: list[str], child: int, report: int) -> float:
        return struct.unpack("d", os.read(report, 8))[0]

    try:
        driver.cgroups.create_sandbox(sid, None)
        for how, move in (("pid → cgroup.procs", by_pid), ("`join_self` in the child", by_itself)):
            for label, pause in (("back to back", 0.0), ("50 ms pause before each", 0.05)):
                took = []
                for i in range(count):
                    name = f"cmd-{len(rows)}{pause * 1000:04.0f}{i:010x}"
                    cgroup = driver.cgroups.create_command(sid, name)
                    report_r, report_w = os.pipe()
                    child = os.fork()
                    if child == 0:  # pragma: no cover - the child moves itself or waits
                        if move is by_itself:
                            time.sleep(pause)
                            started = time.perf_counter()
                            join_self(cgroup.procs)
                            os.write(report_w, struct.pack("d", time.perf_counter() - started))
                        time.sleep(30)
                        os._exit(0)
                    os.close(report_w)
                    try:
                        if move is by_pid:
                            time.sleep(pause)
                        took.append(move(cgroup.procs, child, report_r))
                    finally:
                        os.close(report_r)
                        os.kill(child, signal.SIGKILL)
                        os.waitpid(child, 0)
                rows.append(
                    [
                        f"{how}, {driver.cgroups.kind}, {label}",
                        str(count),
                        str(len(cgroup.procs)),
                        ms(percentile(took, 50)),
                        ms(percentile(took, 90)),
                    ]
                )
    finally:
        driver.cgroups.kill_all(sid)
        driver.cgroups.remove(sid)
        driver.cgroups.remove_host()
    return rows


async def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    count = 50 if args.quick else 200
    disk, _ = fsync_probe()
    print(disk)
    spawn_sync, spawn_async = await spawn_floor(count)
    with temp_dir("driver") as root:
        driver_rows, driver_p50 = await driver_split(root, min(40, count // 2))
        attach_rows = cgroup_attach_probe(root / "cgroup-probe")
        spawn, spawn_cold = supervisor_spawn_probe(root / "spawn-probe")
    with sandhold_up("exec") as up:
        totals, steps = await measure(
            up.url, count, up.data_dir / "hosts" / "local", watch_url=up.admin_url
        )
    with nats_server("exec-floor") as server:
        floor = await bus_floor(server.admin_url, count, EXEC_APPENDS)
    p50, p99 = percentile(totals, 50) * 1000, percentile(totals, 99) * 1000
    latency = table(
        LATENCY_HEADERS,
        [
            latency_row("sandhold `client.exec(sid, ['true'])`", totals),
            latency_row("floor: `subprocess.run(['true'])`", spawn_sync),
            latency_row("floor: `asyncio.create_subprocess_exec('true')` + wait", spawn_async),
            latency_row(f"floor: bus only ({FLOOR_WRITES} fsync'd writes + 1 round trip)", floor),
        ],
    )
    rows = []
    previous = 0.0
    for name, label in STEPS:
        values = steps[name]
        if not values:
            rows.append([label, "0", "–", "–", "–"])
            continue
        at = median(values)
        rows.append(
            [label, str(len(values)), ms(at), ms(at - previous), ms(percentile(values, 99))]
        )
        previous = at
    breakdown = table(
        ["milestone (time since `exec` was called)", "n", "p50 ms", "step (Δ p50) ms", "p99 ms"],
        rows,
    )
    goal_ok = p50 <= GOAL_P50_MS and p99 <= GOAL_P99_MS
    idle, busy = driver_p50[0], driver_p50[-1]

    def at(name: str) -> float:
        return median(steps[name]) if steps[name] else float("nan")

    def delta(a: str, b: str) -> float:
        return at(b) - at(a)

    attach_gap = (
        f"a pid written into `cgroup.procs`: {attach_rows[1][3]} ms p50 after a 50 ms "
        f"pause vs {attach_rows[0][3]} ms back to back; the child moving itself as it "
        f"does now: {attach_rows[3][3]} ms after a pause"
        if attach_rows
        else "no cgroups here"
    )
    cg_cost = driver_p50[0]["started"] - driver_p50[2]["started"]
    attach = (
        "A forked child moved into a command's cgroups, alone (all of its cgroup "
        "files; the global lock and its RCU wait come with the first): by its pid "
        'written into `cgroup.procs`, and by itself writing "0" into `tasks`, as '
        "`join_self` and the launcher do it (decisions 052, 084):\n\n"
        + table(
            ["how, backend, when", "moves", "files each", "p50 ms", "p90 ms"],
            attach_rows,
        )
        if attach_rows
        else "No writable cgroup hierarchy here: no attach probe."
    )
    floor_sum = percentile(floor, 50) + percentile(spawn_async, 50)
    body = f"""
{count} sequential `client.exec(sid, ["true"])` on one running sandbox (after
{WARMUP} warm-up execs), Python client against `sandhold up` (one scheduler, one
host-agent, nats-server with `sync_interval: always`), all on this machine. The
floors are measured in the same run: spawning `true` before `sandhold up` starts,
the bus alone on a fresh server after it stopped. {disk}.

{
        table(
            ["", "value"],
            [
                ["p50 / p99 (ms)", f"{p50:.1f} / {p99:.1f}"],
                ["goal", f"p50 ≤ {GOAL_P50_MS:.0f} ms, p99 ≤ {GOAL_P99_MS:.0f} ms"],
                ["verdict", verdict(goal_ok)],
                [
                    "vs floor (bus + asyncio spawn, p50)",
                    f"{p50:.1f} ms vs {floor_sum * 1000:.1f} ms = {p50 / (floor_sum * 1000):.1f}×",
                ],
            ],
        )
    }

{latency}

Where one exec's time goes (stamped by a second connection subscribed to
`sh.ev.sandbox.<id>`; the client's own request ack and reply stamped by wrapping
its `js.publish` and `send`; the supervisor's times read from the command's
`exit.json` in the host's data dir, wall clock mapped onto the bench's clock):

{breakdown}

The host side alone — `ProcessDriver` driven in this process (no NATS, no
services), {min(40, count // 2)} sequential `true` per row, p50 ms of `launch()` (cgroup
dirs, spec file, hand-over to a warm supervisor), then until `started()` (the
supervisor starts the command — in a box through the launcher, which joins the
command's cgroups, the box's namespaces and ids and execs it (decision 084); on
the host with a `preexec_fn` that joins the cgroups and sets up the private /tmp —
then writes the pid file and rings), then until `wait()` returns (exit record written
with two fsyncs). Rows with a 0.3 s pause are one command on an idle host; the
last row runs them back to back. Each command is run by the supervisor the one
before gave back as its end was reported (decision 088), so no row forks one:

{
        table(
            ["driver", "backend", "launch", "→ started", "→ exit", "total p50", "total p99"],
            driver_rows,
        )
    }

{attach}

Starting one warm supervisor (a refill, once no supervisor is idle) takes
{ms(percentile(spawn, 50))} ms p50, {ms(max(spawn))} ms max, forked by the zygote as the
pool does; {ms(percentile(spawn_cold, 50))} ms p50 as a new Python process where
there is no zygote ({len(spawn)} starts of each, with no sandhold service running).

Reading: the path is request → scheduler (pull fetch, decide, append
`command.queued`, which dispatches the command to the running sandbox's host
(decision 098), reply, ack) → scheduler's reconciler (its pass that the
queuing set off publishes the work) → host-agent (pull fetch,
launch via a warm supervisor; its watcher sees the exit within moments of the start,
so no `command.started` is appended (decision 095), and appends
`command.ended` with the pid) → client: {FLOOR_WRITES} fsync'd writes in sequence,
three Python processes and nats-server on {nproc()} cores. The bus part is near
its floor: the work message is out {ms(at("work"))} ms after the call,
against a bus-only floor of {ms(percentile(floor, 50))} ms for all {FLOOR_WRITES}
writes. The host side takes the rest (p50 deltas): work → supervisor has the command
{ms(delta("work", "supervisor_took"))} ms (the agent's pull fetch and `_current`,
then `driver.launch`: cgroup dirs, spec file, and handing the command to the idle
supervisor the command before gave back); supervisor took it → exit recorded
{ms(delta("supervisor_took", "supervisor_done"))} ms (the launcher's fork and exec,
cgroup attach, namespaces, pid file, doorbell; `true`; the exit seen); exit
recorded → `command.ended` seen {ms(delta("supervisor_done", "command.ended"))} ms
(the record is renamed into place and the doorbell rung before its fsyncs,
decision 094; the agent's watcher reads it and appends). The
driver tables say where the host side goes: on an idle host the driver alone
needs {ms(idle["all"])} ms for `true`, {ms(cg_cost)} ms of it the cgroup attach (with vs
without cgroups); the first move into a cgroup after a pause can be slow on this
kernel ({attach_gap}); back to back it needs {ms(busy["all"])} ms. A supervisor serves
the next command once its own ended (decision 088): one exec after another
forks none, where each used to cost a new one ({ms(percentile(spawn, 50))} ms through the
zygote, on the same cores, and ~10 ms of CPU in all with its copy-on-write faults
and its exit).
"""
    emit(args, "exec_roundtrip", "(c) exec round trip", body)


if __name__ == "__main__":
    asyncio.run(main())
