"""Replay the checked-in task logs, so a change that breaks old task logs fails loudly.

`golden/task_v1.jsonl` was written once by driving the task deciders (four
tasks: completed with a retried clone and a retried tool step, cancelled after
a hang warning, timed out, failed on a bad ref) and is never regenerated; it
predates driver claims. `golden/task_v2.jsonl` adds them: one task claimed by
`orchestrator-1`, taken over by `orchestrator-2` mid-step, completed.
`golden/task_v3.jsonl` adds `task.released` (decision 071): one task failed
in staging, then released.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from sandhold.domain import task as tk
from sandhold.domain.envelope import Envelope
from sandhold.domain.fold import fold
from sandhold.domain.task_manifest import TaskManifest

GOLDEN = Path(__file__).parent / "golden" / "task_v1.jsonl"
GOLDEN_V2 = GOLDEN.with_name("task_v2.jsonl")
GOLDEN_V3 = GOLDEN.with_name("task_v3.jsonl")
E = "tk-c0e50b8effcff29f"
A, B, C, D = (
    "tk-8bd4c5c6bcb98df5",
    "tk-a934a780c39c950c",
    "tk-1c13b85c7a934d7a",
    "tk-57d4573126d7f590",
)


@pytest.fixture(scope="module")
def tasks() -> dict[str, tk.Task]:
    envelopes = [msgspec.json.decode(x, type=Envelope) for x in GOLDEN.read_bytes().splitlines()]
    states = {}
    for task_id in (A, B, C, D):
        state = fold(tk.evolve, [e for e in envelopes if e.aggregate_id == task_id], None)
        assert state is not None
        states[task_id] = state
    return states


def test_the_task_ids_still_follow_from_the_keys() -> None:
    assert [tk.task_id_for("acme", f"golden-{k}") for k in "abcd"] == [A, B, C, D]


def test_a_completed_task_keeps_its_ledger(tasks: dict[str, tk.Task]) -> None:
    a = tasks[A]
    assert (a.state, a.commit, a.sandbox_id) == ("completed", "a" * 40, "sb-00000000000000aa")
    assert a.manifest.timeouts.task == 7200.0 and a.manifest.steps[0].agent.timeout == 600.0
    assert [(x.operation, x.attempt, x.retry_at is not None) for x in a.attempts] == [
        ("clone", 1, True),
        ("notify", 1, True),
    ]
    build, notify = a.steps["build"], a.steps["notify"]
    assert (build.status, build.output, build.command_id) == (
        "finished",
        "built 3 files\n",
        "cmd-00000000000000b1",
    )
    assert (notify.status, notify.attempt, notify.http_status) == ("finished", 2, 200)
    assert tk.outputs(a) == {"build": "built 3 files\n", "notify": "ok"}
    assert [x.path for x in a.artifacts] == ["dist/app.tar"]
    assert a.final_save_id == "sv-00000000000000a3"


def test_the_other_endings_replay(tasks: dict[str, tk.Task]) -> None:
    b, c, d = tasks[B], tasks[C], tasks[D]
    assert (b.state, b.cancel_requested, b.hang_warnings) == ("cancelled", True, 1)
    assert b.steps["agent"].hang_warned and b.steps["agent"].reason == "cancelled"
    assert "stop-b" in b.requests
    assert (c.state, c.failed_stage) == ("timed_out", "provisioning")
    assert (d.state, d.reason, d.failed_stage) == ("failed", "clone_ref_not_found", "staging")
    assert d.attempts[0].error_class == "permanent" and d.attempts[0].retry_at is None


def test_a_recorded_manifest_outside_todays_rules_still_replays() -> None:
    # Rules for new manifests tighten; what was accepted stays readable. A newer
    # writer's extra field is skipped like any unknown event field.
    first = msgspec.json.decode(GOLDEN.read_bytes().splitlines()[0])
    manifest = first["event"]["manifest"]
    manifest.update(name="Not A Valid Name Today", priority=5)
    manifest["repository"] = {"url": "file:///srv/app.git", "ref": "-weird", "mirror": True}
    manifest["retry"]["network"] = 99
    envelope = msgspec.json.decode(msgspec.json.encode(first), type=Envelope)
    state = tk.evolve(None, envelope)
    assert state is not None and state.state == "pending"
    assert state.manifest.name == "Not A Valid Name Today"
    assert state.manifest.repository is not None
    assert state.manifest.repository.url == "file:///srv/app.git"
    assert state.manifest.retry.network == 99
    with pytest.raises(msgspec.ValidationError):  # a new request is still held to the rules
        msgspec.convert(manifest, TaskManifest)


def test_a_log_from_before_driver_claims_has_no_driver(tasks: dict[str, tk.Task]) -> None:
    assert all((t.driver, t.driver_epoch) == (None, 0) for t in tasks.values())


def test_a_task_handed_over_between_instances_replays() -> None:
    envelopes = [msgspec.json.decode(x, type=Envelope) for x in GOLDEN_V2.read_bytes().splitlines()]
    assert tk.task_id_for("acme", "golden-e") == E
    e = fold(tk.evolve, envelopes, None)
    assert e is not None
    assert (e.state, e.driver, e.driver_epoch) == ("completed", "orchestrator-2", 2)
    assert tk.outputs(e) == {"build": "built\n", "notify": "ok"}
    assert e.final_save_id == "sv-00000000000000e2"
    # Each epoch's events were written by the instance whose claim opened it.
    driver = None
    for envelope in envelopes:
        if envelope.type == "task.driver_claimed":
            driver = envelope.actor
        elif envelope.type != "task.submitted":
            assert envelope.actor == driver


def test_a_log_from_before_releases_has_nothing_released(tasks: dict[str, tk.Task]) -> None:
    # Ended, not released: an orchestrator releases them when it starts.
    assert all(t.terminal and not t.released for t in tasks.values())
    assert not any(tk.forgettable(t) for t in tasks.values())


def test_a_released_task_replays_released() -> None:
    envelopes = [msgspec.json.decode(x, type=Envelope) for x in GOLDEN_V3.read_bytes().splitlines()]
    assert tk.task_id_for("acme", "golden-f") == envelopes[0].aggregate_id
    f = fold(tk.evolve, envelopes, None)
    assert f is not None
    assert (f.state, f.reason, f.failed_stage) == ("failed", "clone_ref_not_found", "staging")
    assert f.released and tk.forgettable(f)
    assert tk.release(f) == []


def test_a_submit_retried_across_upgrades_keeps_its_digest() -> None:
    """The same manifest submitted again after a field was added (decision 074's
    `sandbox.keep_stopped`, at its default) is the same request, not a conflict."""
    for line in GOLDEN.read_bytes().splitlines():
        envelope = msgspec.json.decode(line, type=Envelope)
        event = envelope.event
        if not isinstance(event, tk.ev.TaskSubmitted):
            continue
        # The manifest as a client of then sent it (the log's JSON has no such field).
        raw = msgspec.json.decode(line)["event"]["manifest"]
        assert "keep_stopped" not in raw["sandbox"]
        manifest = msgspec.convert(raw, TaskManifest)
        assert manifest.sandbox.keep_stopped == 7 * 86400.0  # today's default
        retried = tk.SubmitTask(key=event.request_key, tenant=event.tenant, manifest=manifest)
        assert tk.task_request_digest(retried) == event.request_digest
        kept = msgspec.structs.replace(
            manifest, sandbox=msgspec.structs.replace(manifest.sandbox, keep_stopped=None)
        )
        other = tk.SubmitTask(key=event.request_key, tenant=event.tenant, manifest=kept)
        assert tk.task_request_digest(other) != event.request_digest  # asks for more
