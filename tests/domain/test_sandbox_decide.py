"""`decide` for client requests: every transition and every refusal, given/when/then."""

from __future__ import annotations

import msgspec
import pytest
from sandhold.domain import events as ev
from sandhold.domain import requests as rq
from sandhold.domain.sandbox import result_of

from .history import (
    CREATE_KEY,
    DELETED,
    FAILED,
    HOST_A,
    PENDING,
    PLACED,
    RUNNING,
    SID,
    STARTING,
    STOPPED,
    STOPPING,
    T0,
    Step,
    cancel,
    cmd,
    command_ended,
    command_started,
    create,
    delete,
    dispatched,
    given,
    given_sandbox,
    run,
    start,
    stop,
    then_rejected,
    when,
)

MiB = 1024 * 1024
ALL_PHASES = {
    "pending": PENDING,
    "placed": PLACED,
    "starting": STARTING,
    "running": RUNNING,
    "stopping": STOPPING,
    "stopped": STOPPED,
    "failed": FAILED,
    "deleted": DELETED,
}


def test_the_phase_histories_reach_their_phase() -> None:
    for phase, history in ALL_PHASES.items():
        assert given_sandbox(*history).phase == phase


# --- create --------------------------------------------------------------------


def test_create_a_new_sandbox() -> None:
    request = create(memory_limit_bytes=256 * MiB, tenant="acme")
    assert when(None, request) == [
        ev.SandboxCreated(
            sandbox_id=rq.sandbox_id_for("acme", CREATE_KEY),
            request_key=CREATE_KEY,
            request_digest=rq.request_digest(request),
            memory_limit_bytes=256 * MiB,
            tenant="acme",
            save_interval_s=30.0,
            stop_deadline_s=60.0,
            idle_timeout_s=1800.0,  # the scheduler's default, recorded
        )
    ]


def test_a_created_sandbox_is_pending_with_its_settings() -> None:
    state = given_sandbox(create(memory_limit_bytes=64 * MiB))
    assert state.id == SID
    assert state.tenant == "default"
    assert state.phase == "pending"
    assert state.created_at == T0
    assert state.memory_limit_bytes == 64 * MiB
    assert (state.host, state.generation, state.commands) == (None, 0, {})


def test_create_again_with_the_same_key_and_body_is_nothing_new() -> None:
    assert when(given(create()), create()) == []


@pytest.mark.parametrize("history", [RUNNING, DELETED], ids=["running", "deleted"])
def test_create_retried_later_in_the_life_is_still_nothing_new(history: tuple[Step, ...]) -> None:
    assert when(given(*history), create()) == []


def test_create_again_with_the_same_key_and_another_body_conflicts() -> None:
    then_rejected(
        when(given(create()), create(memory_limit_bytes=64 * MiB)), "idempotency_conflict"
    )


def test_the_sandbox_id_follows_from_tenant_and_key() -> None:
    assert rq.sandbox_id_for("a", "k") == rq.sandbox_id_for("a", "k")
    assert rq.sandbox_id_for("a", "k") != rq.sandbox_id_for("b", "k")
    assert rq.sandbox_id_for("a", "k") != rq.sandbox_id_for("a", "k2")


# --- start ---------------------------------------------------------------------


@pytest.mark.parametrize("history", [STOPPED, FAILED], ids=["stopped", "failed"])
def test_start_a_stopped_or_failed_sandbox(history: tuple[Step, ...]) -> None:
    request = start()
    assert when(given(*history), request) == [
        ev.SandboxStartRequested(request_key="start-1", request_digest=rq.request_digest(request))
    ]


def test_a_start_request_makes_it_pending_again_on_its_old_placement() -> None:
    state = given_sandbox(*STOPPED, start())
    assert state.phase == "pending"
    # The old host and generation stay until a new placement supersedes them.
    assert (state.host, state.generation) == (HOST_A, 1)


def test_start_a_deleted_sandbox_is_refused() -> None:
    then_rejected(when(given(*DELETED), start()), "sandbox_deleted")


@pytest.mark.parametrize("history", [RUNNING, STOPPED], ids=["running", "stopped"])
def test_start_a_sandbox_being_deleted_is_refused(history: tuple[Step, ...]) -> None:
    then_rejected(when(given(*history, delete()), start()), "sandbox_deleted")


