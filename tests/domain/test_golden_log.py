"""Replay a checked-in event log, so a change that breaks old logs fails loudly.

`golden/sandbox_v1.jsonl` was written once by driving the real deciders and is
never regenerated: if this test fails, the change broke logs already on disk.
Keep the file; make the change compatible (a default for a new field, or a new
tag and an upcaster) and add a `_v2` log next to it if the new shape needs one.

The log is a slice of the EVENTS stream: one sandbox's life (two placements, four
commands, every event type) interleaved with two host registrations. Some lines
are deliberately not what today's encoder writes: a newer writer's extra fields
(in an event and in an envelope) and an older writer's missing defaulted fields.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from sandhold.domain import events as ev
from sandhold.domain import requests as rq
from sandhold.domain.envelope import Envelope
from sandhold.domain.fold import fold
from sandhold.domain.host import Host
from sandhold.domain.host import evolve as evolve_host
from sandhold.domain.sandbox import Sandbox, evolve
from sandhold.domain.views import sandbox_view

GOLDEN = Path(__file__).parent / "golden" / "sandbox_v1.jsonl"
DECODER = msgspec.json.Decoder(Envelope)

T0 = 1_700_000_000.0
TENANT = "acme"
SID = "sb-88b946ae2134cc58"
BUILD = "cmd-250c7b5afc3fd923"
SERVE = "cmd-6e9de978700239f1"
MISSING = "cmd-faee333b07eac915"
QUEUED = "cmd-8fb4d0ef36173e74"
MiB = 1024 * 1024
GiB = 1024 * MiB


def at(step: int) -> float:
    """The time the log's writer gave the envelopes of its `step`."""
    return T0 + step * 1.25


@pytest.fixture(scope="module")
def envelopes() -> list[Envelope]:
    return [DECODER.decode(line) for line in GOLDEN.read_bytes().splitlines()]


@pytest.fixture(scope="module")
def sandbox(envelopes: list[Envelope]) -> Sandbox:
    state = fold(evolve, [e for e in envelopes if e.aggregate_id == SID], None)
    assert state is not None
    return state


def test_the_ids_still_follow_from_the_keys() -> None:
    # A retry after an upgrade must find the sandbox and commands it made before.
    assert rq.sandbox_id_for(TENANT, "golden-create") == SID
    assert [rq.command_id_for(SID, key) for key in ("run-build", "run-serve", "run-missing")] == [
        BUILD,
        SERVE,
        MISSING,
    ]
    assert rq.command_id_for(SID, "run-queued") == QUEUED


def test_the_golden_logs_hold_every_event_type(envelopes: list[Envelope]) -> None:
    # v1 holds the first release's types; each later file adds the types it introduced.
    every_tag = {t.__struct_config__.tag for t in ev.AnyEvent.__args__}  # type: ignore[attr-defined]
    later = [
        msgspec.json.decode(line, type=Envelope)
        for path in sorted(GOLDEN.parent.glob("*_v*.jsonl"))
        if path != GOLDEN
        for line in path.read_bytes().splitlines()
    ]
    assert {e.type for e in [*envelopes, *later]} == every_tag


def test_v2_request_noted_takes_its_key() -> None:
    lines = (GOLDEN.parent / "sandbox_v2.jsonl").read_bytes().splitlines()
    state = fold(evolve, (msgspec.json.decode(x, type=Envelope) for x in lines), None)
    assert state is not None and state.phase == "running"
    assert "start-again" in state.requests and "snap-1" in state.requests
    assert (state.save_interval_s, state.stop_deadline_s) == (10.0, 30.0)
    states = {s.kind: s.state for s in state.saves.values() if s.state != "expired"}
    assert states == {"snapshot": "completed", "scheduled": "failed"}
    latest = state.last_completed_save
    assert latest is not None and latest.snapshot_name == "milestone"
    assert sorted(s.state for s in state.saves.values()) == ["completed", "expired", "failed"]


