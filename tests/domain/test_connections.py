"""Connections in the domain (decision 031): what the log records of a set or a
removal, when the plan delivers them, and that no command runs before they
are where the sandbox runs."""

from __future__ import annotations

import zlib

import msgspec
import pytest
from sandhold.domain import events as ev
from sandhold.domain import requests as rq
from sandhold.domain import work as wk
from sandhold.domain.reconcile import plan
from sandhold.domain.reports import decide_report
from sandhold.domain.sandbox import MAX_CONNECTIONS, MAX_CONNECTIONS_BYTES, Sandbox
from sandhold.domain.views import sandbox_view

from .history import (
    DELETED,
    HOST_A,
    HOST_B,
    PLACED,
    RUNNING,
    SID,
    STOPPED,
    TENANT,
    apply,
    cmd,
    dispatched,
    given_sandbox,
    placed,
    run,
    start,
    starting,
    then_rejected,
    when,
)


def set_connection(
    name: str = "github", value: str = "ghp_token", key: str | None = None, tenant: str = TENANT
) -> rq.SetConnection:
    return rq.SetConnection(
        key=key or f"set-{name}-{len(value)}-{zlib.crc32(value.encode()):x}",
        tenant=tenant,
        sandbox_id=SID,
        name=name,
        value=value,
    )


def remove_connection(name: str = "github", key: str | None = None) -> rq.RemoveConnection:
    return rq.RemoveConnection(key=key or f"rm-{name}", sandbox_id=SID, name=name)


def no_host(_: Sandbox) -> str | None:
    return None


def delivered(revision: int, host: str = HOST_A, generation: int = 1) -> ev.ConnectionsDelivered:
    return ev.ConnectionsDelivered(host=host, generation=generation, revision=revision)


def test_a_set_records_the_name_size_and_revision_and_never_the_value() -> None:
    events = when(given_sandbox(*RUNNING), set_connection(value="s3cr3t-value", key="set-1"))
    assert isinstance(events, list) and len(events) == 1
    event = events[0]
    assert isinstance(event, ev.ConnectionSet)
    assert (event.name, event.size, event.revision) == ("github", 12, 1)
    assert event.value_id == rq.connection_value_id(SID, "set-1")
    assert b"s3cr3t-value" not in msgspec.json.encode(event)
    assert "s3cr3t-value" not in repr(set_connection(value="s3cr3t-value"))


def test_the_digest_covers_the_name_not_the_value() -> None:
    one, other = set_connection(value="a", key="k"), set_connection(value="b", key="k")
    assert rq.request_digest(one) == rq.request_digest(other)
    assert rq.request_digest(one) != rq.request_digest(set_connection("npm", "a", key="k"))


def test_another_tenants_sandbox_is_not_found() -> None:
    then_rejected(
        when(given_sandbox(*RUNNING), set_connection(tenant="other")), "sandbox_not_found"
    )


def test_a_deleted_sandbox_takes_no_connection() -> None:
    then_rejected(when(given_sandbox(*DELETED), set_connection()), "sandbox_deleted")


def test_a_retry_changes_nothing_and_a_new_key_for_the_same_name_replaces_it() -> None:
    state = given_sandbox(*RUNNING, set_connection(key="k1"))
    assert when(state, set_connection(key="k1")) == []
    replaced = apply(state, when(state, set_connection(value="new", key="k2")))
    assert replaced.connections_revision == 2
    assert replaced.connections["github"].value_id == rq.connection_value_id(SID, "k2")
    assert list(replaced.connections) == ["github"]


def test_removing_drops_the_name_and_counts_a_revision() -> None:
    state = given_sandbox(*RUNNING, set_connection(), set_connection("npm"), remove_connection())
    assert list(state.connections) == ["npm"] and state.connections_revision == 3
    then_rejected(when(state, remove_connection(key="again")), "connection_not_found")