def test_start_a_stopping_sandbox_is_refused() -> None:
    then_rejected(when(given(*STOPPING), start()), "sandbox_stopping")


@pytest.mark.parametrize("phase", ["pending", "placed", "starting", "running"])
def test_start_an_already_started_sandbox_only_notes_the_key(phase: str) -> None:
    assert when(given(*ALL_PHASES[phase]), start()) == noted(start())


def test_a_noted_key_reused_with_another_body_conflicts() -> None:
    then_rejected(when(given(*RUNNING, start("k")), run("k")), "idempotency_conflict")


def test_start_retried_with_its_key_is_nothing_new() -> None:
    assert when(given(*STOPPED, start()), start()) == []


def _late_start(*superseded_by: str) -> rq.StartSandbox:
    """A task's later attempt's start, to do nothing once the task's stops were decided."""
    return rq.StartSandbox(
        key="task-1:sandbox:start:2", sandbox_id=SID, superseded_by=superseded_by
    )


def test_a_start_decided_after_a_request_that_supersedes_it_starts_nothing() -> None:
    """Decision 082: delivered late (a scheduler died deciding it), after the
    task's end stopped the sandbox, the start only notes its key."""
    late = _late_start("task-1:stop", "stop-1")  # STOPPED was stopped by "stop-1"
    assert when(given(*STOPPED), late) == noted(late)
    assert given_sandbox(*STOPPED, late).phase == "stopped"


def test_a_start_whose_superseding_requests_were_not_decided_starts_as_any_start() -> None:
    late = _late_start("task-1:stop", "task-1:release")
    assert when(given(*STOPPED), late) == [
        ev.SandboxStartRequested(request_key=late.key, request_digest=rq.request_digest(late))
    ]


def test_a_start_without_superseding_requests_keeps_the_digest_it_had_before_them() -> None:
    """A start retried across the upgrade that added `superseded_by` is the same
    request: its digest is the one the code before gave it (computed there)."""
    start_before = rq.StartSandbox(key="k", sandbox_id="sb-0123456789abcdef")
    assert rq.request_digest(start_before) == "d563ea88a815b2e444d7440ee853b421"


def test_a_start_superseded_by_too_many_keys_is_malformed() -> None:
    body = {"type": "sandbox.start", "key": "k", "sandbox_id": SID, "superseded_by": ["x"] * 9}
    with pytest.raises(msgspec.ValidationError, match="superseded_by"):
        rq.decode_request(msgspec.json.encode(body))


def test_a_key_reused_for_another_kind_of_request_conflicts() -> None:
    then_rejected(when(given(*STOPPED), start(key=CREATE_KEY)), "idempotency_conflict")


# --- stop ----------------------------------------------------------------------


@pytest.mark.parametrize("phase", ["placed", "starting", "running"])
def test_stop_a_sandbox_on_a_host_asks_the_host_to_stop_it(phase: str) -> None:
    request = stop()
    events = when(given(*ALL_PHASES[phase]), request)
    assert events == [
        ev.SandboxStopRequested(
            request_key="stop-1",
            request_digest=rq.request_digest(request),
            final_save_id=rq.save_id_for(SID, "final:stop-1"),
        )
    ]
    assert given_sandbox(*ALL_PHASES[phase], request).phase == "stopping"


def test_stop_a_pending_sandbox_stops_it_at_once() -> None:
    request = stop()
    assert when(given(*PENDING), request) == [
        ev.SandboxStopRequested(request_key="stop-1", request_digest=rq.request_digest(request))
    ]
    # Nothing holds a place on a host, so there is nothing to wait for.
    assert given_sandbox(*PENDING, request).phase == "stopped"


@pytest.mark.parametrize("phase", ["stopping", "stopped", "failed"])
def test_stop_a_sandbox_that_is_not_running_only_notes_the_key(phase: str) -> None:
    assert when(given(*ALL_PHASES[phase]), stop(key="stop-2")) == noted(stop(key="stop-2"))


def test_stop_retried_with_its_key_is_nothing_new() -> None:
    assert when(given(*STOPPED), stop()) == []


def test_stop_a_deleted_sandbox_is_refused() -> None:
    then_rejected(when(given(*DELETED), stop(key="stop-2")), "sandbox_deleted")


def test_stop_with_a_key_used_for_another_request_conflicts() -> None:
    then_rejected(when(given(*RUNNING, run()), stop(key="run-1")), "idempotency_conflict")


