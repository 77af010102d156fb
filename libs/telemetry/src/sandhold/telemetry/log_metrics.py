"""Metrics that are facts of the log, folded from it (decision 015).

Counts and durations of tasks, commands, saves, hosts and recoveries are all
in the events themselves (their envelope times, `freeze_ms`, `uploaded_bytes`
...). Folding them from the first event gives exact numbers after any restart,
the same ones in every process that folds them: the metrics service and
`sandhold top`. Pure: no NATS, no OpenTelemetry.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections import deque
from typing import Any, Literal, NamedTuple

import msgspec
from sandhold.domain import events as ev
from sandhold.domain import host as host_domain
from sandhold.domain import pmap
from sandhold.domain import sandbox as sb
from sandhold.domain import saves as sv
from sandhold.domain import task as tk
from sandhold.domain.envelope import Envelope

Kind = Literal["counter", "gauge", "histogram"]
Labels = tuple[tuple[str, str], ...]  # sorted (name, value) pairs


class Metric(NamedTuple):
    name: str  # as Prometheus shows it (counters end in _total, durations in _seconds)
    kind: Kind
    help: str
    buckets: tuple[float, ...] = ()


_SHORT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_LONG = (1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 7200, 14400, 28800, 86400, 259200)

CATALOG: tuple[Metric, ...] = (
    # The seed's task metrics, by their seed names.
    Metric("tasks_submitted_total", "counter", "Tasks submitted"),
    Metric(
        "tasks_completed_total",
        "counter",
        "Tasks that ended, by status (completed, failed, cancelled, timed_out)",
    ),
    Metric(
        "task_duration_seconds",
        "histogram",
        "Submission to end of each ended task, by status",
        _LONG,
    ),
    Metric("tasks_active", "gauge", "Tasks submitted and not ended"),
    Metric("tasks_running", "gauge", "Tasks in the running stage"),
    Metric("task_hang_warnings_total", "counter", "Hang warnings (no output for hang_warn)"),
    # sandhold's own.
    Metric("sandhold_events_total", "counter", "Events in the log, by type"),
    Metric("sandhold_commands_ended_total", "counter", "Commands that ended, by end state"),
    Metric("sandhold_sandboxes", "gauge", "Sandboxes by phase"),
    Metric("sandhold_saves_completed_total", "counter", "Verified saves, by kind"),
    Metric(
        "sandhold_saves_unchanged_total",
        "counter",
        "Scheduled saves that found nothing changed and stored nothing",
    ),
    Metric(
        "sandhold_commands_held_files_total",
        "counter",
        "Command ends that found every file as the last completed save holds them: no save due",
    ),
    Metric("sandhold_save_failures_total", "counter", "Failed saves, by stage"),
    Metric(
        "sandhold_save_duration_seconds",
        "histogram",
        "Save requested to verified (save.completed), by kind",
        _SHORT,
    ),
    Metric(
        "sandhold_save_freeze_seconds",
        "histogram",
        "How long a running sandbox stood frozen for a save (the freeze window), by method",
        _SHORT,
    ),
    Metric("sandhold_save_uploaded_bytes_total", "counter", "Bytes saves sent to the save store"),
    Metric(
        "sandhold_save_lag_seconds",
        "gauge",
        "RPO per running sandbox: how old the files of its last completed save are",
    ),
    Metric("sandhold_hosts", "gauge", "Hosts by status (registered, lost, fenced)"),
    Metric("sandhold_hosts_lost_total", "counter", "Hosts declared lost (a lease not renewed)"),
    Metric("sandhold_sandboxes_lost_total", "counter", "Sandboxes lost with their host"),
    Metric(
        "sandhold_recovery_seconds",
        "histogram",
        "Recovery asked for (start, command or eager) to running again on another host",
        _SHORT,
    ),
    Metric("sandhold_log_position", "gauge", "The last stream sequence folded into these metrics"),
)

BOUNDS = {m.name: m.buckets for m in CATALOG if m.kind == "histogram"}


class Buckets(msgspec.Struct, array_like=True):
    """One histogram series as Prometheus shows it: how many values fell in each
    bucket (at most its bound, above the one before; the last one: above every
    bound), and their sum. Kept by the fold, so a checkpoint holds it."""

    counts: list[int]
    sum: float = 0.0

    def cumulative(self) -> list[int]:
        out, running = [], 0
        for n in self.counts:
            running += n
            out.append(running)
        return out


def labels(**pairs: str) -> Labels:
    return tuple(sorted(pairs.items()))


class LogMetrics:
    """The metrics as of the last event applied; `apply` every event in order."""

    def __init__(self, *, keep_samples: int = 10_000) -> None:
        self.position = 0
        self.last_event_id = ""  # the id of the event at `position` (a checkpoint's check)
        self.counters: dict[str, dict[Labels, float]] = {
            m.name: {} for m in CATALOG if m.kind == "counter"
        }
        self.histograms: dict[str, dict[Labels, Buckets]] = {name: {} for name in BOUNDS}
        # The latest observations of each histogram, for percentiles in `sandhold top`.
        self.samples: dict[str, deque[float]] = {
            m.name: deque(maxlen=keep_samples) for m in CATALOG if m.kind == "histogram"
        }
        self.sandboxes: dict[str, sb.Sandbox] = {}  # sandboxes not deleted
        self.deleted = 0  # sandboxes deleted: counted, not kept
        self.hosts: dict[str, host_domain.Host] = {}
        # Tasks not ended yet: an ended one is counted, not kept (a later event of
        # it folds onto nothing, as `tk.evolve` ignores all but a submission there).
        self.tasks: dict[str, tk.Task] = {}
        self._recovering_since: dict[str, float] = {}
        # Prometheus reads from its own thread while the event loop folds: each
        # event is applied, and each read copied, under this lock. (A C-level
        # copy of a dict is not one step the GIL keeps: a garbage collection in
        # it can run Python code, a finalizer, and let the fold's thread in.)
        self._lock = threading.Lock()

    # --- folding ----------------------------------------------------------------

    def apply(self, seq: int, envelope: Envelope) -> None:
        with self._lock:
            self._apply(seq, envelope)

    def _apply(self, seq: int, envelope: Envelope) -> None:
        if seq <= self.position:
            return  # seen already
        self.position, self.last_event_id = seq, envelope.id
        kind = envelope.type.split(".", 1)[0]
        self._count("sandhold_events_total", type=envelope.type)
        if kind in ("sandbox", "command", "save", "snapshot", "request"):
            self._sandbox(envelope)
        elif kind == "host":
            self._host(envelope)
        elif kind == "task":
            self._task(envelope)

    def _sandbox(self, envelope: Envelope) -> None:
        sid, event, at = envelope.aggregate_id, envelope.event, envelope.time
        before = self.sandboxes.get(sid)
        match event:
            case ev.CommandEnded():
                self._count("sandhold_commands_ended_total", state=event.state)
            case ev.SaveCaptured():
                self._observe(
                    "sandhold_save_freeze_seconds",
                    event.freeze_ms / 1000,
                    method=event.freeze_method,
                )
            case ev.SaveUnchanged():
                self._count("sandhold_saves_unchanged_total")
                self._observe(
                    "sandhold_save_freeze_seconds",
                    event.freeze_ms / 1000,
                    method=event.freeze_method,
                )
            case ev.SaveUploaded():
                self._count("sandhold_save_uploaded_bytes_total", by=event.uploaded_bytes)
            case ev.SaveCompleted() if before is not None and event.save_id in before.saves:
                record = before.saves[event.save_id]
                self._count("sandhold_saves_completed_total", kind=record.kind)
                self._observe(
                    "sandhold_save_duration_seconds", at - record.requested_at, kind=record.kind
                )
            case ev.SaveFailed():
                self._count("sandhold_save_failures_total", stage=event.stage)
            case ev.SandboxLost():
                self._count("sandhold_sandboxes_lost_total")
            case ev.SandboxRecoveryRequested():
                self._recovering_since.setdefault(sid, at)
            case ev.SandboxStarted() if sid in self._recovering_since:
                self._observe("sandhold_recovery_seconds", at - self._recovering_since.pop(sid))
        after = sb.evolve(before, envelope)
        if after is None:
            return
        if isinstance(event, ev.CommandEnded) and event.files_of is not None:
            held = after.last_completed_save
            if held is not None and held.id == event.files_of and held.confirmed_at == at:
                # (Taken by the fold, decision 078: not every end that says so is.)
                self._count("sandhold_commands_held_files_total")
        if after.phase == "deleted":
            # Deleted is final: counted, not kept, or memory (and each scrape's
            # pass over the sandboxes) would grow with every sandbox ever made.
            # Whatever comes after is of no sandbox (evolve of nothing: nothing).
            self.deleted += 1
            self.sandboxes.pop(sid, None)
            self._recovering_since.pop(sid, None)
            return
        # Phases and saves are what the gauges read: no ended command (decision 057).
        self.sandboxes[sid] = sb.compact(after)

    def _host(self, envelope: Envelope) -> None:
        hid = envelope.aggregate_id
        before = self.hosts.get(hid)
        after = host_domain.evolve(before, envelope)
        if after is None:
            return
        self.hosts[hid] = after
        if after.status == "lost" and (before is None or before.status != "lost"):
            self._count("sandhold_hosts_lost_total")

    def _task(self, envelope: Envelope) -> None:
        tid = envelope.aggregate_id
        before = self.tasks.get(tid)
        after = tk.evolve(before, envelope)
        if after is None:
            return
        if before is None:
            self._count("tasks_submitted_total")
        if envelope.type == "task.hang_warned":
            self._count("task_hang_warnings_total")
        if after.terminal:
            self.tasks.pop(tid, None)  # ended tasks are not kept
            ended_at = after.finished_at or envelope.time
            self._count("tasks_completed_total", status=after.state)
            self._observe(
                "task_duration_seconds", ended_at - after.submitted_at, status=after.state
            )
        else:
            self.tasks[tid] = after

    def _count(self, name: str, by: float = 1, **pairs: str) -> None:
        series = self.counters[name]
        key = labels(**pairs)
        series[key] = series.get(key, 0) + by

    def _observe(self, name: str, value: float, **pairs: str) -> None:
        value = max(0.0, value)  # envelope times come from different hosts' clocks
        self.samples[name].append(value)
        key = labels(**pairs)
        series = self.histograms[name]
        buckets = series.get(key)
        if buckets is None:
            buckets = series[key] = Buckets(counts=[0] * (len(BOUNDS[name]) + 1))
        buckets.counts[bisect_left(BOUNDS[name], value)] += 1
        buckets.sum += value

    # --- reading ----------------------------------------------------------------

    def gauges(self, now: float) -> dict[str, dict[Labels, float]]:
        """The gauges as of `now` (save lag grows between events).

        Safe to call from another thread (Prometheus scrapes from its own): the
        fold's dicts are copied first, under the fold's lock, since iterating
        them while the event loop adds a sandbox or ends a task raises
        "dictionary changed size during iteration"."""
        with self._lock:
            sandboxes = tuple(self.sandboxes.items())
            hosts = tuple(self.hosts.values())
            tasks = tuple(self.tasks.values())
            position, deleted = self.position, self.deleted
        phases: dict[Labels, float] = {labels(phase="deleted"): deleted} if deleted else {}
        lag: dict[Labels, float] = {}
        for sid, state in sandboxes:
            key = labels(phase=state.phase)
            phases[key] = phases.get(key, 0) + 1
            if state.phase == "running":
                lag[labels(sandbox=sid)] = max(0.0, now - _files_as_of(state, now))
        statuses: dict[Labels, float] = {}
        for host in hosts:
            key = labels(status=host.status)
            statuses[key] = statuses.get(key, 0) + 1
        return {
            "tasks_active": {(): len(tasks)},
            "tasks_running": {(): sum(1 for t in tasks if t.state == "running")},
            "sandhold_sandboxes": phases,
            "sandhold_save_lag_seconds": lag,
            "sandhold_hosts": statuses,
            "sandhold_log_position": {(): position},
        }

    def counter_series(self, name: str) -> list[tuple[Labels, float]]:
        """A counter's series, copied (safe from another thread, like `gauges`)."""
        with self._lock:
            return list(self.counters[name].items())

    def histogram_series(self, name: str) -> list[tuple[Labels, list[int], float]]:
        """A histogram's series (cumulative counts per bound and +Inf, sum),
        copied (safe from another thread, like `gauges`)."""
        with self._lock:
            return [(k, b.cumulative(), b.sum) for k, b in self.histograms[name].items()]

    def total(self, name: str, **pairs: str) -> float:
        """A counter summed over every series whose labels include `pairs`."""
        wanted = set(pairs.items())
        return sum(v for k, v in self.counters[name].items() if wanted <= set(k))


