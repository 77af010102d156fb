"""The log-derived metrics fold, given events: counts per label, histogram
values from envelope times, and the same numbers from any replay of the log."""

from __future__ import annotations

from hypothesis import given
from sandhold.bus.codec import decode_envelope, encode_envelope
from sandhold.domain import events as ev
from sandhold.domain.envelope import Envelope, wrap
from sandhold.domain.sandbox import compact
from sandhold.domain.task_manifest import load_manifest
from sandhold.telemetry.log_metrics import BOUNDS, LogMetrics, dump, labels, load

from tests.domain import test_fold_property as fp
from tests.domain.history import (
    DELETED,
    RUNNING,
    SID,
    command_ended,
    deleted,
    dispatched,
    envelopes_for,
    run,
)

MANIFEST = load_manifest({"name": "t", "agent": {"command": ["true"]}})


class Log:
    """Envelopes in log order, each at a given time."""

    def __init__(self) -> None:
        self.envelopes: list[Envelope] = []

    def add(self, aggregate_id: str, at: float, *events: ev.AnyEvent) -> None:
        self.envelopes += wrap(
            list(events),
            aggregate_id=aggregate_id,
            id_base=f"t{len(self.envelopes)}",
            actor="test",
            causation_id="c",
            correlation_id="c",
            time=at,
        )

    def folded(self, upto: int | None = None) -> LogMetrics:
        metrics = LogMetrics()
        for seq, envelope in enumerate(self.envelopes[:upto], start=1):
            metrics.apply(seq, envelope)
        return metrics


def task(log: Log, task_id: str, at: float, *rest: tuple[float, ev.AnyEvent]) -> None:
    log.add(
        task_id,
        at,
        ev.TaskSubmitted(
            task_id=task_id, request_key=task_id, request_digest="d", manifest=MANIFEST
        ),
    )
    for when, event in rest:
        log.add(task_id, when, event)


def scripted() -> Log:
    log = Log()
    task(
        log,
        "ok",
        100.0,
        (101.0, ev.TaskStageEntered(stage="staging")),
        (105.0, ev.TaskStageEntered(stage="running")),
        (110.0, ev.TaskCompleted()),
    )
    task(
        log,
        "bad",
        100.0,
        (102.0, ev.TaskStageEntered(stage="running")),
        (103.0, ev.TaskHangWarned(step_id="agent", command_id="c1", silent_s=1.0)),
        (130.0, ev.TaskFailed(reason="exit_code")),
    )
    task(log, "slow", 100.0, (104.0, ev.TaskStageEntered(stage="running")))
    task(log, "waiting", 100.0)
    return log


def test_tasks_are_counted_by_end_status_with_durations_from_envelope_times() -> None:
    metrics = scripted().folded()
    assert metrics.total("tasks_submitted_total") == 4
    assert metrics.counters["tasks_completed_total"] == {
        labels(status="completed"): 1,
        labels(status="failed"): 1,
    }
    assert sorted(metrics.samples["task_duration_seconds"]) == [10.0, 30.0]
    assert metrics.total("task_hang_warnings_total") == 1
    gauges = metrics.gauges(now=200.0)
    assert gauges["tasks_active"] == {(): 2}
    assert gauges["tasks_running"] == {(): 1}


def test_histograms_count_every_value_once_in_its_bucket() -> None:
    log = scripted()
    log.add("ok-again", 100.0, ev.TaskSubmitted(
        task_id="ok-again", request_key="ok-again", request_digest="d", manifest=MANIFEST
    ))  # fmt: skip
    log.add("ok-again", 105.0, ev.TaskCompleted())  # 5 s: on a bound, counted in its bucket
    metrics = LogMetrics()
    for seq, envelope in enumerate(log.envelopes, start=1):
        metrics.apply(seq, envelope)
        metrics.apply(seq, envelope)  # a redelivery counts nothing twice
    series = dict((k, (c, total)) for k, c, total in metrics.histogram_series(
        "task_duration_seconds"
    ))  # fmt: skip
    bounds = BOUNDS["task_duration_seconds"]  # 1, 5, 15, 30, ...
    completed, completed_sum = series[labels(status="completed")]
    assert completed[: bounds.index(15) + 1] == [0, 1, 2] and completed[-1] == 2
    assert completed_sum == 15.0
    failed, failed_sum = series[labels(status="failed")]
    assert failed[bounds.index(15)] == 0 and failed[bounds.index(30)] == 1 and failed[-1] == 1
    assert failed_sum == 30.0 and len(failed) == len(bounds) + 1


