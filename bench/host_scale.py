"""(j)'s exec tail on the host alone: `true` in random boxes at 10 and at 1,000 boxes.

A diagnosis for bench (j), not a section of benchmarks.md: `ProcessDriver` in
this process with the namespaces driver (as the host-agent runs it), no NATS,
no services. The same driver with 10 boxes is the baseline of the 1,000-box
row. For each size, 600 execs one after another (20 ms apart) on random boxes;
p50 / p99 / max ms of launch (cgroups, spec, hand-over to a warm supervisor),
→ started (the supervisor forks the command into the box), → exit recorded,
and all. With `--perf`, `perf record -a -g -e sched:sched_switch` runs during
the largest size's execs and the stacks where the execs' processes blocked
are counted (needs perf, and tracefs mounted at /sys/kernel/tracing).
Everything it starts is stopped in `finally` (boxes destroyed, perf by PID).

    uv run python bench/host_scale.py [--sizes 10,1000] [--perf]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import re
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

from _common import percentile, timed_true
from sandhold.hostagent.driver import ProcessDriver

EXECS = 600
PAUSE_S = 0.02


def _ms(values: list[float], pct: float) -> float:
    return percentile(values, pct) * 1000


async def _execs(driver: ProcessDriver, boxes: list[str], tag: str) -> dict[str, list[float]]:
    rng = random.Random(tag)
    steps: dict[str, list[float]] = {"launch": [], "started": [], "exit": [], "all": []}
    for i in range(EXECS):
        taken = await timed_true(driver, rng.choice(boxes), f"cmd-{tag}-{i:08x}")
        for name, value in zip(("launch", "started", "exit"), taken, strict=True):
            steps[name].append(value)
        steps["all"].append(sum(taken))
        await asyncio.sleep(PAUSE_S)
    return steps


def _blocked_stacks(data: Path, top: int = 8) -> list[tuple[int, str]]:
    """Where the execs' processes (python: the supervisors and this driver;
    true: the commands) went to sleep uninterruptibly, by kernel stack."""
    script = subprocess.run(
        ["perf", "script", "-i", str(data), "-F", "comm,event,trace,ip,sym"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    counts: collections.Counter[str] = collections.Counter()
    for block in script.stdout.split("\n\n"):
        lines = [line for line in block.strip().splitlines() if line.strip()]
        found = re.search(r"prev_comm=(\S+).*prev_state=(\S+)", lines[0]) if lines else None
        ours = found is not None and found[1] in ("python", "python3", "true")
        if found is None or not ours or not found[2].startswith("D"):
            continue
        frames = [line.split()[-1] for line in lines[1:10]]
        frames = [f for f in frames if not f.startswith(("__schedule", "schedule", "__trace"))]
        counts[f"{found[1]}: " + " ← ".join(frames[:4])] += 1
    return [(n, stack) for stack, n in counts.most_common(top)]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10,1000")
    parser.add_argument("--perf", action="store_true")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    root = Path(tempfile.mkdtemp(prefix="host-scale-"))
    driver = ProcessDriver(root, "host-scale")
    await driver.start()
    boxes: list[str] = []
    perf: subprocess.Popen[bytes] | None = None
    try:
        for size in sizes:
            while len(boxes) < size:
                boxes.append(f"sb-{len(boxes):016x}")
                await driver.create_sandbox(boxes[-1], None)
            if args.perf and size == max(sizes):
                perf = subprocess.Popen(
                    ["perf", "record", "-a", "-g", "-e", "sched:sched_switch",
                     "-o", str(root / "perf.data")],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                )  # fmt: skip
                await asyncio.sleep(1.0)
            steps = await _execs(driver, boxes, f"s{size}")
            if perf is not None:
                perf.send_signal(signal.SIGINT)
                perf.wait(timeout=60)
            print(
                f"{size:>5} boxes: "
                + "; ".join(
                    f"{name} p50 {_ms(v, 50):.1f} p99 {_ms(v, 99):.1f} max {_ms(v, 100):.1f}"
                    for name, v in steps.items()
                ),
                flush=True,
            )
        if perf is not None:
            print("where the execs' processes blocked (sched_switch, state D), most often first:")
            for n, stack in _blocked_stacks(root / "perf.data"):
                print(f"  {n:>6}  {stack}")
    finally:
        if perf is not None and perf.poll() is None:
            perf.kill()
            perf.wait()
        for sandbox_id in boxes:
            await driver.destroy_sandbox(sandbox_id)
        driver.cgroups.remove_host()
        await driver.close()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())
