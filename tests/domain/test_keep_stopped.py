"""A stopped sandbox kept for its `keep_stopped_s`, then deleted (decision 074):
when the clock starts and starts again, what never expires, and the Delete
the saver's tick decides."""

from __future__ import annotations

import msgspec
import pytest
from sandhold.domain import events as ev
from sandhold.domain import requests as rq
from sandhold.domain.sandbox import (
    Sandbox,
    decide,
    delete_if_kept_long_enough,
    deletes_at,
    deletion_asked,
    reap_if_idle,
)
from sandhold.domain.saver import on_schedule
from sandhold.domain.views import sandbox_view

from .history import (
    T0,
    apply,
    create,
    given_sandbox,
    placed,
    run,
    start,
    start_failed,
    started,
    starting,
    stop,
    stopped,
)

KEEP = 3600.0
# Created at T0, running from T0 + 3, stopped at T0 + 5 (each step one second after the last).
KEPT_AND_STOPPED = (create(keep_stopped_s=KEEP), placed(), starting(), started(), stop(), stopped())
STOPPED_AT = T0 + 5


def test_a_stopped_sandbox_is_deleted_its_keep_time_after_it_stopped() -> None:
    state = given_sandbox(*KEPT_AND_STOPPED)
    assert state.phase == "stopped" and deletes_at(state) == STOPPED_AT + KEEP
    assert delete_if_kept_long_enough(state, now=STOPPED_AT + KEEP - 1, cause="9") == []
    [asked] = delete_if_kept_long_enough(state, now=STOPPED_AT + KEEP, cause="9")
    assert asked == ev.SandboxDeleteRequested(
        request_key="kept-stopped:9", request_digest="", reason="kept_stopped"
    )
    gone = apply(state, [asked], time=STOPPED_AT + KEEP)
    assert deletion_asked(gone) and gone.reason == "kept_stopped" and deletes_at(gone) is None
    view = sandbox_view(gone, now=STOPPED_AT + KEEP)
    assert view.delete_requested and view.reason == "kept_stopped" and view.deletes_at is None


def test_a_running_sandbox_is_never_deleted_and_its_clock_starts_again_at_each_stop() -> None:
    running = given_sandbox(*KEPT_AND_STOPPED[:4])
    assert deletes_at(running) is None
    assert delete_if_kept_long_enough(running, now=T0 + 10 * KEEP, cause="1") == []
    assert sandbox_view(running, now=T0).keep_stopped_s == KEEP
    # Stopped, started again, stopped again later: counted from the second stop.
    again = given_sandbox(
        *KEPT_AND_STOPPED, start(), placed(generation=2), starting(generation=2),
        started(generation=2), stop("stop-2"), stopped(generation=2),
    )  # fmt: skip
    assert again.phase == "stopped" and deletes_at(again) == T0 + 11 + KEEP
    assert sandbox_view(again, now=T0).deletes_at == T0 + 11 + KEEP


def test_a_failed_start_is_kept_as_long_counted_from_the_failure() -> None:
    failed = given_sandbox(create(keep_stopped_s=KEEP), placed(), starting(), start_failed())
    assert failed.phase == "failed" and deletes_at(failed) == T0 + 3 + KEEP


@pytest.mark.parametrize("keep", [None, 0.0])
def test_without_a_keep_time_a_stopped_sandbox_is_kept_until_deleted(keep) -> None:
    state = given_sandbox(
        create(keep_stopped_s=keep), placed(), starting(), started(), stop(), stopped()
    )
    assert deletes_at(state) is None
    assert delete_if_kept_long_enough(state, now=T0 + 365 * 86400, cause="1") == []
    assert sandbox_view(state, now=T0).keep_stopped_s == 0.0


def test_a_sandbox_stopped_before_it_was_placed_counts_from_its_stop() -> None:
    # Never placed (no host had room): the Stop settles it at once.
    state = given_sandbox(create(keep_stopped_s=KEEP), stop())
    assert state.phase == "stopped" and deletes_at(state) == T0 + 1 + KEEP
    # With no save under way it is not on the saver's every-second tick.
    assert not state.saves_in_flight and not on_schedule(state)


def test_a_command_queued_to_wake_a_reaped_sandbox_keeps_it_from_deletion() -> None:
    # Reaped for being idle (stopped, reason idle), past its keep time, and a
    # command queued meanwhile: it wakes the sandbox, which is not deleted under it.
    state = given_sandbox(
        create(keep_stopped_s=KEEP, idle_timeout_s=60), placed(), starting(), started()
    )
    reaped = apply(state, reap_if_idle(state, now=T0 + 63, cause="4"), time=T0 + 63)
    reaped = apply(reaped, [stopped()], time=T0 + 64)
    assert deletes_at(reaped) == T0 + 64 + KEEP
    woken = apply(reaped, decide(reaped, run("wake")), time=T0 + 64 + KEEP)
    assert woken.phase == "stopped" and woken.unended_ids
    assert deletes_at(woken) is None
    assert delete_if_kept_long_enough(woken, now=T0 + 64 + 2 * KEEP, cause="5") == []


def test_the_create_carries_the_keep_time_and_an_unset_one_keeps_old_digests() -> None:
    [created] = decide(None, create(keep_stopped_s=KEEP))
    assert isinstance(created, ev.SandboxCreated) and created.keep_stopped_s == KEEP
    [unset] = decide(None, create())
    assert isinstance(unset, ev.SandboxCreated) and unset.keep_stopped_s is None
    # A request retried across the upgrade (no such field then) keeps its digest.
    assert rq.request_digest(create()) == rq.request_digest(create(keep_stopped_s=None))
    assert rq.request_digest(create()) != rq.request_digest(create(keep_stopped_s=KEEP))


@pytest.mark.parametrize("bad", [-1, 365 * 86400 + 1, "7d", True, [1]])
def test_a_malformed_keep_time_is_refused_naming_the_field(bad) -> None:
    body = msgspec.json.encode({"type": "sandbox.create", "key": "k", "keep_stopped_s": bad})
    with pytest.raises(msgspec.ValidationError, match=r"keep_stopped_s"):
        msgspec.json.decode(body, type=rq.AnyRequest)


def test_a_state_from_before_the_field_is_kept_until_deleted() -> None:
    # A checkpoint or a created event written before decision 074 has neither field.
    old = msgspec.json.decode(
        msgspec.json.encode({"id": "sb-0", "tenant": "t", "phase": "stopped", "created_at": T0}),
        type=Sandbox,
    )
    assert old.keep_stopped_s == 0.0 and deletes_at(old) is None
