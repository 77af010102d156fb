"""`sandhold top`: the dashboard's key numbers in a terminal, live from the log.

It folds the EVENTS stream into the same `LogMetrics` the metrics service
exports, so both always show the same counts, without Prometheus or Grafana;
from the metrics service's checkpoint when this machine holds it.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import msgspec
from sandhold.client import Client
from sandhold.metrics.service import follow_log, load_fold
from sandhold.telemetry.log_metrics import LogMetrics, percentile

_TASK_STATUSES = ("completed", "failed", "cancelled", "timed_out")


def summary(folded: LogMetrics, now: float, *, started_at: int = 0) -> dict[str, dict[str, object]]:
    """The key numbers, grouped as `top` shows them (also its `--json`)."""
    gauges = folded.gauges(now)
    ended = {s: folded.total("tasks_completed_total", status=s) for s in _TASK_STATUSES}
    finished = sum(ended.values())
    durations = list(folded.samples["task_duration_seconds"])
    lag = gauges["sandhold_save_lag_seconds"]
    worst = max(lag.items(), key=lambda kv: kv[1], default=None)
    return {
        "tasks": {
            "active": gauges["tasks_active"][()],
            "running": gauges["tasks_running"][()],
            "submitted": folded.total("tasks_submitted_total"),
            **ended,
            "success_rate": ended["completed"] / finished if finished else None,
            "duration_p50_s": percentile(durations, 0.50),
            "duration_p95_s": percentile(durations, 0.95),
            "duration_p99_s": percentile(durations, 0.99),
            "hang_warnings": folded.total("task_hang_warnings_total"),
        },
        "commands": {
            dict(k)["state"]: v for k, v in folded.counters["sandhold_commands_ended_total"].items()
        },
        "saves": {
            "completed": folded.total("sandhold_saves_completed_total"),
            "unchanged": folded.total("sandhold_saves_unchanged_total"),
            "failed": folded.total("sandhold_save_failures_total"),
            "duration_p50_s": _p(folded, "sandhold_save_duration_seconds", 0.5),
            "freeze_p99_s": _p(folded, "sandhold_save_freeze_seconds", 0.99),
            "uploaded_bytes": folded.total("sandhold_save_uploaded_bytes_total"),
            "max_lag_s": worst[1] if worst else None,
            "max_lag_sandbox": dict(worst[0])["sandbox"] if worst else None,
        },
        "hosts": {
            **{dict(k)["status"]: v for k, v in gauges["sandhold_hosts"].items()},
            "lost_total": folded.total("sandhold_hosts_lost_total"),
        },
        "recovery": {
            "sandboxes_lost": folded.total("sandhold_sandboxes_lost_total"),
            "recoveries": len(folded.samples["sandhold_recovery_seconds"]),
            "p50_s": _p(folded, "sandhold_recovery_seconds", 0.5),
            "p99_s": _p(folded, "sandhold_recovery_seconds", 0.99),
        },
        "sandboxes": {dict(k)["phase"]: v for k, v in gauges["sandhold_sandboxes"].items()},
        # Where this fold began: a metrics service's checkpoint's position, or 0.
        "log": {"position": folded.position, "folded_from": started_at},
    }


def _written_at(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _p(folded: LogMetrics, histogram: str, q: float) -> float | None:
    return percentile(list(folded.samples[histogram]), q)


def render(numbers: dict[str, dict[str, object]]) -> str:
    position = numbers["log"]["position"]
    lines = [f"sandhold top — {time.strftime('%H:%M:%S')} — log position {position}"]
    for group, values in numbers.items():
        if group == "log":
            continue
        shown = "  ".join(f"{k} {_fmt(k, v)}" for k, v in values.items()) or "-"
        lines.append(f"{group.upper():<10} {shown}")
    return "\n".join(lines)


def _fmt(key: str, value: object) -> str:
    if value is None:
        return "-"
    if key.endswith("_s") and isinstance(value, float):
        return f"{value:.3g}s"
    if key == "success_rate" and isinstance(value, float):
        return f"{value:.0%}"
    if key.endswith("_bytes") and isinstance(value, float):
        return f"{value / 2**20:.1f}MiB"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


async def top(
    client: Client,
    *,
    interval: float,
    once: bool,
    as_json: bool,
    checkpoints: Path | None = None,
) -> int:
    """From a metrics service's checkpoint where this machine has one (the data
    dir's `checkpoints/<instance>/`, as `sandhold up` keeps them; the newest
    believed), so a long log is not folded from zero; else from its first event."""
    folded = None
    kept = [] if checkpoints is None else list(checkpoints.glob("*/metrics.checkpoint"))
    for path in sorted(kept, key=_written_at, reverse=True):
        if (folded := await load_fold(client.js, client.names, path)) is not None:
            break
    folded = folded or LogMetrics()
    started_at = folded.position
    follower = await follow_log(client.js, client.names, folded)
    try:
        while True:
            numbers = summary(folded, time.time(), started_at=started_at)
            if as_json:
                sys.stdout.write(msgspec.json.encode(numbers).decode() + "\n")
            elif sys.stdout.isatty() and not once:
                sys.stdout.write("\x1b[H\x1b[2J" + render(numbers) + "\n")
            else:
                sys.stdout.write(render(numbers) + "\n")
            sys.stdout.flush()
            if once:
                return 0
            await asyncio.sleep(interval)
    finally:
        await follower.stop()
