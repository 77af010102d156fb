"""(l) CLI start-up: `sandhold --help` and `sandhold exec <id> -- true` from the shell.

Wall time of each as a new process, as a user types it (the venv's `sandhold`
script, not `uv run`), next to `python -c pass` (the interpreter's floor) and
`python -c "import nats.aio.client"` (what any NATS client in Python pays
before it connects). The exec runs against a `sandhold up` of its own, on a
sandbox created first; every process is stopped by PID at the end.

    uv run python bench/cli.py [--quick] [--write]
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

from _common import arguments, emit, median, percentile, sandhold_up, table, verdict
from sandhold.client import connect

# `sandhold exec` as `main` runs it, but straight to the full client.
FULL_CLIENT = """
import sys
from sandhold.cli import commands
from sandhold.cli.main import _parser
split = sys.argv.index("--")
args = _parser().parse_args(sys.argv[1:split])
args.argv = [*args.argv, *sys.argv[split + 1 :]]
commands.dispatch(args)
"""
GOAL_HELP_S = 0.080
GOAL_EXEC_S = 0.120
SANDHOLD = Path(sys.executable).parent / "sandhold"


# As a user's machine has it: compiled modules are kept (this environment sets
# PYTHONDONTWRITEBYTECODE, which makes every start compile nats-py anew).
USER_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def timed(argv: list[str], runs: int, env: dict[str, str] | None = None) -> list[float]:
    env = {**USER_ENV, **(env or {})}
    for _ in range(2):  # warm: bytecode written, files in the page cache
        subprocess.run(argv, capture_output=True, env=env, timeout=60)
    out = []
    for _ in range(runs):
        started = time.perf_counter()
        done = subprocess.run(argv, capture_output=True, env=env, timeout=60)
        out.append(time.perf_counter() - started)
        if done.returncode != 0:
            raise RuntimeError(f"{argv}: exit {done.returncode}: {done.stderr.decode()[-500:]}")
    return out


def row(label: str, values: list[float], goal: float | None = None) -> list[str]:
    return [
        label,
        f"{median(values) * 1000:.0f}",
        f"{percentile(values, 90) * 1000:.0f}",
        f"{min(values) * 1000:.0f}",
        f"≤ {goal * 1000:.0f} ms {verdict(median(values) <= goal)}" if goal else "",
    ]


async def sandbox(url: str) -> str:
    client = await connect(url)
    try:
        view = await client.create_sandbox(key="bench-cli")
        await client.wait_for_phase(view.id, {"running"}, timeout=60)
        return view.id
    finally:
        await client.close()


def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    runs = 5 if args.quick else 30
    python = sys.executable
    rows = [
        row("`python -c pass`", timed([python, "-c", "pass"], runs)),
        row(
            '`python -c "import nats.aio.client"`',
            timed([python, "-c", "import nats.aio.client"], runs),
        ),
        row("`sandhold --help`", timed([str(SANDHOLD), "--help"], runs), GOAL_HELP_S),
    ]
    with sandhold_up("cli") as up:
        sandbox_id = asyncio.run(sandbox(up.url))  # type: ignore[attr-defined]
        env = {"SANDHOLD_NATS_URL": ""}
        exec_argv = [
            str(SANDHOLD),
            "--data-dir",
            str(up.data_dir),
            "exec",
            sandbox_id,
            "--",
            "true",
        ]  # type: ignore[attr-defined]
        rows.append(row("`sandhold exec <id> -- true`", timed(exec_argv, runs, env), GOAL_EXEC_S))
        # The same exec through the full client (nats-py, asyncio): what every
        # exec cost before the quick path (decision 058), and what it hands over to.
        full = [python, "-c", FULL_CLIENT, *exec_argv[1:]]
        rows.append(row("the same through the full client (nats-py)", timed(full, runs, env)))
    body = f"""
{runs} runs of each as a new process (`subprocess.run`, wall time from fork to
exit), one after another, after two warm-up runs; ms. Compiled bytecode is
kept, as on a user's machine (this environment sets `PYTHONDONTWRITEBYTECODE`,
which the runs drop: with it, every start compiles nats-py anew, +100 ms).
`sandhold` is the venv's script; the exec runs against `sandhold up` (the
default driver) on a running sandbox.

{table(["command", "p50 ms", "p90 ms", "min ms", "goal"], rows)}

Reading: `--help` imports only the parser (`cli/main.py`; the handlers and
everything that talks to NATS are in `cli/commands.py`, imported once a command
needs them). An exec imports neither nats-py nor asyncio (the second row is
nats-py's import alone): its quick path (`cli/quick_exec.py`, decision 058)
speaks the few parts of the NATS protocol a short exec needs over a blocking
socket, and hands anything else to the full client, whose cost the last row
shows.
"""
    emit(args, "cli", "(l) CLI start-up", body)


if __name__ == "__main__":
    main()
