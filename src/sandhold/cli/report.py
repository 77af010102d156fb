"""How the CLI prints what it got: JSON, and how `sandhold exec` reports a
command's end (for the quick path, `quick_exec`, and the full client's alike).
Light to import: no NATS client."""

from __future__ import annotations

import sys

import msgspec
from sandhold.domain.views import CommandView

# How `exec` exits when the command did not simply exit: shell conventions where
# one exists (124 timeout(1), 127 not found, 130 interrupted, 137 killed).
EXIT_CODES = {
    "timed_out": 124,
    "launch_failed": 127,
    "interrupted": 130,
    "resource_exhausted": 137,
    "not_launched": 125,
    "infrastructure_lost": 125,
    "unknown": 125,
}
EXIT_REJECTED = 2
EXIT_UNREACHABLE = 3


def print_json(value: object) -> None:
    sys.stdout.write(msgspec.json.encode(value).decode() + "\n")


def report_exec(command: CommandView, stdout: bytes, stderr: bytes, as_json: bool) -> int:
    """Print how a command ended (as JSON with its output, or a line where it
    did not simply exit) and give the exit code `sandhold exec` ends with."""
    if as_json:
        record = msgspec.to_builtins(command)
        record["output"] = (stdout + stderr).decode(errors="replace")
        record["stdout"] = stdout.decode(errors="replace")
        record["stderr"] = stderr.decode(errors="replace")
        print_json(record)
    elif (cold := command.cold_start) is not None:
        source = f"from save {cold.from_save}" if cold.from_save else "from its files on the host"
        print(
            f"sandhold: {command.sandbox_id} had been stopped for being idle: started again "
            f"{source} in {cold.start_ms or 0:.0f} ms (restore {cold.restore_ms:.0f} ms, "
            f"{cold.bytes_fetched} bytes fetched)",
            file=sys.stderr,
        )
    if command.state == "exited" and command.exit_code is not None:
        return command.exit_code
    if command.state == "exited" and command.signal is not None:
        if not as_json:
            print(
                f"sandhold: command {command.id} was killed by signal {command.signal}",
                file=sys.stderr,
            )
        return 128 + command.signal  # as a shell reports it
    if not as_json:
        print(
            f"sandhold: command {command.id} ended {command.state}"
            + (f": {command.reason}" if command.reason else ""),
            file=sys.stderr,
        )
    return EXIT_CODES.get(command.state, 125)