# --- delete --------------------------------------------------------------------


def test_delete_a_running_sandbox_stops_it_first() -> None:
    request = delete()
    assert when(given(*RUNNING), request) == [
        ev.SandboxDeleteRequested(request_key="delete-1", request_digest=rq.request_digest(request))
    ]
    state = given_sandbox(*RUNNING, request)
    assert (state.phase, state.delete_requested) == ("stopping", True)


@pytest.mark.parametrize("phase", ["pending", "stopped", "failed"])
def test_delete_a_sandbox_off_any_host_keeps_its_phase(phase: str) -> None:
    request = delete()
    assert when(given(*ALL_PHASES[phase]), request) == [
        ev.SandboxDeleteRequested(request_key="delete-1", request_digest=rq.request_digest(request))
    ]
    state = given_sandbox(*ALL_PHASES[phase], request)
    assert (state.phase, state.delete_requested) == (phase, True)


def test_delete_twice_with_another_key_is_nothing_new() -> None:
    again = delete(key="delete-2")
    assert when(given(*RUNNING, delete()), again) == noted(again)


def test_delete_retried_with_its_key_is_nothing_new() -> None:
    assert when(given(*RUNNING, delete()), delete()) == []


def test_delete_a_deleted_sandbox_is_nothing_new() -> None:
    assert when(given(*DELETED), delete(key="delete-2")) == noted(delete(key="delete-2"))


def test_delete_with_a_key_used_for_another_request_conflicts() -> None:
    then_rejected(when(given(*STOPPED), delete(key="stop-1")), "idempotency_conflict")


# --- run command -----------------------------------------------------------------


@pytest.mark.parametrize("phase", ["pending", "placed", "starting", "running"])
def test_run_queues_the_command(phase: str) -> None:
    request = run(
        argv=["pytest", "-q"], cwd="/work", env={"CI": "1"}, timeout_s=60.0, kill_grace_s=2
    )
    # On a running sandbox it is dispatched to its placement by the same event
    # (decision 098); before that it waits for `plan`.
    to = ev.Dispatch(host=HOST_A, generation=1) if phase == "running" else None
    assert when(given(*ALL_PHASES[phase]), request) == [
        ev.CommandQueued(
            command_id=rq.command_id_for(SID, "run-1"),
            request_key="run-1",
            request_digest=rq.request_digest(request),
            argv=["pytest", "-q"],
            cwd="/work",
            env={"CI": "1"},
            timeout_s=60.0,
            kill_grace_s=2,
            dispatched_to=to,
        )
    ]


def test_a_command_run_on_a_running_sandbox_is_dispatched_by_its_queuing() -> None:
    state = given_sandbox(*RUNNING, run(argv=["make"]))
    command = state.commands[cmd()]
    assert (command.state, command.host, command.generation) == ("dispatched", HOST_A, 1)
    assert state.queued == () and state.unended_ids == (cmd(),)


def test_a_queued_command_records_what_to_run_and_when() -> None:
    history = (*STARTING, run(argv=["make"], timeout_s=5.0))
    state = given_sandbox(*history)
    command = state.commands[cmd()]
    assert command.state == "queued"
    assert command.argv == ["make"]
    assert command.timeout_s == 5.0
    assert command.queued_at == T0 + len(history) - 1
    assert (command.host, command.generation, command.ended_at) == (None, 0, None)
    assert result_of(state, run(argv=["make"], timeout_s=5.0)) == command


@pytest.mark.parametrize("phase", ["stopping", "stopped", "failed", "deleted"])
def test_run_on_a_sandbox_that_is_not_running_is_refused(phase: str) -> None:
    then_rejected(when(given(*ALL_PHASES[phase]), run()), "sandbox_not_running")


def test_run_on_a_sandbox_being_deleted_is_refused() -> None:
    then_rejected(when(given(*STOPPED, delete()), run()), "sandbox_not_running")


def test_run_retried_with_its_key_is_nothing_new() -> None:
    assert when(given(*RUNNING, run()), run()) == []


def test_run_retried_after_the_sandbox_stopped_is_still_nothing_new() -> None:
    # The retry finds the recorded command rather than a refusal.
    assert when(given(*RUNNING, run(), stop()), run()) == []


def test_run_with_its_key_and_another_body_conflicts() -> None:
    then_rejected(
        when(given(*RUNNING, run()), run(argv=["rm", "-rf", "/"])), "idempotency_conflict"
    )


