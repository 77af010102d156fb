"""Host failure in the domain: lost, the end states it implies, the fence, recovery."""

from __future__ import annotations

from sandhold.domain import events as ev
from sandhold.domain import recovery as policy
from sandhold.domain import requests as rq
from sandhold.domain import saver
from sandhold.domain.errors import Rejected
from sandhold.domain.host import Host, decide_fenced, decide_lost
from sandhold.domain.reconcile import plan
from sandhold.domain.reports import decide_report
from sandhold.domain.views import sandbox_view

from .history import (
    HOST_A,
    HOST_B,
    RUNNING,
    SID,
    T0,
    apply,
    cancel,
    cmd,
    command_ended,
    command_started,
    delete,
    dispatched,
    given_sandbox,
    queued,
    run,
    start,
    when,
)
from .history import then_rejected as refused


def lost_sandbox(*extra):
    state = given_sandbox(*RUNNING, *extra)
    [lost] = policy.declare_lost(state, host=HOST_A, last_renewal_at=T0 + 50, fence_at=T0 + 57)
    return apply(state, [lost])


def test_a_sandbox_on_a_lost_host_is_lost_once() -> None:
    state = given_sandbox(*RUNNING)
    [lost] = policy.declare_lost(state, host=HOST_A, last_renewal_at=T0, fence_at=T0 + 7)
    assert isinstance(lost, ev.SandboxLost) and lost.generation == 1
    assert policy.declare_lost(state, host=HOST_B, last_renewal_at=T0, fence_at=T0 + 7) == []
    state = apply(state, [lost])
    assert state.phase == "lost"
    assert policy.declare_lost(state, host=HOST_A, last_renewal_at=T0, fence_at=T0 + 7) == []


def test_a_host_back_from_its_fence_declares_only_the_placement_it_killed() -> None:
    state = given_sandbox(*RUNNING)
    killed = {"host": HOST_A, "last_renewal_at": T0, "fence_at": T0 + 5}
    [lost] = policy.declare_lost_here(state, generation=1, **killed)
    assert isinstance(lost, ev.SandboxLost) and (lost.generation, lost.fence_at) == (1, T0 + 5)
    # placed anew since the fence: that placement's processes were never killed
    assert policy.declare_lost_here(state, generation=0, **killed) == []
    # recovery judged the host first: said once
    assert policy.declare_lost_here(apply(state, [lost]), generation=1, **killed) == []


def test_running_ends_infrastructure_lost_dispatched_unknown_queued_stays() -> None:
    history = (
        run("r1"),
        dispatched("r1"),
        command_started("r1"),
        run("r2"),
        dispatched("r2"),
        queued("r3"),
        run("r4"),
        dispatched("r4"),
        command_started("r4"),
        command_ended("r4"),
    )
    state = lost_sandbox(*history)
    ends = {
        e.command_id: e.state for e in policy.after_loss(state) if isinstance(e, ev.CommandEnded)
    }
    assert ends == {cmd("r1"): "infrastructure_lost", cmd("r2"): "unknown"}
    state = apply(state, policy.after_loss(state))
    assert state.commands[cmd("r3")].state == "queued"
    assert policy.after_loss(state) == []  # decided once


def test_the_end_states_say_whether_the_host_failed_or_only_the_sandboxs_files_went() -> None:
    """A host that found its copy's files gone declares the placement lost
    itself: the commands and saves it took with it do not say the host failed."""
    history = (run("r1"), dispatched("r1"), command_started("r1"), run("r2"), dispatched("r2"))
    state = given_sandbox(*RUNNING, *history)
    [save] = saver.due_save(state, now=T0 + 10_000, cause="tick")
    state = apply(state, [save])
    here = {"host": HOST_A, "generation": 1, "last_renewal_at": T0 + 9, "fence_at": T0 + 9}
    [gone] = policy.declare_lost_here(state, **here, cause="files_gone")
    [failed] = policy.declare_lost_here(state, **here)
    assert (gone.cause, failed.cause) == ("files_gone", "host")

    def reasons(lost: ev.AnyEvent) -> list[str]:
        after = apply(state, [lost])
        assert after.lost is not None and sandbox_view(after, now=T0 + 10).recovery is not None
        return [e.reason for e in policy.after_loss(after)]  # type: ignore[attr-defined]

    said = reasons(gone)
    assert len(said) == 3 and all(
        r.startswith(f"the sandbox's files went missing from host {HOST_A}") for r in said
    ), said
    assert all("failed" not in r for r in said), said
    assert all(r.startswith(f"host {HOST_A} failed") for r in reasons(failed))
    view = sandbox_view(apply(state, [gone]), now=T0 + 10)
    assert view.recovery is not None and view.recovery["cause"] == "files_gone"


def test_reports_from_a_lost_placement_are_refused() -> None:
    state = lost_sandbox(run("r1"), dispatched("r1"), command_started("r1"))
    try:
        decide_report(state, command_ended("r1"))
    except Rejected as err:
        assert err.code == "sandbox_lost"
    else:
        raise AssertionError("a lost placement's report must be refused")


def test_nothing_is_placed_before_the_fence_and_nothing_without_a_request() -> None:
    state = lost_sandbox()
    assert plan(state, lambda s: HOST_B).events == []  # lazy: waits for a start/command
    [recover] = when(state, start("again"))
    assert isinstance(recover, ev.SandboxRecoveryRequested)
    state = apply(state, [recover])
    assert state.phase == "recovering"
    assert plan(state, lambda s: HOST_B).events == []  # not fenced yet
    [fenced] = policy.declare_fenced(state, host=HOST_A)
    state = apply(state, [fenced])
    assert plan(state, lambda s: HOST_B).events == [ev.SandboxPlaced(host=HOST_B, generation=2)]