def test_the_number_and_total_size_of_connections_are_bounded() -> None:
    many = [set_connection(f"c{i}", "v") for i in range(MAX_CONNECTIONS)]
    state = given_sandbox(*RUNNING, *many)
    then_rejected(when(state, set_connection("one-more", "v")), "too_many_connections")
    assert when(state, set_connection("c0", "replaced"))  # replacing one is not one more
    big = "x" * (MAX_CONNECTIONS_BYTES // 2)
    state = given_sandbox(*RUNNING, set_connection("a", big))
    then_rejected(when(state, set_connection("b", big + "x")), "connections_too_large")


def test_a_command_waits_until_the_running_sandbox_has_its_connections() -> None:
    state = given_sandbox(*RUNNING, set_connection(), run())
    first = plan(state, no_host)
    assert first.events == []  # not dispatched: the file is not there yet
    assert first.work == [
        (
            HOST_A,
            wk.DeliverConnectionsWork(
                sandbox_id=SID,
                generation=1,
                revision=1,
                connection_value_ids={"github": state.connections["github"].value_id},
            ),
        )
    ]
    assert sandbox_view(state, now=0).connections_pending is True
    report = delivered(1)
    state = apply(state, decide_report(state, report))
    assert state.connections_delivered == 1
    assert plan(state, no_host).events == [dispatched()]
    assert sandbox_view(state, now=0).connections_pending is False
    assert decide_report(state, report) == []  # told twice: not news


def test_the_start_instruction_carries_the_connections_and_the_start_delivers_them() -> None:
    state = given_sandbox(*STOPPED, set_connection(), start(), placed(generation=2))
    start_work = next(w for _, w in plan(state, no_host).work)
    assert isinstance(start_work, wk.StartSandboxWork)
    assert start_work.connections_revision == 1
    assert start_work.connection_value_ids == {"github": state.connections["github"].value_id}
    assert start_work.connections == {}  # values: the scheduler's, added as it sends
    state = apply(state, [starting(generation=2)])
    running = apply(state, [ev.SandboxStarted(host=HOST_A, generation=2, connections_revision=1)])
    assert running.connections_current
    assert plan(apply(running, []), no_host).work == []


def test_a_new_placement_has_nothing_delivered_until_its_host_says_so() -> None:
    state = given_sandbox(*RUNNING, set_connection(), delivered(1))
    assert state.connections_current
    moved = apply(state, [ev.SandboxLost(host=HOST_A, generation=1, last_renewal_at=0, fence_at=1)])
    moved = apply(moved, [ev.SandboxFenced(host=HOST_A, generation=1)])
    moved = apply(moved, [ev.SandboxRecoveryRequested(cause="start")])
    moved = apply(moved, [placed(HOST_B, generation=2)])
    assert moved.connections_delivered is None
    # A delivery report from the old placement is refused by the fence.
    with pytest.raises(Exception, match="generation"):
        decide_report(moved, delivered(1))


def test_a_host_that_lost_the_files_makes_the_plan_deliver_them_again() -> None:
    state = given_sandbox(*RUNNING, set_connection(), delivered(1))
    dropped = ev.ConnectionsDropped(host=HOST_A, generation=1, epoch=2)
    state = apply(state, decide_report(state, dropped))
    assert state.connections_delivered is None and not state.connections_current
    assert any(isinstance(w, wk.DeliverConnectionsWork) for _, w in plan(state, no_host).work)
    assert decide_report(state, dropped) == []  # already known


def test_a_sandbox_that_never_had_a_connection_dispatches_at_once() -> None:
    state = given_sandbox(*RUNNING, run())
    assert state.connections_current
    # (By the run's own event, decision 098: `plan` has only its instruction to send.)
    assert state.commands[cmd()].state == "dispatched"
    planned = plan(state, no_host)
    assert planned.events == []
    assert [w.command_id for _, w in planned.work if isinstance(w, wk.RunCommandWork)] == [cmd()]


def test_a_command_run_while_the_connections_are_on_their_way_waits_queued() -> None:
    state = given_sandbox(*RUNNING, set_connection(), run())
    assert not state.connections_current
    assert state.commands[cmd()].state == "queued"
    state = apply(state, [delivered(1)])
    assert plan(state, no_host).events == [dispatched()]
    assert (
        given_sandbox(*RUNNING, set_connection(), delivered(1), run()).commands[cmd()].state
        == "dispatched"
    )


def test_connections_of_a_placed_sandbox_are_not_delivered_by_a_separate_instruction() -> None:
    state = given_sandbox(*PLACED, set_connection())
    kinds = [type(w) for _, w in plan(state, no_host).work]
    assert kinds == [wk.StartSandboxWork]  # it carries them


def test_malformed_connection_requests_are_refused_on_decode() -> None:
    base = {"type": "connection.set", "key": "k", "sandbox_id": SID, "name": "ok", "value": "v"}
    for bad in (
        {"name": ".."},
        {"name": "a..b"},
        {"name": "a/b"},
        {"name": ""},
        {"name": "x" * 65},
        {"value": None},
        {"value": "x" * 65537},
        {"surprise": True},
    ):
        with pytest.raises(msgspec.ValidationError):
            rq.decode_request(msgspec.json.encode({**base, **bad}))
    assert isinstance(rq.decode_request(msgspec.json.encode(base)), rq.SetConnection)