def test_the_envelopes_decode_with_their_metadata(envelopes: list[Envelope]) -> None:
    assert len(envelopes) == 27
    first_sandbox_envelope = envelopes[1]
    assert first_sandbox_envelope == Envelope(
        id=f"{SID}:g1:0",
        aggregate_id=SID,
        time=at(1),
        actor="client",
        causation_id="golden-create",
        correlation_id="corr-golden-create",
        event=ev.SandboxCreated(
            sandbox_id=SID,
            request_key="golden-create",
            request_digest="c90ef123692a091268cfeb4537c4808e",
            memory_limit_bytes=256 * MiB,
            tenant=TENANT,
        ),
        trace_id="trace-create",
    )
    assert len({e.id for e in envelopes}) == len(envelopes), "ids stay unique (Nats-Msg-Id)"


def test_fields_a_newer_writer_added_are_skipped(envelopes: list[Envelope]) -> None:
    raw = [msgspec.json.decode(line) for line in GOLDEN.read_bytes().splitlines()]
    assert "duration_s" in raw[12]["event"] and "span_id" in raw[4]
    assert envelopes[12].event == ev.CommandEnded(
        command_id=BUILD,
        state="exited",
        exit_code=0,
        host="host-a",
        generation=1,
        output_kept={"stdout": 2048, "stderr": 12},
    )
    assert envelopes[4].type == "sandbox.started"


def test_fields_an_older_writer_left_out_take_their_defaults(envelopes: list[Envelope]) -> None:
    raw = [msgspec.json.decode(line) for line in GOLDEN.read_bytes().splitlines()]
    assert "cwd" not in raw[17]["event"] and "trace_id" not in raw[20]
    assert envelopes[17].event == ev.CommandQueued(
        command_id=QUEUED,
        request_key="run-queued",
        request_digest="1b4e874500d3028a029868db2fc9dde1",
        argv=["sleep", "1"],
    )
    assert envelopes[20].trace_id is None


def test_each_prefix_replays_to_the_phase_it_had(envelopes: list[Envelope]) -> None:
    phases = []
    state: Sandbox | None = None
    for envelope in (e for e in envelopes if e.aggregate_id == SID):
        state = evolve(state, envelope)
        assert state is not None
        phases.append(state.phase)
    assert phases == [
        "pending",  # created
        "placed",
        "starting",
        "running",  # started
        *["running"] * 13,  # commands queued, dispatched, started, cancelled, ended
        "stopping",  # stop requested
        "stopping",  # the queued command not launched
        "stopped",
        "pending",  # start requested
        "placed",  # on host-b, generation 2
        "failed",
        "failed",  # delete requested
        "deleted",
    ]


def test_the_sandbox_replays_field_by_field(sandbox: Sandbox) -> None:
    assert sandbox.id == SID
    assert sandbox.tenant == TENANT
    assert sandbox.phase == "deleted"
    assert sandbox.created_at == at(1)
    assert sandbox.memory_limit_bytes == 256 * MiB
    assert sandbox.host == "host-b"
    assert sandbox.generation == 2
    assert sandbox.reason == "image pull failed"
    assert sandbox.delete_requested is True
    assert sandbox.capabilities == {"runtime": "runc", "net": "none"}
    assert list(sandbox.commands) == [BUILD, SERVE, MISSING, QUEUED]
    assert sandbox_view(sandbox, now=sandbox.created_at).commands == {
        "exited": 1,
        "interrupted": 1,
        "launch_failed": 1,
        "not_launched": 1,
    }


def test_the_recorded_keys_still_match_the_requests_that_made_them(sandbox: Sandbox) -> None:
    # If the digest changed, retrying any of these requests after an upgrade would be
    # refused as an idempotency conflict.
    requests: list[rq.AnyRequest] = [
        rq.CreateSandbox(key="golden-create", tenant=TENANT, memory_limit_bytes=256 * MiB),
        rq.RunCommand(
            key="run-build",
            tenant=TENANT,
            sandbox_id=SID,
            argv=["make", "build"],
            cwd="/work",
            env={"CI": "1"},
            timeout_s=600.0,
            kill_grace_s=10.0,
        ),
        rq.RunCommand(
            key="run-serve", tenant=TENANT, sandbox_id=SID, argv=["python", "-m", "http.server"]
        ),
        rq.RunCommand(key="run-missing", tenant=TENANT, sandbox_id=SID, argv=["no-such-tool"]),
        rq.CancelCommand(key="cancel-serve", tenant=TENANT, sandbox_id=SID, command_id=SERVE),
        rq.RunCommand(key="run-queued", tenant=TENANT, sandbox_id=SID, argv=["sleep", "1"]),
        rq.StopSandbox(key="stop-1", tenant=TENANT, sandbox_id=SID),
        rq.StartSandbox(key="start-2", tenant=TENANT, sandbox_id=SID),
        rq.DeleteSandbox(key="delete-1", tenant=TENANT, sandbox_id=SID),
    ]
    assert sandbox.requests == {r.key: rq.request_digest(r) for r in requests}


