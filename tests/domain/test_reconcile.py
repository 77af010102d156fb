"""`plan`: what the scheduler does next, read off the state alone."""

from __future__ import annotations

import pytest
from sandhold.domain import events as ev
from sandhold.domain import work as wk
from sandhold.domain.placement import HostInfo, Waiting, why_waiting
from sandhold.domain.reconcile import ChooseHost, Plan, plan
from sandhold.domain.reports import decide_report
from sandhold.domain.sandbox import Sandbox

from .history import (
    DELETED,
    FAILED,
    HOST_A,
    HOST_B,
    PENDING,
    PLACED,
    RUNNING,
    SID,
    STARTING,
    STOPPED,
    STOPPING,
    Step,
    apply,
    cancel,
    cmd,
    command_ended,
    command_started,
    create,
    delete,
    dispatched,
    given_sandbox,
    placed,
    run,
    start,
    started,
    starting,
    stop,
    stopped,
)

MiB = 1024 * 1024


def no_host(_: Sandbox) -> str | None:
    return None


def host_b(_: Sandbox) -> str | None:
    return HOST_B


def must_not_choose(state: Sandbox) -> str | None:
    raise AssertionError(f"placement asked for {state.id} in phase {state.phase}")


def settle(state: Sandbox, choose_host: ChooseHost = no_host) -> Sandbox:
    """Plan and apply until plan has no more events (it must get there quickly)."""
    for _ in range(5):
        events = plan(state, choose_host).events
        if not events:
            return state
        state = apply(state, events)
    raise AssertionError(f"plan did not settle: {plan(state, choose_host)}")


# --- placement -------------------------------------------------------------------


def test_a_sandbox_no_host_can_take_says_why_once_and_forgets_it_when_placed() -> None:
    state = given_sandbox(create())
    full = Waiting("no host has room: 64/64")
    assert plan(state, lambda _: full).events == [ev.SandboxWaiting(reason=full.reason)]
    state = apply(state, plan(state, lambda _: full).events)
    assert (state.phase, state.reason) == ("pending", full.reason)
    assert plan(state, lambda _: full).events == []  # said once, not on every pass
    other = Waiting("no host is live (1 registered, none renewing its lease)")
    assert plan(state, lambda _: other).events == [ev.SandboxWaiting(reason=other.reason)]
    assert plan(state, no_host).events == []  # not this scheduler's to say
    placed = apply(state, plan(state, host_b).events)
    assert (placed.phase, placed.reason) == ("placed", "")
    assert apply(placed, [ev.SandboxWaiting(reason=full.reason)]).reason == ""  # too late


def test_why_no_host_names_what_rules_them_all_out() -> None:
    def host(name: str, **kw: object) -> HostInfo:
        return HostInfo(host=name, capacity_sandboxes=2, memory_bytes=4 * MiB, **kw)  # type: ignore[arg-type]

    def why(hosts: list[HostInfo], **kw: object) -> str:
        settings = {"memory_limit_bytes": None, **kw}
        return why_waiting(hosts, {"a": 2, "b": 2}, **settings).reason  # type: ignore[arg-type]

    assert why([]) == "no host is registered"
    assert why([host("a", live=False)]).startswith("no host is live")
    assert (
        why([host("a")], memory_limit_bytes=8 * MiB)
        == f"no live host has {8 * MiB} bytes of memory"
    )
    isolated = host("a", network_modes=frozenset({"none"}))
    assert why([isolated], network="egress") == "no live host enforces network 'egress'"
    assert why([host("a")], disk_limit_bytes=MiB) == "no live host gives a sandbox a disk quota"
    assert why([host("a")]) == "no host has room: 2/2"
    assert why([host("a"), host("b"), host("c", live=False)]) == "no host has room: 4/4 on 2 hosts"


def test_a_pending_sandbox_is_placed_on_the_chosen_host_with_the_next_generation() -> None:
    state = given_sandbox(create(memory_limit_bytes=64 * MiB))
    assert plan(state, host_b) == Plan([ev.SandboxPlaced(host=HOST_B, generation=1)], [])
    placed_state = apply(state, plan(state, host_b).events)
    assert (placed_state.phase, placed_state.host, placed_state.generation) == (
        "placed",
        HOST_B,
        1,
    )