def test_two_keys_queue_two_commands() -> None:
    state = given_sandbox(*RUNNING, run("run-1"), run("run-2"))
    assert list(state.commands) == [cmd("run-1"), cmd("run-2")]


# --- cancel command --------------------------------------------------------------


def test_cancel_an_unknown_command_is_refused() -> None:
    then_rejected(when(given(*RUNNING), cancel(cmd("nope"))), "command_not_found")


@pytest.mark.parametrize(
    "progress",
    [(), (dispatched(),), (dispatched(), command_started())],
    ids=["queued", "dispatched", "running"],
)
def test_cancel_a_live_command(progress: tuple[Step, ...]) -> None:
    request = cancel(cmd())
    history = (*RUNNING, run(), *progress)
    assert when(given(*history), request) == [
        ev.CommandCancelRequested(
            command_id=cmd(), request_key="cancel-1", request_digest=rq.request_digest(request)
        )
    ]
    command = given_sandbox(*history, request).commands[cmd()]
    assert command.cancel_requested
    assert command.state == given_sandbox(*history).commands[cmd()].state


def test_cancel_an_ended_command_is_nothing_new() -> None:
    history = (*RUNNING, run(), dispatched(), command_started(), command_ended())
    assert when(given(*history), cancel(cmd())) == noted(cancel(cmd()))


def test_cancel_twice_with_another_key_is_nothing_new() -> None:
    again = cancel(cmd(), key="cancel-2")
    assert when(given(*RUNNING, run(), cancel(cmd())), again) == noted(again)


def test_cancel_retried_with_its_key_is_nothing_new() -> None:
    assert when(given(*RUNNING, run(), cancel(cmd())), cancel(cmd())) == []


def test_cancel_with_its_key_naming_another_command_conflicts() -> None:
    history = (*RUNNING, run("run-1"), run("run-2"), cancel(cmd("run-1")))
    then_rejected(when(given(*history), cancel(cmd("run-2"))), "idempotency_conflict")


# --- tenants -----------------------------------------------------------------------

OTHER_TENANT_REQUESTS = {
    "start": start(tenant="intruder"),
    "stop": stop(tenant="intruder"),
    "delete": delete(tenant="intruder"),
    "run": run(tenant="intruder"),
    "cancel": cancel(cmd(), tenant="intruder"),
}


@pytest.mark.parametrize("name", OTHER_TENANT_REQUESTS)
def test_another_tenants_sandbox_looks_missing(name: str) -> None:
    state = given(*RUNNING, run())
    then_rejected(when(state, OTHER_TENANT_REQUESTS[name]), "sandbox_not_found")


@pytest.mark.parametrize("name", OTHER_TENANT_REQUESTS)
def test_a_missing_sandbox_is_not_found(name: str) -> None:
    then_rejected(when(None, OTHER_TENANT_REQUESTS[name]), "sandbox_not_found")


def test_the_same_create_key_in_another_tenant_is_another_sandbox() -> None:
    request = create(tenant="intruder")
    assert rq.sandbox_id_for("intruder", CREATE_KEY) != SID
    # Its own aggregate has no history, so it is created afresh.
    [created] = when(None, request)
    assert isinstance(created, ev.SandboxCreated)
    assert (created.sandbox_id, created.tenant) == (
        rq.sandbox_id_for("intruder", CREATE_KEY),
        "intruder",
    )


# --- malformed requests --------------------------------------------------------------