def test_a_fold_loaded_from_its_dump_goes_on_as_the_whole_fold() -> None:
    """The metrics service's checkpoint (decision 062): cut anywhere, dumped and
    loaded in another process, then the rest folded: the same numbers, the
    histograms' buckets included, as folding everything in one go."""
    log = scripted()
    log.envelopes += commands_saves_hosts().envelopes
    log.envelopes += envelopes_for((*RUNNING, *DELETED))
    # As the log holds them (a manifest comes back as recorded, not as given).
    log.envelopes = [decode_envelope(encode_envelope(e)) for e in log.envelopes]
    whole = log.folded()
    for cut in range(len(log.envelopes) + 1):
        resumed = load(dump(log.folded(upto=cut)))
        assert resumed.position == cut
        for seq, envelope in enumerate(log.envelopes, start=1):
            resumed.apply(seq, envelope)
        assert resumed.counters == whole.counters
        assert {n: resumed.histogram_series(n) for n in BOUNDS} == {
            n: whole.histogram_series(n) for n in BOUNDS
        }
        assert resumed.samples == whole.samples
        assert resumed.gauges(now=500.0) == whole.gauges(now=500.0)
        assert (resumed.sandboxes, resumed.hosts, resumed.tasks, resumed.deleted) == (
            whole.sandboxes, whole.hosts, whole.tasks, whole.deleted,
        )  # fmt: skip
        assert (resumed.position, resumed.last_event_id) == (whole.position, whole.last_event_id)


def commands_saves_hosts() -> Log:
    log = Log()
    sid = "sb-1"
    log.add(sid, 1.0, ev.SandboxCreated(sandbox_id=sid, request_key="k", request_digest="d"))
    log.add(sid, 2.0, ev.SandboxPlaced(host="h1", generation=1))
    log.add(sid, 3.0, ev.SandboxStarted(host="h1", generation=1))
    for i, state in enumerate(["exited", "exited", "timed_out"]):
        log.add(sid, 4.0, ev.CommandEnded(command_id=f"c{i}", state=state))
    log.add(sid, 10.0, ev.SaveRequested(save_id="s1", kind="scheduled", host="h1", generation=1))
    log.add(
        sid,
        10.5,
        ev.SaveCaptured(
            save_id="s1", host="h1", generation=1, freeze_ms=25.0, freeze_method="cgroup"
        ),
    )
    log.add(
        sid,
        11.0,
        ev.SaveUploaded(
            save_id="s1",
            host="h1",
            generation=1,
            total_bytes=10,
            files=1,
            uploaded_bytes=4096,
            uploaded_chunks=1,
            manifest_bytes=100,
            duration_ms=5.0,
        ),
    )
    log.add(sid, 12.0, ev.SaveCompleted(save_id="s1", total_bytes=10, files=1))
    log.add(sid, 40.0, ev.SaveRequested(save_id="s2", kind="scheduled", host="h1", generation=1))
    log.add(sid, 41.0, ev.SaveFailed(save_id="s2", stage="upload", reason="disk full"))
    log.add(
        sid,
        42.0,
        ev.SaveRequested(save_id="s3", kind="scheduled", host="h1", generation=1, parent_id="s1"),
    )
    log.add(
        sid,
        42.5,
        ev.SaveUnchanged(
            save_id="s3", host="h1", generation=1, freeze_ms=5.0, freeze_method="cgroup"
        ),
    )
    log.add("h1", 1.0, ev.HostRegistered(host="h1", epoch=1, capacity_sandboxes=1, memory_bytes=1))
    log.add("h1", 50.0, ev.HostLost(host="h1", epoch=1, last_renewal_at=45.0, fence_at=52.0))
    log.add(sid, 50.0, ev.SandboxLost(host="h1", generation=1, last_renewal_at=45.0, fence_at=52.0))
    log.add(sid, 60.0, ev.SandboxRecoveryRequested(cause="command"))
    log.add(sid, 61.0, ev.SandboxPlaced(host="h2", generation=2, restore_save_id="s1"))
    log.add(sid, 63.5, ev.SandboxStarted(host="h2", generation=2))
    return log


