"""Shared pieces of the benchmarks: a server, the machine, tables, the doc writer.

Every benchmark starts what it measures against itself, on 127.0.0.1 only, and
stops every process it started by PID, also on error or SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import importlib.metadata
import os
import platform
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
from nats.js import JetStreamContext
from sandhold.bus.append import append
from sandhold.bus.names import Names
from sandhold.bus.server import NatsServer, nats_server_binary
from sandhold.domain import events as ev
from sandhold.domain import requests as rq
from sandhold.domain.envelope import Envelope, wrap

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"

# Sections of docs/benchmarks.md, in the order they appear.
SECTIONS = [
    "append",
    "rebuild",
    "long_lived",
    "startup",
    "exec_roundtrip",
    "create_running",
    "failover",
    "cluster",
    "cli",
    "load",
    "scale",
    "unchanged_saves",
]

# Used only when docs/benchmarks.md does not exist yet; its intro is kept by hand.
DOC_HEAD = """# Benchmarks

Each section below is written by its script in `bench/` (`--write`); run them all
with `uv run python bench/run_all.py`. Goals that are missed are reported as missed.
"""


# --- arguments, signals ---------------------------------------------------------


def arguments(
    description: str, extra: Callable[[argparse.ArgumentParser], object] | None = None
) -> argparse.Namespace:
    """--quick and --write, and what `extra` adds to the parser."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="a short run (smaller counts)")
    parser.add_argument(
        "--write", action="store_true", help="update this benchmark's section of docs/benchmarks.md"
    )
    if extra is not None:
        extra(parser)
    args = parser.parse_args()
    _exit_on_sigterm()
    return args


def _exit_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so every `finally` stops what it started."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


def command_line() -> str:
    script = Path(sys.argv[0]).resolve()
    with contextlib.suppress(ValueError):
        script = script.relative_to(ROOT)
    return " ".join(["uv run python", shlex.quote(str(script)), *map(shlex.quote, sys.argv[1:])])


# --- the server -------------------------------------------------------------------


@contextlib.contextmanager
def temp_dir(tag: str) -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix=f"sandhold-bench-{tag}-") as name:
        yield Path(name)


@contextlib.contextmanager
def nats_server(tag: str) -> Iterator[NatsServer]:
    """A fresh single-node server (`sync_interval: always`) in a temp dir, stopped by PID."""
    with temp_dir(tag) as data, running(NatsServer(data / "nats")) as server:
        yield server


@contextlib.contextmanager
def running(server: NatsServer, *, stop_timeout: float = 10) -> Iterator[NatsServer]:
    """`server` started, and stopped by PID however the block ends."""
    try:
        server.start()
        yield server
    finally:
        try:
            server.stop(timeout=stop_timeout)
        finally:
            server.kill()


class BulkLoadServer(NatsServer):
    """Bench set-up only, never a product path: the same server and store
    without `sync_interval: always`, to write a log of millions of events in
    minutes (each fsync'd write takes ~0.3 ms here: ten million, an hour).
    What a bench measures runs on a `NatsServer` (`sync_interval: always`)
    started on the same store after this one stopped: the files are the same
    whichever way they were flushed."""

    def _config(self) -> str:
        config = super()._config()
        line = "  sync_interval: always\n"
        if line not in config:
            raise RuntimeError("the server's config no longer says sync_interval: always")
        return config.replace(line, "")