def _json(**fields: object) -> bytes:
    return msgspec.json.encode(fields)


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        (_json(type="sandbox.stop", key="k", sandbox_id=SID, force=True), "force"),
        (_json(type="sandbox.stop", key="k"), "sandbox_id"),
        (_json(type="command.run", key="k", sandbox_id=SID, argv=[]), "argv"),
        (_json(type="sandbox.stop", key="k", sandbox_id="sb-NOT-HEX"), "sandbox_id"),
        (_json(type="sandbox.stop", key="k", sandbox_id="../../etc"), "sandbox_id"),
        (
            _json(type="command.run", key="k", sandbox_id=SID, argv=["ls"], timeout_s=-1),
            "timeout_s",
        ),
        (_json(type="command.run", key="k", sandbox_id=SID, argv=["ls"], timeout_s=0), "timeout_s"),
        (
            _json(type="command.run", key="k", sandbox_id=SID, argv=["ls"], kill_grace_s=-1),
            "kill_grace_s",
        ),
        (_json(type="command.run", key="k", sandbox_id=SID, argv="ls"), "argv"),
        (_json(type="command.run", key="k", sandbox_id=SID, argv=[1]), "argv"),
        (_json(type="sandbox.create", key="k", memory_limit_bytes="big"), "memory_limit_bytes"),
        (_json(type="sandbox.create", key="k", memory_limit_bytes=1024), "memory_limit_bytes"),
        (_json(type="sandbox.create", key="k", disk_limit_bytes=1024), "disk_limit_bytes"),
        (_json(type="sandbox.create", key="k", disk_limit_bytes="10G"), "disk_limit_bytes"),
        (_json(type="sandbox.create", key="k", pids_limit=1), "pids_limit"),
        (_json(type="sandbox.create", key="k", network="host"), "network"),
        (_json(type="sandbox.create", key="k", idle_timeout_s=-1), "idle_timeout_s"),
        (_json(type="sandbox.create", key="k", idle_timeout_s="15m"), "idle_timeout_s"),
        (_json(type="sandbox.touch", key="k"), "sandbox_id"),
        (_json(type="sandbox.touch", key="k", sandbox_id=SID, until=5), "until"),
        (_json(type="sandbox.create", key="has space"), "key"),
        (_json(type="sandbox.create", key=""), "key"),
        (_json(type="sandbox.create", key="k", tenant="a/b"), "tenant"),
        (_json(type="command.cancel", key="k", sandbox_id=SID, command_id="cmd-1"), "command_id"),
        (_json(type="sandbox.explode", key="k"), "type"),
        (_json(key="k"), "type"),
    ],
    ids=[
        "unknown-field",
        "missing-field",
        "empty-argv",
        "bad-sandbox-id",
        "path-as-sandbox-id",
        "negative-timeout",
        "zero-timeout",
        "negative-grace",
        "argv-not-a-list",
        "argv-not-strings",
        "memory-wrong-type",
        "memory-too-small",
        "disk-too-small",
        "disk-wrong-type",
        "pids-too-few",
        "network-unknown",
        "idle-timeout-negative",
        "idle-timeout-not-seconds",
        "touch-without-sandbox",
        "touch-unknown-field",
        "key-with-space",
        "empty-key",
        "bad-tenant",
        "bad-command-id",
        "unknown-type",
        "missing-type",
    ],
)
def test_a_malformed_request_is_refused_naming_the_field(payload: bytes, field: str) -> None:
    with pytest.raises(msgspec.ValidationError, match=rf"\b{field}\b"):
        rq.decode_request(payload)


def test_a_request_that_is_not_json_is_refused() -> None:
    with pytest.raises(msgspec.DecodeError):
        rq.decode_request(b'{"type": "sandbox.create", "key": ')


@pytest.mark.parametrize(
    "request_",
    [
        create(memory_limit_bytes=64 * MiB, tenant="acme"),
        create(disk_limit_bytes=64 * MiB, pids_limit=64, cpu_limit=0.5, network="egress"),
        start(),
        stop(),
        delete(),
        run(argv=["ls", "-la"], cwd="/", env={"A": "b"}, timeout_s=1.5, kill_grace_s=0),
        cancel(cmd()),
    ],
    ids=lambda r: rq.request_tag(r),
)
def test_a_well_formed_request_survives_encode_and_decode(request_: rq.AnyRequest) -> None:
    assert rq.decode_request(rq.encode_request(request_)) == request_


def test_the_digest_ignores_the_key_but_not_the_body() -> None:
    assert rq.request_digest(run("a")) == rq.request_digest(run("b"))
    assert rq.request_digest(run("a")) != rq.request_digest(run("a", argv=["other"]))
    assert rq.request_digest(stop("a")) != rq.request_digest(start("a"))
    # A field added later changes the digest only when it asks for something.
    assert rq.request_digest(create(disk_limit_bytes=None)) == rq.request_digest(create())
    assert rq.request_digest(create(disk_limit_bytes=64 * MiB)) != rq.request_digest(create())


def noted(request: rq.AnyRequest) -> list[ev.AnyEvent]:
    """A valid request that changes nothing still takes its key."""
    return [ev.RequestNoted(request_key=request.key, request_digest=rq.request_digest(request))]