def test_a_command_to_a_lost_sandbox_asks_for_recovery_and_waits_queued() -> None:
    state = lost_sandbox()
    events = when(state, run("after"))
    assert [type(e) for e in events] == [ev.SandboxRecoveryRequested, ev.CommandQueued]


def test_a_command_queued_just_before_the_loss_brings_the_sandbox_back_once_fenced() -> None:
    # Queued and not dispatched yet (its Connections on their way to the host, or
    # a log from before decision 098), then the loss: nothing else may ever come
    # for this sandbox, so the queued command is the demand that recovers it
    # (lazy policy notwithstanding).
    state = lost_sandbox(queued("waiting"))
    assert state.commands[cmd("waiting")].state == "queued"
    assert plan(state, lambda s: HOST_B).events == []  # not before the fence
    state = apply(state, policy.declare_fenced(state, host=HOST_A))
    [asked] = plan(state, lambda s: HOST_B).events
    assert isinstance(asked, ev.SandboxRecoveryRequested) and asked.cause == "command"
    state = apply(state, [asked])
    assert plan(state, lambda s: HOST_B).events == [ev.SandboxPlaced(host=HOST_B, generation=2)]


def test_a_cancelled_or_deleted_queued_command_recovers_nothing() -> None:
    state = lost_sandbox(queued("waiting"))
    state = apply(state, policy.declare_fenced(state, host=HOST_A))
    cancelled = apply(state, when(state, cancel(cmd("waiting"))))
    assert [type(e) for e in plan(cancelled, lambda s: HOST_B).events] == [ev.CommandEnded]
    deleted = apply(state, when(state, delete()))
    kinds = [type(e) for e in plan(deleted, lambda s: HOST_B).events]
    assert ev.SandboxRecoveryRequested not in kinds and ev.SandboxDeleted in kinds


def test_a_snapshot_of_a_lost_sandbox_is_refused() -> None:
    refused(
        when(lost_sandbox(), rq.SnapshotSandbox(key="s", sandbox_id=SID, name="n")), "sandbox_lost"
    )


def test_eager_recovery_asks_by_itself_once_fenced() -> None:
    state = lost_sandbox()
    state = apply(state, policy.declare_fenced(state, host=HOST_A))
    assert plan(state, lambda s: HOST_B).events == []
    import msgspec

    eager = msgspec.structs.replace(state, recovery_policy="eager")
    [asked] = plan(eager, lambda s: HOST_B).events
    assert isinstance(asked, ev.SandboxRecoveryRequested) and asked.cause == "eager"


def test_a_host_is_lost_and_fenced_once_per_epoch() -> None:
    host = Host(host=HOST_A, epoch=3, capacity_sandboxes=1, memory_bytes=1, registered_at=T0)
    assert decide_lost(host, epoch=2, last_renewal_at=T0, fence_at=T0 + 7) == []
    [lost] = decide_lost(host, epoch=3, last_renewal_at=T0, fence_at=T0 + 7)
    assert decide_fenced(host, epoch=3) == []  # not lost yet
    import msgspec

    lost_host = msgspec.structs.replace(host, status="lost")
    assert decide_fenced(lost_host, epoch=3) == [ev.HostFenced(host=HOST_A, epoch=3)]
    assert lost.fence_at == T0 + 7


def test_a_lost_sandbox_stopped_before_recovery_still_ends_its_commands_as_lost() -> None:
    from .history import stop

    state = lost_sandbox(run("r1"), dispatched("r1"), command_started("r1"))
    state = apply(state, when(state, stop("stop-lost")))
    assert state.phase == "stopped"
    assert plan(state, lambda s: None).events == []  # not `unknown`: recovery decides
    [ended] = policy.after_loss(state)
    assert isinstance(ended, ev.CommandEnded) and ended.state == "infrastructure_lost"


def test_deleting_a_sandbox_whose_host_is_dead_does_not_wait_for_that_host() -> None:
    from .history import delete, stop, stopped

    state = given_sandbox(*RUNNING, stop(), stopped(), delete())
    alive = plan(state, lambda s: None, lambda host: True)
    assert alive.events == [] and alive.work  # a destroy for the live host
    dead = plan(state, lambda s: None, lambda host: False)
    assert dead.events == [ev.SandboxDeleted(host=None, generation=1)] and dead.work == []


def test_a_loss_is_pending_until_it_is_fenced_and_its_commands_ended() -> None:
    """What the recovery service keeps looking at each tick: a sandbox lost and
    not yet fenced, or with end states still to say; then nothing more."""
    running = given_sandbox(*RUNNING, run("r1"), dispatched("r1"), command_started("r1"))
    assert not policy.loss_pending(running) and not policy.loss_pending(None)
    state = lost_sandbox(run("r1"), dispatched("r1"), command_started("r1"))
    assert policy.loss_pending(state)
    state = apply(state, policy.after_loss(state))
    assert policy.loss_pending(state)  # ended, not yet fenced
    state = apply(state, policy.declare_fenced(state, host=HOST_A))
    assert not policy.loss_pending(state)  # lost for good until asked back: nothing to say
    # fenced first, commands still to end: still pending
    state = lost_sandbox(run("r1"), dispatched("r1"), command_started("r1"))
    state = apply(state, policy.declare_fenced(state, host=HOST_A))
    assert policy.loss_pending(state)