def test_a_pending_sandbox_with_no_host_to_take_it_waits() -> None:
    assert plan(given_sandbox(*PENDING), no_host) == Plan([], [])


def test_a_restart_is_placed_with_a_new_generation_and_knows_its_old_host() -> None:
    seen: list[str | None] = []

    def choose(state: Sandbox) -> str | None:
        seen.append(state.host)  # the host the workspace lives on, to prefer it
        return HOST_A

    state = given_sandbox(*STOPPED, start())
    assert plan(state, choose).events == [ev.SandboxPlaced(host=HOST_A, generation=2)]
    assert seen == [HOST_A]


def test_a_placed_sandbox_is_started_by_its_host() -> None:
    state = given_sandbox(create(memory_limit_bytes=64 * MiB), placed())
    start_work = wk.StartSandboxWork(sandbox_id=SID, generation=1, memory_limit_bytes=64 * MiB)
    assert plan(state, must_not_choose) == Plan([], [(HOST_A, start_work)])


def test_a_sandbox_is_started_with_every_limit_and_setting_it_was_created_with() -> None:
    asked = create(
        network="egress", image="tiny", pids_limit=64, cpu_limit=0.5, disk_limit_bytes=128 * MiB
    )
    state = given_sandbox(asked, placed())
    start_work = wk.StartSandboxWork(
        sandbox_id=SID, generation=1, network="egress", image="tiny",
        pids_limit=64, cpu_limit=0.5, disk_limit_bytes=128 * MiB,
    )  # fmt: skip
    assert plan(state, must_not_choose) == Plan([], [(HOST_A, start_work)])


@pytest.mark.parametrize(
    "history",
    [STARTING, RUNNING, STOPPED, FAILED, DELETED],
    ids=["starting", "running", "stopped", "failed", "deleted"],
)
def test_a_sandbox_with_nothing_to_do_plans_nothing(history: tuple[Step, ...]) -> None:
    assert plan(given_sandbox(*history), must_not_choose) == Plan([], [])


# --- commands --------------------------------------------------------------------------


def test_queued_commands_are_dispatched_in_queue_order_then_run() -> None:
    # Queued while the sandbox started (on a running one a run is dispatched by
    # its own event, decision 098): dispatched once it runs.
    waiting = (run("run-1"), run("run-2", argv=["make"]), run("run-3"))
    state = given_sandbox(*STARTING, *waiting, started())
    first = plan(state, must_not_choose)
    assert first.events == [dispatched("run-1"), dispatched("run-2"), dispatched("run-3")]
    assert first.work == []

    state = apply(state, first.events)
    second = plan(state, must_not_choose)
    assert second.events == []
    assert [
        (host, w.command_id) for host, w in second.work if isinstance(w, wk.RunCommandWork)
    ] == [
        (HOST_A, cmd("run-1")),
        (HOST_A, cmd("run-2")),
        (HOST_A, cmd("run-3")),
    ]
    assert len(second.work) == 3


def test_the_run_instruction_carries_the_whole_command() -> None:
    request = run(argv=["pytest"], cwd="/src", env={"CI": "1"}, timeout_s=30.0, kill_grace_s=1.0)
    state = given_sandbox(*RUNNING, request, dispatched())
    assert plan(state, must_not_choose).work == [
        (
            HOST_A,
            wk.RunCommandWork(
                sandbox_id=SID,
                generation=1,
                command_id=cmd(),
                argv=["pytest"],
                cwd="/src",
                env={"CI": "1"},
                timeout_s=30.0,
                kill_grace_s=1.0,
                request_key="run-1",  # an end compacted away is told by it (decision 057)
            ),
        )
    ]


def test_a_started_command_is_not_sent_again() -> None:
    state = given_sandbox(*RUNNING, run(), dispatched(), command_started())
    assert plan(state, must_not_choose) == Plan([], [])


def test_planning_twice_gives_the_same_instructions_with_the_same_ids() -> None:
    state = given_sandbox(*RUNNING, run(), dispatched())
    first, again = plan(state, no_host), plan(state, no_host)
    assert first == again
    assert [w.msg_id for _, w in first.work] == [f"run_command:{cmd()}:1"]


@pytest.mark.parametrize(
    "history", [PENDING, PLACED, STARTING], ids=["pending", "placed", "starting"]
)
def test_queued_commands_wait_for_the_sandbox_to_run(history: tuple[Step, ...]) -> None:
    state = given_sandbox(*history, run())
    assert not [e for e in plan(state, no_host).events if not isinstance(e, ev.SandboxPlaced)]