def test_commands_saves_hosts_and_recovery() -> None:
    sid = "sb-1"
    log = commands_saves_hosts()
    metrics = log.folded()

    assert metrics.counters["sandhold_commands_ended_total"] == {
        labels(state="exited"): 2,
        labels(state="timed_out"): 1,
    }
    assert metrics.total("sandhold_saves_completed_total", kind="scheduled") == 1
    assert metrics.total("sandhold_save_failures_total", stage="upload") == 1
    assert list(metrics.samples["sandhold_save_duration_seconds"]) == [2.0]
    assert list(metrics.samples["sandhold_save_freeze_seconds"]) == [0.025, 0.005]
    assert metrics.total("sandhold_saves_unchanged_total") == 1
    assert metrics.total("sandhold_save_uploaded_bytes_total") == 4096
    assert metrics.total("sandhold_hosts_lost_total") == 1
    assert metrics.total("sandhold_sandboxes_lost_total") == 1
    assert list(metrics.samples["sandhold_recovery_seconds"]) == [3.5]
    gauges = metrics.gauges(now=100.0)
    # Running again, from the save whose files were captured at 10.5 and found
    # unchanged at 42.5 (decision 067): the files as of 42.5 are in it.
    assert gauges["sandhold_save_lag_seconds"] == {labels(sandbox=sid): 100.0 - 42.5}
    assert gauges["sandhold_hosts"] == {labels(status="lost"): 1}
    assert gauges["sandhold_sandboxes"] == {labels(phase="running"): 1}
    assert gauges["sandhold_log_position"] == {(): len(log.envelopes)}


def test_a_fold_resumed_after_a_redelivered_prefix_gives_the_same_numbers() -> None:
    log = scripted()
    whole = log.folded()
    resumed = log.folded(upto=4)
    # The task "ok" ended with the 4th event, nothing else had yet.
    assert resumed.counters["tasks_completed_total"] == {labels(status="completed"): 1}
    for seq, envelope in enumerate(log.envelopes, start=1):  # from the start again
        resumed.apply(seq, envelope)
    assert resumed.counters == whole.counters
    assert resumed.samples == whole.samples
    assert resumed.gauges(now=500.0) == whole.gauges(now=500.0)


def test_a_sandbox_unchanged_since_a_quiet_save_has_no_save_lag() -> None:
    """Decision 051: its files are still the save's, so the RPO gauge is 0 (an
    idle sandbox is saved once per placement, and a lag that climbed for ever
    would look like saves falling behind); a command starts the lag again."""
    log = Log()
    sid = "sb-1"
    log.add(sid, 1.0, ev.SandboxCreated(sandbox_id=sid, request_key="k", request_digest="d"))
    log.add(sid, 2.0, ev.SandboxPlaced(host="h1", generation=1))
    log.add(sid, 3.0, ev.SandboxStarted(host="h1", generation=1))
    log.add(sid, 10.0, ev.SaveRequested(save_id="s1", kind="scheduled", host="h1", generation=1))
    log.add(
        sid,
        10.5,
        ev.SaveCaptured(
            save_id="s1", host="h1", generation=1, freeze_ms=2.0, freeze_method="cgroup",
            quiet=True,
        ),
    )  # fmt: skip
    log.add(sid, 12.0, ev.SaveCompleted(save_id="s1", total_bytes=10, files=1))
    gauges = log.folded().gauges(now=5000.0)
    assert gauges["sandhold_save_lag_seconds"] == {labels(sandbox=sid): 0.0}
    log.add(sid, 4000.0, ev.CommandQueued(command_id="c1", argv=["true"], request_key="r",
                                          request_digest="d"))  # fmt: skip
    gauges = log.folded().gauges(now=5000.0)
    assert gauges["sandhold_save_lag_seconds"] == {labels(sandbox=sid): 1000.0}
    # Its end found the files unchanged (decision 078): no lag again, and counted;
    # a second end's word about a stale count is not taken, nor counted.
    log.add(sid, 4001.0, ev.CommandStarted(command_id="c1", host="h1", generation=1, pid=7))
    # (The count it looked at: moved by the start, the command's queueing and start.)
    log.add(sid, 4002.0, ev.CommandEnded(command_id="c1", state="exited", generation=1,
                                         files_of="s1", files_at=3))  # fmt: skip
    metrics = log.folded()
    assert metrics.gauges(now=5000.0)["sandhold_save_lag_seconds"] == {labels(sandbox=sid): 0.0}
    assert metrics.total("sandhold_commands_held_files_total") == 1
    log.add(sid, 4100.0, ev.CommandQueued(command_id="c2", argv=["true"], request_key="r2",
                                          request_digest="d"))  # fmt: skip
    log.add(sid, 4101.0, ev.CommandEnded(command_id="c2", state="exited", generation=1,
                                         files_of="s1", files_at=3))  # fmt: skip
    metrics = log.folded()
    assert metrics.gauges(now=5000.0)["sandhold_save_lag_seconds"] == {labels(sandbox=sid): 900.0}
    assert metrics.total("sandhold_commands_held_files_total") == 1