def test_a_command_that_ran_and_exited(sandbox: Sandbox) -> None:
    build = sandbox.commands[BUILD]
    assert build.state == "exited"
    assert build.exit_code == 0
    assert build.argv == ["make", "build"]
    assert build.request_key == "run-build"
    assert (build.cwd, build.env, build.timeout_s, build.kill_grace_s) == (
        "/work",
        {"CI": "1"},
        600.0,
        10.0,
    )
    assert (build.host, build.generation, build.pid) == ("host-a", 1, 101)
    assert build.reason == ""
    assert build.cancel_requested is False
    assert build.output_kept == {"stdout": 2048, "stderr": 12}
    assert build.output_complete is True
    assert (build.queued_at, build.ended_at) == (at(5), at(10))


def test_a_command_cancelled_while_it_ran(sandbox: Sandbox) -> None:
    serve = sandbox.commands[SERVE]
    assert serve.state == "interrupted"
    assert serve.exit_code is None
    assert serve.argv == ["python", "-m", "http.server"]
    assert (serve.cwd, serve.env, serve.timeout_s, serve.kill_grace_s) == (None, {}, None, 5.0)
    assert (serve.host, serve.generation, serve.pid) == ("host-a", 1, 102)
    assert serve.reason == "cancelled"
    assert serve.cancel_requested is True
    assert serve.output_kept == {"stdout": 100, "stderr": 0}
    assert serve.output_complete is False
    assert (serve.queued_at, serve.ended_at) == (at(6), at(13))


def test_a_command_that_could_not_start(sandbox: Sandbox) -> None:
    missing = sandbox.commands[MISSING]
    assert missing.state == "launch_failed"
    assert missing.exit_code is None
    assert missing.reason == "executable not found"
    assert (missing.host, missing.generation, missing.pid) == ("host-a", 1, None)
    assert missing.cancel_requested is False
    assert (missing.output_kept, missing.output_complete) == ({}, True)
    assert (missing.queued_at, missing.ended_at) == (at(7), at(14))


def test_a_command_the_stop_overtook(sandbox: Sandbox) -> None:
    queued = sandbox.commands[QUEUED]
    assert queued.state == "not_launched"
    assert queued.argv == ["sleep", "1"]
    assert (queued.cwd, queued.env, queued.timeout_s, queued.kill_grace_s) == (None, {}, None, 5.0)
    assert queued.reason == "the sandbox was stopping before it started"
    assert (queued.host, queued.generation, queued.pid, queued.exit_code) == (None, 0, None, None)
    assert (queued.queued_at, queued.ended_at) == (at(15), at(17))


def test_the_hosts_replay(envelopes: list[Envelope]) -> None:
    host_a = fold(evolve_host, [e for e in envelopes if e.aggregate_id == "host-a"], None)
    host_b = fold(evolve_host, [e for e in envelopes if e.aggregate_id == "host-b"], None)
    assert host_a == Host(
        host="host-a",
        epoch=1,
        capacity_sandboxes=8,
        memory_bytes=16 * GiB,
        registered_at=at(0),
        capabilities={"runtime": "runc"},
    )
    assert host_b == Host(
        host="host-b", epoch=3, capacity_sandboxes=4, memory_bytes=8 * GiB, registered_at=at(20)
    )