@pytest.mark.parametrize(
    ("history", "phase"),
    [
        ((*STARTING, run(), started(), stop()), "stopping"),
        ((*STARTING, run(), started(), stop(), stopped()), "stopped"),
        ((*PENDING, run(), stop()), "stopped"),
        ((*STARTING, run(), stop()), "stopping"),
    ],
    ids=["stopping", "stopped", "stopped-while-pending", "stopping-while-starting"],
)
def test_a_command_queued_on_a_sandbox_that_stopped_is_not_launched(
    history: tuple[Step, ...], phase: str
) -> None:
    state = given_sandbox(*history)
    assert state.phase == phase
    [ended] = plan(state, must_not_choose).events
    assert ended == ev.CommandEnded(
        command_id=cmd(),
        state="not_launched",
        reason=f"the sandbox was {phase} before it started",
        host=state.host,
        generation=state.generation,
    )


def test_a_command_queued_on_a_sandbox_being_deleted_is_not_launched() -> None:
    state = given_sandbox(*PENDING, run(), delete())
    events = plan(state, must_not_choose).events
    assert [(type(e), getattr(e, "state", None)) for e in events] == [
        (ev.CommandEnded, "not_launched"),
        (ev.SandboxDeleted, None),
    ]


@pytest.mark.parametrize(
    "history", [(*PENDING, run()), (*STARTING, run(), started())], ids=["pending", "running"]
)
def test_cancelling_a_queued_command_means_it_is_not_launched(history: tuple[Step, ...]) -> None:
    state = given_sandbox(*history, cancel(cmd()))
    events = [e for e in plan(state, no_host).events if isinstance(e, ev.CommandEnded)]
    assert events == [
        ev.CommandEnded(
            command_id=cmd(),
            state="not_launched",
            reason="cancelled before it started",
            host=state.host,
            generation=state.generation,
        )
    ]
    assert not [e for e in plan(state, no_host).events if isinstance(e, ev.CommandDispatched)]


@pytest.mark.parametrize(
    "progress", [(dispatched(),), (dispatched(), command_started())], ids=["dispatched", "running"]
)
def test_cancelling_a_launched_command_asks_its_host_to_cancel(progress: tuple[Step, ...]) -> None:
    state = given_sandbox(*RUNNING, run(), *progress, cancel(cmd()))
    cancel_work = wk.CancelCommandWork(sandbox_id=SID, generation=1, command_id=cmd())
    # A dispatched command that is cancelled is never sent to run.
    assert plan(state, must_not_choose) == Plan([], [(HOST_A, cancel_work)])
    assert cancel_work.msg_id == f"cancel_command:{cmd()}:1"


def test_an_ended_command_needs_nothing_even_if_cancelled() -> None:
    state = given_sandbox(*RUNNING, run(), dispatched(), cancel(cmd()), command_ended())
    assert plan(state, must_not_choose) == Plan([], [])


def test_a_command_dispatched_before_a_stop_still_ends() -> None:
    # The dispatch is recorded, then a stop lands before the next plan. The run
    # instruction is only sent while the sandbox runs, so the host never hears of
    # the command and will never report its end: the domain must end it itself.
    state = given_sandbox(*RUNNING, run(), dispatched(), stop())
    stopping_plan = plan(state, no_host)
    assert not [w for _, w in stopping_plan.work if isinstance(w, wk.RunCommandWork)]
    state = apply(state, stopping_plan.events)
    state = settle(apply(state, decide_report(state, stopped())))
    assert state.phase == "stopped"
    command = state.commands[cmd()]
    assert command.ended, f"command left {command.state!r} after its sandbox stopped"


# --- stop and delete -------------------------------------------------------------------


def test_a_stopping_sandbox_is_stopped_by_its_host_with_a_final_save() -> None:
    state = given_sandbox(*STOPPING)
    assert state.final_save_id is not None
    stop_work = wk.StopSandboxWork(sandbox_id=SID, generation=1, final_save_id=state.final_save_id)
    assert plan(state, must_not_choose) == Plan([], [(HOST_A, stop_work)])
    assert stop_work.msg_id == f"stop_sandbox:{SID}:1"


