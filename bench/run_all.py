"""Run every benchmark in turn with `--write` (each updates its section of
docs/benchmarks.md), one subprocess at a time, stopped by PID on error or Ctrl-C.

    uv run python bench/run_all.py [--quick]
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
SCRIPTS = [
    "append.py",
    "rebuild.py",
    "long_lived.py",
    "startup.py",
    "exec_roundtrip.py",
    "create_running.py",
    "saves.py",
    "cold_start.py",
    "recovery.py",
    "tracing_cost.py",
    "isolation.py",
    "cluster.py",
    "cli.py",
    "load.py",
    "scale.py",
    "unchanged_saves.py",
]
TIMEOUT_S = 1800  # per script; a full run of each takes a few minutes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short runs")
    parser.add_argument(
        "--only", nargs="*", choices=[s.removesuffix(".py") for s in SCRIPTS], help="run only these"
    )
    args = parser.parse_args()

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    failed = []
    for script in SCRIPTS:
        if args.only and script.removesuffix(".py") not in args.only:
            continue
        argv = [sys.executable, str(BENCH / script), "--write"]
        if args.quick:
            argv.append("--quick")
        print(f"== {script}", flush=True)
        started = time.monotonic()
        process = subprocess.Popen(argv)
        try:
            code = process.wait(TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = -1
            print(f"{script}: timed out after {TIMEOUT_S}s", file=sys.stderr)
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)  # the script stops what it started
                try:
                    process.wait(90)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        print(f"== {script}: exit {code} in {time.monotonic() - started:.0f}s", flush=True)
        if code != 0:
            failed.append(script)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