def test_the_fold_keeps_no_ended_command_and_counts_the_same() -> None:
    """Its sandboxes are compacted (decision 057): memory that grows with live
    work, not with every command ever run."""
    steps = [*RUNNING]
    for i in range(40):
        steps += [run(f"run-{i}"), dispatched(f"run-{i}"), command_ended(f"run-{i}")]
    metrics = LogMetrics()
    for seq, envelope in enumerate(envelopes_for([*steps, run("last")]), start=1):
        metrics.apply(seq, envelope)
    kept = metrics.sandboxes[SID]
    assert list(kept.commands) == [kept.unended_ids[0]], "only the one not ended"
    assert metrics.total("sandhold_commands_ended_total") == 40
    assert metrics.gauges(now=0.0)["sandhold_sandboxes"] == {labels(phase="running"): 1}


def test_a_deleted_sandbox_is_counted_not_kept() -> None:
    """Deleted is final: the fold counts it and keeps nothing of it, so memory and
    each scrape's pass go with the sandboxes that exist, not every one ever made;
    what a second writer appends after the end changes nothing."""
    late = deleted()  # a second report of the same end
    metrics = LogMetrics()
    for seq, envelope in enumerate(envelopes_for([*DELETED, late]), start=1):
        metrics.apply(seq, envelope)
    assert metrics.sandboxes == {}
    assert metrics.gauges(now=0.0)["sandhold_sandboxes"] == {labels(phase="deleted"): 1}
    # The same log replayed from any point of a redelivery counts it once.
    again = LogMetrics()
    envelopes = envelopes_for([*DELETED, late])
    for seq, envelope in [*enumerate(envelopes, start=1), *enumerate(envelopes, start=1)]:
        again.apply(seq, envelope)
    assert again.gauges(now=0.0)["sandhold_sandboxes"] == {labels(phase="deleted"): 1}


def test_an_ended_task_is_counted_not_kept() -> None:
    """A fold's memory goes with the tasks under way, not every task ever run:
    nothing of an ended task is in its dump, not even its id, and what another
    writer appends after an end changes no number."""

    def ended(n: int) -> LogMetrics:
        log = Log()
        for i in range(n):
            task(
                log,
                f"t-{i:03}",
                100.0,
                (101.0, ev.TaskStageEntered(stage="running")),
                (110.0, ev.TaskCompleted()),
                (111.0, ev.TaskFailed(reason="a second writer's late end")),
            )
        metrics = LogMetrics(keep_samples=4)
        for seq, envelope in enumerate(log.envelopes, start=1):
            metrics.apply(seq, envelope)
        return metrics

    folded = ended(60)
    assert folded.tasks == {}
    assert b"t-000" not in dump(folded)  # (the last event's id names the last one)
    assert folded.counters["tasks_completed_total"] == {labels(status="completed"): 60}
    assert folded.total("tasks_submitted_total") == 60
    assert load(dump(folded)).counters == folded.counters


@fp.SETTINGS
@given(fp.MEMORY_CHOICE, fp.LONG_STEPS)
def test_the_folds_sandbox_is_the_services_compacted_state_over_any_history(
    memory_n: int, steps: list[fp.Choice]
) -> None:
    """Every sandbox event reaches the fold (a new kind of event too, whatever
    its tag's prefix), so what it keeps of a sandbox is what each service keeps."""
    trace = fp.drive(memory_n, steps, fp.SAVES_MIX)
    metrics = LogMetrics()
    for seq, line in enumerate(trace.log, start=1):
        metrics.apply(seq, fp.DECODER.decode(line))
    whole = trace.state
    assert whole is not None
    expected = None if whole.phase == "deleted" else compact(whole)
    assert metrics.sandboxes.get(SID) == expected