# --- a checkpoint of the fold (the metrics service's bounded start) -----------------


class _Series(msgspec.Struct, array_like=True):
    labels: Labels
    value: float


class _Histogram(msgspec.Struct, array_like=True):
    labels: Labels
    buckets: Buckets


class _Kept(msgspec.Struct, kw_only=True):
    """A `LogMetrics` as written by `dump`: everything its numbers come from.
    The states are encoded apart (`Raw`): decoded into their wire twins."""

    position: int
    last_event_id: str
    counters: dict[str, list[_Series]]
    histograms: dict[str, list[_Histogram]]
    samples: dict[str, list[float]]
    deleted: int
    recovering_since: dict[str, float]
    sandboxes: msgspec.Raw
    hosts: msgspec.Raw
    tasks: msgspec.Raw


_encoder = msgspec.msgpack.Encoder(enc_hook=pmap.enc_hook)


def dump(folded: LogMetrics) -> bytes:
    """The fold's state, to be `load`ed in another process: what a restart of
    the metrics service starts from instead of the first event (its histograms
    are the fold's own numbers, not an exporter's, decision 062)."""
    kept = _Kept(
        position=folded.position,
        last_event_id=folded.last_event_id,
        counters={n: [_Series(k, v) for k, v in s.items()] for n, s in folded.counters.items()},
        histograms={
            n: [_Histogram(k, b) for k, b in s.items()] for n, s in folded.histograms.items()
        },
        samples={n: list(d) for n, d in folded.samples.items()},
        deleted=folded.deleted,
        recovering_since=dict(folded._recovering_since),
        sandboxes=msgspec.Raw(_encoder.encode(folded.sandboxes)),
        hosts=msgspec.Raw(_encoder.encode(folded.hosts)),
        tasks=msgspec.Raw(_encoder.encode(folded.tasks)),
    )
    return _encoder.encode(kept)