def test_deleting_a_running_sandbox_stops_it_then_destroys_it() -> None:
    state = given_sandbox(*RUNNING, delete())
    stop_work = wk.StopSandboxWork(sandbox_id=SID, generation=1, final_save_id=None)
    assert plan(state, must_not_choose) == Plan([], [(HOST_A, stop_work)])
    state = apply(state, decide_report(state, stopped()))
    destroy = wk.DestroySandboxWork(sandbox_id=SID, generation=1)
    assert plan(state, must_not_choose) == Plan([], [(HOST_A, destroy)])


@pytest.mark.parametrize("history", [STOPPED, FAILED], ids=["stopped", "failed"])
def test_deleting_a_sandbox_with_a_workspace_asks_its_host_to_destroy_it(
    history: tuple[Step, ...],
) -> None:
    destroy = wk.DestroySandboxWork(sandbox_id=SID, generation=1)
    assert plan(given_sandbox(*history, delete()), must_not_choose) == Plan([], [(HOST_A, destroy)])


def test_deleting_a_restarted_sandbox_still_waiting_for_a_host_destroys_its_workspace() -> None:
    state = given_sandbox(*STOPPED, start(), delete())
    destroy = wk.DestroySandboxWork(sandbox_id=SID, generation=1)
    assert plan(state, must_not_choose) == Plan([], [(HOST_A, destroy)])


@pytest.mark.parametrize(
    "history",
    [(*PENDING, delete()), (*PENDING, stop(), delete())],
    ids=["pending", "stopped-before-placement"],
)
def test_deleting_a_never_placed_sandbox_deletes_it_at_once(history: tuple[Step, ...]) -> None:
    state = given_sandbox(*history)
    assert plan(state, must_not_choose) == Plan([ev.SandboxDeleted(host=None, generation=0)], [])
    assert apply(state, plan(state, must_not_choose).events).phase == "deleted"


# --- level-triggered: a fixpoint -------------------------------------------------------

FIXPOINT_HISTORIES: dict[str, tuple[Step, ...]] = {
    "pending": PENDING,
    "pending-restart": (*STOPPED, start()),
    "placed": PLACED,
    "starting": STARTING,
    "running": RUNNING,
    # (Queued while it started: a run on a running sandbox is dispatched at once, 098.)
    "running-with-queue": (*STARTING, run("run-1"), run("run-2"), started(), cancel(cmd("run-2"))),
    "running-with-dispatched": (*RUNNING, run(), dispatched()),
    "running-with-dispatched-at-once": (*RUNNING, run()),
    "running-with-one-cancelled-before-its-run-came": (*RUNNING, run(), cancel(cmd())),
    "running-with-cancelled": (*RUNNING, run(), dispatched(), command_started(), cancel(cmd())),
    "stopping-with-queue": (*STARTING, run(), started(), stop()),
    "stopping-with-dispatched-at-once": (*RUNNING, run(), stop()),
    "stopped-with-queue": (*PENDING, run(), stop()),
    "deleting-pending-with-queue": (*PENDING, run(), delete()),
    "deleting-running": (*RUNNING, run(), delete()),
    "deleting-stopped": (*STOPPED, delete()),
    "failed": FAILED,
    "deleted": DELETED,
    "replaced": (*STOPPED, start(), placed(HOST_B, 2), starting(HOST_B, 2), started(HOST_B, 2)),
}


@pytest.mark.parametrize("name", FIXPOINT_HISTORIES)
@pytest.mark.parametrize("choose_host", [no_host, host_b], ids=["no-host", "host-b"])
def test_plan_reaches_a_fixpoint(name: str, choose_host: ChooseHost) -> None:
    state = given_sandbox(*FIXPOINT_HISTORIES[name])
    first = plan(state, choose_host)
    after = apply(state, first.events)
    assert plan(after, choose_host).events == []
    # Work is level-triggered too: planning the same state again repeats it exactly.
    assert plan(state, choose_host) == first


def test_work_for_a_running_sandbox_goes_to_its_current_host() -> None:
    state = given_sandbox(
        *STOPPED, start(), placed(HOST_B, 2), starting(HOST_B, 2), started(HOST_B, 2), run()
    )
    state = apply(state, plan(state, no_host).events)
    assert [(host, w.generation) for host, w in plan(state, no_host).work] == [(HOST_B, 2)]