def test_v3_a_host_failure_and_its_recovery_replay() -> None:
    lines = (GOLDEN.parent / "sandbox_v3.jsonl").read_bytes().splitlines()
    envelopes = [msgspec.json.decode(x, type=Envelope) for x in lines]
    sandbox = fold(evolve, (e for e in envelopes if e.aggregate_id.startswith("sb-")), None)
    assert sandbox is not None
    assert (sandbox.phase, sandbox.host, sandbox.generation) == ("running", "host-b", 2)
    assert sandbox.lost is None
    assert sandbox.recovered_from is not None
    assert (sandbox.recovered_from.source, sandbox.recovered_from.lost_host) == (
        "base image",
        "host-a",
    )
    [command] = sandbox.commands.values()
    assert (command.state, command.output_complete) == ("infrastructure_lost", False)
    host = fold(evolve_host, (e for e in envelopes if e.aggregate_id == "host-a"), None)
    assert host is not None and (host.status, host.fence_at) == ("fenced", 1700000207.0)


def test_v4_connections_set_delivered_dropped_and_removed_replay() -> None:
    lines = (GOLDEN.parent / "sandbox_v4.jsonl").read_bytes().splitlines()
    envelopes = [msgspec.json.decode(x, type=Envelope) for x in lines]
    sandbox = fold(evolve, envelopes, None)
    assert sandbox is not None and sandbox.phase == "running"
    assert list(sandbox.connections) == ["github"]
    assert sandbox.connections["github"].size == 16
    assert (sandbox.connections_revision, sandbox.connections_delivered) == (3, 3)
    assert {"v4-set-github", "v4-set-npm", "v4-rm-npm"} <= set(sandbox.requests)
    assert b"never-in-the-log" not in b"".join(lines)


def test_v5_a_waiting_sandbox_says_why_until_it_is_placed() -> None:
    lines = (GOLDEN.parent / "sandbox_v5.jsonl").read_bytes().splitlines()
    envelopes = [msgspec.json.decode(x, type=Envelope) for x in lines]
    waiting = fold(evolve, envelopes[:3], None)
    assert waiting is not None and waiting.phase == "pending"
    assert waiting.reason == "no host is live (1 registered, none renewing its lease)"
    placed = fold(evolve, envelopes, None)
    assert placed is not None and (placed.phase, placed.reason) == ("placed", "")


def test_v6_an_idle_sandbox_is_reaped_and_a_command_starts_it_again_cold() -> None:
    from sandhold.domain.views import cold_start_of

    lines = (GOLDEN.parent / "sandbox_v6.jsonl").read_bytes().splitlines()
    envelopes = [msgspec.json.decode(x, type=Envelope) for x in lines]
    touched = fold(evolve, envelopes[:5], None)
    assert touched is not None and touched.idle_timeout_s == 60.0
    assert touched.last_active_at == envelopes[4].time  # the touch
    reaped = fold(evolve, envelopes[:10], None)
    assert reaped is not None and (reaped.phase, reaped.reason) == ("stopped", "idle")
    assert reaped.saves[reaped.final_save_id or ""].state == "completed"
    woken = fold(evolve, envelopes, None)
    assert woken is not None and (woken.phase, woken.host, woken.generation) == (
        "running",
        "host-b",
        2,
    )
    [command] = woken.commands.values()
    assert command.cold and command.state == "queued"
    cold = cold_start_of(woken, command.id)
    assert cold is not None and cold.from_save == reaped.final_save_id
    assert (cold.start_ms, cold.restore_ms, cold.bytes_fetched) == (1500.0, 120.5, 10)


def test_v7_a_scheduled_save_that_found_nothing_changed_replays() -> None:
    """Decision 067: `save.unchanged` ends a scheduled save, and its parent holds
    the files as of that capture."""
    from sandhold.domain.sandbox import saved_until, unchanged_since

    lines = (GOLDEN.parent / "sandbox_v7.jsonl").read_bytes().splitlines()
    envelopes = [msgspec.json.decode(x, type=Envelope) for x in lines]
    sandbox = fold(evolve, envelopes, None)
    assert sandbox is not None and sandbox.phase == "running"
    parent, skipped = sandbox.saves["sv-7a1b2c3d4e5f6071"], sandbox.saves["sv-8b2c3d4e5f607182"]
    assert (parent.state, skipped.state) == ("completed", "unchanged")
    assert parent.confirmed_at == envelopes[-1].time and parent.quiet
    assert unchanged_since(sandbox) == parent
    assert saved_until(sandbox, now=envelopes[-1].time + 500) == envelopes[-1].time + 500