def _states(raw: msgspec.Raw, state_type: Any) -> dict[str, Any]:
    decoded = msgspec.msgpack.decode(raw, type=dict[str, pmap.wire(state_type)])  # type: ignore[misc]
    return {key: pmap.from_wire(value) for key, value in decoded.items()}


def load(data: bytes, *, keep_samples: int = 10_000) -> LogMetrics:
    """A `LogMetrics` as `dump` wrote it (`msgspec.DecodeError` or
    `ValidationError` when it is not one)."""
    kept = msgspec.msgpack.decode(data, type=_Kept)
    folded = LogMetrics(keep_samples=keep_samples)
    folded.position, folded.last_event_id = kept.position, kept.last_event_id
    for name, series in kept.counters.items():
        folded.counters[name] = {s.labels: s.value for s in series}
    for name, hseries in kept.histograms.items():
        folded.histograms[name] = {h.labels: h.buckets for h in hseries}
    for name, values in kept.samples.items():
        folded.samples[name].extend(values)
    folded.deleted = kept.deleted
    folded._recovering_since = dict(kept.recovering_since)
    folded.sandboxes = _states(kept.sandboxes, sb.Sandbox)
    folded.hosts = _states(kept.hosts, host_domain.Host)
    folded.tasks = _states(kept.tasks, tk.Task)
    return folded


def _files_as_of(state: sb.Sandbox, now: float) -> float:
    """When the files a restore would bring back were captured (RPO's start); a
    quiet save's hold them until their first change (`now` while none, decision 051)."""
    latest = state.last_completed_save
    if latest is not None:
        # (Or a later capture that found them unchanged, decision 067.)
        captured = sv.holds_as_of(latest) or latest.requested_at
        held = sb.held_until(latest, state, now=now)
        return captured if held is None else max(captured, held)
    return state.running_since or state.created_at


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