def nats_server_version() -> str:
    try:
        out = subprocess.run(
            [str(nats_server_binary()), "--version"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"
    return out.split()[-1] if out else "?"


# --- the machine --------------------------------------------------------------------


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def nproc() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 0


def _fs_type(path: Path) -> str:
    best, kind = "", "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) > 2 and str(path).startswith(parts[1]) and len(parts[1]) > len(best):
                best, kind = parts[1], parts[2]
    return kind


def machine() -> str:
    tmp = Path(tempfile.gettempdir())
    return (
        f"nproc {nproc()}, CPU `{cpu_model()}`, Linux {platform.release()}, "
        f"temp dir on {_fs_type(tmp)}; Python {platform.python_version()}, "
        f"nats-py {importlib.metadata.version('nats-py')}, "
        f"nats-server {nats_server_version()}"
    )


def load_average() -> str:
    try:
        return Path("/proc/loadavg").read_text().split()[0]
    except OSError:
        return "?"


_START_LOAD = load_average()


def _machine_busy() -> float:
    """Seconds of CPU the whole machine has spent busy (all cores), from /proc/stat."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return float("nan")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _ours() -> float:
    """CPU seconds of this process and its reaped children (servers, `sandhold up`)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


_START = (time.monotonic(), _machine_busy(), _ours())


def other_load() -> str:
    """How much CPU processes other than this benchmark's used while it ran."""
    wall = time.monotonic() - _START[0]
    others = (_machine_busy() - _START[1]) - (_ours() - _START[2])
    return f"{max(0.0, others) / wall:.2f} of {nproc()} cores"


def code_version() -> str:
    """Which sandhold code was measured: $SANDHOLD_BENCH_CODE, else `git describe`
    of the checkout the `sandhold` packages are imported from."""
    label = os.environ.get("SANDHOLD_BENCH_CODE")
    if label:
        return label
    import sandhold.bus

    where = Path(sandhold.bus.__file__).resolve().parent
    try:
        done = subprocess.run(
            ["git", "-C", str(where), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return f"code at {where}"
    return f"git {done.stdout.strip()}" if done.returncode == 0 else f"code at {where}"


def now_utc() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")


# --- figures --------------------------------------------------------------------------


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile (p in 0..100) of `values`."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(p / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


def rate(value: float) -> str:
    return f"{value:,.0f}"


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table (also readable on a terminal)."""
    cells = [list(map(str, headers))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"

    out = [line(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r) for r in cells[1:]]
    return "\n".join(out)


def verdict(ok: bool) -> str:
    return "**pass**" if ok else "**MISS**"


# --- the doc ----------------------------------------------------------------------------


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- bench:{name}:begin -->", f"<!-- bench:{name}:end -->"


def section(name: str, title: str, body: str) -> str:
    """A section with the command that produced it, the date and the machine."""
    return (
        f"## {title}\n\n"
        f"`{command_line()}` — {now_utc()} — sandhold {code_version()}  \n"
        f"Machine: {machine()}. Load average {_START_LOAD} at the start, "
        f"{load_average()} at the end; other processes on the machine used "
        f"{other_load()} on average during the run (noise).\n\n"
        f"{body.strip()}\n"
    )


def write_section(name: str, text: str) -> None:
    """Replace this benchmark's section of docs/benchmarks.md, keeping the others."""
    begin, end = _markers(name)
    block = f"{begin}\n{text.strip()}\n{end}"
    doc = DOC.read_text() if DOC.exists() else DOC_HEAD
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if pattern.search(doc):
        doc = pattern.sub(lambda _: block, doc, count=1)
    else:
        # Insert before the first section that comes later in SECTIONS.
        later = SECTIONS[SECTIONS.index(name) + 1 :] if name in SECTIONS else []
        at = min((doc.index(_markers(n)[0]) for n in later if _markers(n)[0] in doc), default=None)
        if at is None:
            doc = doc.rstrip("\n") + "\n\n" + block + "\n"
        else:
            doc = doc[:at] + block + "\n\n" + doc[at:]
    DOC.parent.mkdir(parents=True, exist_ok=True)
    DOC.write_text(doc)
    print(f"wrote section {name!r} of {DOC.relative_to(ROOT)}")


def emit(args: argparse.Namespace, name: str, title: str, body: str) -> None:
    text = section(name, title, body)
    print()
    print(text)
    if args.write:
        write_section(name, text)


# --- realistic sandbox histories ----------------------------------------------------------

HOST = "local"
_ARGVS = [
    ["pytest", "-q", "tests/test_api.py"],
    ["git", "status", "--porcelain"],
    ["python", "-c", "print('hello')"],
    ["npm", "run", "build"],
    ["ls", "-la", "src"],
]


def sandbox_id(i: int, tag: str = "bench") -> str:
    return rq.sandbox_id_for("default", f"{tag}-{i}")


def sandbox_events(sid: str, count: int, *, deleted: bool = False) -> list[ev.AnyEvent]:
    """The first `count` events of a sandbox's life: created, placed, starting,
    started, then commands that are queued, dispatched, started and ended;
    `deleted`: its last two are a delete (requested, then done), after its
    last whole command."""
    out: list[ev.AnyEvent] = [
        ev.SandboxCreated(
            sandbox_id=sid, request_key=f"create-{sid}", request_digest="d" * 32, tenant="default"
        ),
        ev.SandboxPlaced(host=HOST, generation=1),
        ev.SandboxStarting(host=HOST, generation=1),
        ev.SandboxStarted(
            host=HOST,
            generation=1,
            capabilities={"cgroups": "v2", "memory_limit": "True", "private_tmp": "True"},
        ),
    ]
    n = 0
    while len(out) < count:
        key = f"run-{sid}-{n}"
        cid = rq.command_id_for(sid, key)
        out += [
            ev.CommandQueued(
                command_id=cid,
                request_key=key,
                request_digest="e" * 32,
                argv=_ARGVS[n % len(_ARGVS)],
                env={"CI": "1"},
                timeout_s=600.0,
            ),
            ev.CommandDispatched(command_id=cid, host=HOST, generation=1),
            ev.CommandStarted(command_id=cid, host=HOST, generation=1, pid=10_000 + n),
            ev.CommandEnded(
                command_id=cid,
                state="exited",
                exit_code=n % 2,
                host=HOST,
                generation=1,
                output_kept={"stdout": 1234 + n, "stderr": 56},
            ),
        ]
        n += 1
    if not deleted:
        return out[:count]
    whole = 4 + (count - 2 - 4) // 4 * 4  # (no command cut in half by the delete)
    return out[:whole] + [
        ev.SandboxDeleteRequested(request_key=f"delete-{sid}", request_digest="f" * 32),
        ev.SandboxDeleted(host=HOST, generation=1),
    ]


def envelopes_for(
    sid: str, count: int, t0: float | None = None, *, deleted: bool = False
) -> list[Envelope]:
    """Envelopes as the services write them: one `wrap` per decision, id based on
    the sequence the decision was made on."""
    t0 = time.time() if t0 is None else t0
    out: list[Envelope] = []
    for i, event in enumerate(sandbox_events(sid, count, deleted=deleted)):
        actor = (
            "scheduler"
            if i < 2 or isinstance(event, (ev.CommandQueued, ev.CommandDispatched))
            else "host-agent"
        )
        out += wrap(
            [event],
            aggregate_id=sid,
            id_base=f"bench:{i}@{i}",
            actor=actor,
            causation_id=f"cause-{sid}-{i}",
            correlation_id=f"corr-{sid}",
            time=t0 + i * 0.01,
        )
    return out


async def append_histories(
    js: JetStreamContext,
    names: Names,
    sandbox_ids: Sequence[str],
    per_sandbox: int,
    *,
    deleted: Callable[[str], bool] = lambda sid: False,
) -> tuple[int, str]:
    """Each sandbox's history (`envelopes_for`) appended with the fenced `append`,
    1,000 appends in flight, a few thousand sandboxes at a time (one task per
    sandbox of ten million events would hold every history at once); the
    highest sequence written and its envelope's id."""
    sem = asyncio.Semaphore(1000)
    last = (0, "")

    async def writer(sid: str) -> None:
        nonlocal last
        expected = 0
        subject = names.events("sandbox", sid)
        for envelope in envelopes_for(sid, per_sandbox, deleted=deleted(sid)):
            async with sem:
                expected = (await append(js, names.events_stream, subject, [envelope], expected))[0]
            last = max(last, (expected, envelope.id))

    for start in range(0, len(sandbox_ids), 2000):
        await asyncio.gather(*(writer(sid) for sid in sandbox_ids[start : start + 2000]))
    return last


def encoded_size(envelopes: Sequence[Envelope]) -> float:
    return statistics.fmean(len(msgspec.json.encode(e)) for e in envelopes)


def proc_cpu_seconds(pid: int | None) -> float:
    """User + system CPU time a process has used so far (0 when unknown)."""
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU used by this process and by given PIDs over a span, as % of one core."""

    def __init__(self, *pids: int | None) -> None:
        self.pids = pids

    def __enter__(self) -> CpuMeter:
        self._wall = time.perf_counter()
        self._self = time.process_time()
        self._others = [proc_cpu_seconds(p) for p in self.pids]
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self._wall
        self.client_seconds = time.process_time() - self._self
        self.client = 100 * self.client_seconds / wall
        self.others = [
            100 * (proc_cpu_seconds(p) - before) / wall
            for p, before in zip(self.pids, self._others, strict=True)
        ]


def fsync_probe(count: int = 500) -> tuple[str, float]:
    """p50/p99 of a 400-byte append + fsync on the temp dir's disk: the floor of one
    durable write, and how noisy it is."""
    with temp_dir("fsync") as data:
        fd = os.open(data / "probe", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        try:
            lat = []
            for _ in range(count):
                t = time.perf_counter()
                os.write(fd, b"x" * 400)
                os.fsync(fd)
                lat.append(time.perf_counter() - t)
        finally:
            os.close(fd)
    p50, p99 = percentile(lat, 50) * 1000, percentile(lat, 99) * 1000
    text = (
        f"Disk probe: 400 B append + fsync p50 {p50:.2f} ms, p99 {p99:.2f} ms, "
        f"max {max(lat) * 1000:.2f} ms ({count} in a row)"
    )
    return text, p50


# --- `sandhold up`, and the floor of the bus ------------------------------------------------


@contextlib.contextmanager
def sandhold_up(tag: str, *up_args: str) -> Iterator[object]:
    """`sandhold up` as a subprocess in a temp data dir (tests/e2e/harness.Up): it
    prints "sandhold is up: URL" when every service is ready; stopped by PID."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from tests.e2e.harness import Up

    with temp_dir(tag) as data:
        up = Up(data / "sandhold", *up_args)
        try:
            up.start(timeout=90)
            yield up
        finally:
            up.stop(timeout=60)


FLOOR_APPENDS = 4  # a create's events on the way to `sandbox.started`
FLOOR_WRITES = FLOOR_APPENDS + 2


async def bus_floor(url: str, count: int, appends: int = FLOOR_APPENDS) -> list[float]:
    """Seconds per chain of what one request costs the bus at the least, all on
    one server, no services: the request published to a work-queue stream (acked),
    a core request/reply round trip to a responder on another connection, then
    `appends` fenced appends to one subject and one work-queue publish —
    `appends` + 2 fsync'd writes and one round trip, in sequence."""
    import nats
    from nats.js.api import Header, RetentionPolicy, StreamConfig
    from sandhold.bus.append import append

    nc = await nats.connect(url, name="bench-floor")
    responder = await nats.connect(url, name="bench-floor-responder")
    try:
        js = nc.jetstream()
        await js.add_stream(
            StreamConfig(
                name="FLOOR_REQ", subjects=["floor.req.>"], retention=RetentionPolicy.WORK_QUEUE
            )
        )
        await js.add_stream(
            StreamConfig(
                name="FLOOR_WORK", subjects=["floor.work.>"], retention=RetentionPolicy.WORK_QUEUE
            )
        )
        await js.add_stream(
            StreamConfig(
                name="FLOOR_EV", subjects=["floor.ev.>"], allow_direct=True, duplicate_window=120
            )
        )

        async def answer(msg) -> None:
            await msg.respond(b'{"ok":true}')

        await responder.subscribe("floor.rpc", cb=answer)
        await responder.flush()
        chains = []
        for i in range(count + 3):
            sid = sandbox_id(i, "floor")
            envelopes = envelopes_for(sid, appends)
            started = time.perf_counter()
            await js.publish(
                f"floor.req.{i}",
                b"x" * 200,
                stream="FLOOR_REQ",
                headers={Header.MSG_ID: f"req-{i}"},
            )
            await nc.request("floor.rpc", b"{}", timeout=5)
            seq = 0
            for envelope in envelopes:
                seq = (await append(js, "FLOOR_EV", f"floor.ev.{sid}", [envelope], seq))[0]
            await js.publish(
                f"floor.work.{i}",
                b"y" * 200,
                stream="FLOOR_WORK",
                headers={Header.MSG_ID: f"work-{i}"},
            )
            if i >= 3:  # the first few warm up
                chains.append(time.perf_counter() - started)
        return chains
    finally:
        await responder.close()
        await nc.close()


async def spawn_floor(count: int) -> tuple[list[float], list[float]]:
    """Seconds to spawn and reap `true`: subprocess.run, and asyncio's subprocess."""
    import asyncio
    import shutil

    true = shutil.which("true") or "/bin/true"
    sync = []
    for _ in range(count):
        started = time.perf_counter()
        subprocess.run([true], check=True)
        sync.append(time.perf_counter() - started)

    in_loop = []
    for _ in range(count):
        started = time.perf_counter()
        proc = await asyncio.create_subprocess_exec(true)
        await proc.wait()
        in_loop.append(time.perf_counter() - started)
    return sync, in_loop


def latency_row(label: str, values: Sequence[float]) -> list[str]:
    return [
        label,
        str(len(values)),
        ms(percentile(values, 50)),
        ms(percentile(values, 90)),
        ms(percentile(values, 99)),
        ms(max(values) if values else float("nan")),
    ]


LATENCY_HEADERS = ["what", "n", "p50 ms", "p90 ms", "p99 ms", "max ms"]


async def timed_true(driver: Any, sandbox_id: str, command_id: str) -> tuple[float, float, float]:
    """`true` through a host's `ProcessDriver`, reported as the agent does once it
    ends: seconds of launch (cgroups, spec, hand-over to a warm supervisor), then
    until started (the supervisor forked it), then until its exit is recorded."""
    t0 = time.perf_counter()
    handle = await driver.launch(sandbox_id, command_id, ["true"])
    t1 = time.perf_counter()
    await handle.started()
    t2 = time.perf_counter()
    end = await handle.wait()
    t3 = time.perf_counter()
    await driver.mark_reported(sandbox_id, command_id)
    if end.reason != "exited":
        raise RuntimeError(f"driver, {command_id}: {end!r}")
    return t1 - t0, t2 - t1, t3 - t2