def test_v8_a_deleted_snapshot_and_a_loss_of_files_replay() -> None:
    """Decision 069: `snapshot.deleted` makes the Snapshot a save like the
    others; `sandbox.lost` says whether only the sandbox's files went."""
    lines = (GOLDEN.parent / "sandbox_v8.jsonl").read_bytes().splitlines()
    envelopes = [msgspec.json.decode(x, type=Envelope) for x in lines]
    sandbox = fold(evolve, envelopes, None)
    assert sandbox is not None and sandbox.phase == "lost"
    record = sandbox.saves["sv-9c0d1e2f3a4b5c6d"]
    assert (record.kind, record.snapshot_name, record.state) == ("scheduled", None, "completed")
    assert sandbox.snapshot_ids == () and sandbox.last_completed_save == record
    assert {"v8-snap", "v8-unsnap"} <= set(sandbox.requests)
    assert sandbox.lost is not None and sandbox.lost.cause == "files_gone"


def test_v9_a_sandbox_kept_stopped_then_deleted_replays() -> None:
    """Decision 074: `keep_stopped_s` on the create, and the saver's Delete once
    the sandbox was stopped that long (`reason` on `sandbox.delete_requested`)."""
    from sandhold.domain.sandbox import deletes_at

    lines = (GOLDEN.parent / "sandbox_v9.jsonl").read_bytes().splitlines()
    envelopes = [msgspec.json.decode(x, type=Envelope) for x in lines]
    kept = fold(evolve, envelopes[:6], None)
    assert kept is not None and kept.phase == "stopped" and kept.keep_stopped_s == 86400.0
    assert deletes_at(kept) == envelopes[5].time + 86400.0 == envelopes[6].time
    sandbox = fold(evolve, envelopes, None)
    assert sandbox is not None and (sandbox.phase, sandbox.reason) == ("deleted", "kept_stopped")


def test_v10_a_command_ended_at_once_has_no_start_and_its_end_names_the_pid() -> None:
    """Decision 095: a command that ended within moments of its start has only
    `command.ended`, which carries its pid; one that ran longer has both."""
    lines = (GOLDEN.parent / "sandbox_v10.jsonl").read_bytes().splitlines()
    envelopes = [msgspec.json.decode(x, type=Envelope) for x in lines]
    sandbox = fold(evolve, envelopes, None)
    assert sandbox is not None and sandbox.phase == "running"
    short, long = sandbox.commands["cmd-428071360e9b42c8"], sandbox.commands["cmd-ec1fee7c6b809d7b"]
    assert (short.state, short.exit_code, short.pid) == ("exited", 0, 4242)
    assert short.started_at is None and short.ended_at == envelopes[6].time
    assert (long.state, long.pid, long.started_at) == ("exited", 4343, envelopes[9].time)


def test_v11_a_command_run_on_a_running_sandbox_is_dispatched_by_its_queuing() -> None:
    """Decision 098: `command.queued` carries `dispatched_to` where the sandbox
    could take the command at once; one queued before it ran is dispatched by a
    `command.dispatched` of its own, as before."""
    lines = (GOLDEN.parent / "sandbox_v11.jsonl").read_bytes().splitlines()
    envelopes = [msgspec.json.decode(x, type=Envelope) for x in lines]
    sandbox = fold(evolve, envelopes, None)
    assert sandbox is not None and sandbox.phase == "running"
    early, late = sandbox.commands["cmd-c9eb28d4cb52fa7c"], sandbox.commands["cmd-57407c105e6f551d"]
    assert (early.state, early.host, early.generation, early.pid) == ("running", "host-a", 1, 4646)
    assert (late.state, late.host, late.generation, late.pid) == ("exited", "host-a", 1, 4545)
    queued = envelopes[6].event
    assert isinstance(queued, ev.CommandQueued)
    assert queued.dispatched_to == ev.Dispatch(host="host-a", generation=1)
    # Folded up to its queuing, the command is dispatched there, never queued.
    before_end = fold(evolve, envelopes[:7], None)
    assert before_end is not None
    assert before_end.commands[late.id].state == "dispatched"
    assert before_end.queued == ()
