"""`sandhold sandbox show`: a sandbox's status as a block people read at a glance.

`--json` prints the `SandboxView` itself (the stable form, docs/api.md); this
is its human form, so it may change wording, never facts.
"""

from __future__ import annotations

import time

from sandhold.domain.views import SandboxView, SaveView

_MiB = 1024 * 1024


def _rpo(view: SandboxView) -> str:
    if view.unchanged_since_save is not None:
        return f"nothing at risk: unchanged since {view.unchanged_since_save}"
    return "-" if view.rpo_s is None else f"{_duration(view.rpo_s)} of work at risk"


def status_block(view: SandboxView, *, now: float | None = None) -> str:
    now = time.time() if now is None else now
    rows: list[tuple[str, str]] = [
        ("sandbox", f"{view.id}  (tenant {view.tenant})"),
        ("phase", view.phase + (f": {view.reason}" if view.reason else "")),
        ("host", f"{view.host or '-'}  generation {view.generation}"),
        ("isolation", _isolation(view)),
        ("limits", _limits(view)),
        ("last save", _save(view.last_completed_save, now)),
        ("save health", _health(view)),
        ("rpo", _rpo(view)),
        ("recoverable", view.recoverable_from or "-"),
    ]
    if view.save_in_progress is not None:
        rows.append(("saving", _save(view.save_in_progress, now)))
    if view.final_save is not None:
        rows.append(("final save", _save(view.final_save, now)))
    if view.storage:
        rows.append(("storage", ", ".join(f"{k} {v}" for k, v in view.storage.items())))
    rows.append(("snapshots", ", ".join(_snapshot(s) for s in view.snapshots) or "-"))
    if view.lost_host:
        rows.append(("lost host", view.lost_host))
    if view.recovery:
        rows.append(("recovery", ", ".join(f"{k} {v}" for k, v in view.recovery.items())))
    if view.recovered_from is not None:
        r = view.recovered_from
        behind = "" if r.behind_failure_s is None else f", {_duration(r.behind_failure_s)} behind"
        rows.append(("recovered", f"from {r.source} {r.save_id or ''}{behind}".replace("  ", " ")))
    rows.append(("idle", _idle(view, now)))
    if view.keep_stopped_s > 0:
        rows.append(("kept stopped", _kept(view, now)))
    commands = ", ".join(f"{n} {state}" for state, n in sorted(view.commands.items()))
    rows.append(("commands", commands or "none"))
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)


def _isolation(view: SandboxView) -> str:
    i = view.isolation
    if not i.get("driver"):
        return f"network {i.get('network', 'none')} (not started yet)"
    if i.get("unisolated"):
        return "UNISOLATED (process driver, development only)"
    parts = [str(i["driver"]), f"user {i.get('user')}", f"network {i.get('network')}"]
    parts.append("seccomp" if i.get("seccomp") else "no seccomp")
    if i.get("base"):
        parts.append(f"base {i['base']}")
    return ", ".join(parts)


def _limits(view: SandboxView) -> str:
    def mib(value: int | None) -> str:
        return "-" if value is None else f"{value // _MiB} MiB"

    pids = "host default" if view.pids_limit is None else str(view.pids_limit)
    cpus = "-" if view.cpu_limit is None else f"{view.cpu_limit:g}"
    return (
        f"memory {mib(view.memory_limit_bytes)}, pids {pids}, cpus {cpus}, "
        f"disk {mib(view.disk_limit_bytes)}"
    )


def _save(save: SaveView | None, now: float) -> str:
    if save is None:
        return "none"
    at = save.completed_at or save.requested_at
    size = f", {save.bytes / _MiB:.1f} MiB in {save.files} files" if save.bytes else ""
    return f"{save.id} {save.kind} {save.state}, {_duration(now - at)} ago{size}"


def _health(view: SandboxView) -> str:
    h = view.save_health
    if h is None:
        return "-"
    return h.state + (f": {h.reason}" if h.reason else "")


def _idle(view: SandboxView, now: float) -> str:
    idle = view.idle
    if idle is None:
        return "-"
    if idle.timeout_s <= 0:
        return "never reaped"
    limit = f"stopped after {_duration(idle.timeout_s)} idle"
    if view.phase in ("stopping", "stopped") and view.reason == "idle":
        return f"{limit}; it was (the next command starts it again)"
    if idle.reaps_at is None:
        return f"{limit}; not idle now"
    return (
        f"{limit}; idle {_duration(now - idle.since)}, stopped in {_duration(idle.reaps_at - now)}"
    )


def _kept(view: SandboxView, now: float) -> str:
    limit = f"{_duration(view.keep_stopped_s)}, then deleted (its Snapshots stay)"
    if view.deletes_at is None:
        return limit
    if view.deletes_at <= now:
        return f"{limit}; deletion due now"
    return f"{limit}; deleted in {_duration(view.deletes_at - now)}"


def _snapshot(save: SaveView) -> str:
    return f"{save.name or save.id} ({save.state})"


def _duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 90:
        return f"{seconds:.0f}s"
    if seconds < 5400:
        return f"{seconds / 60:.0f}m"
    if seconds < 172800:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"
