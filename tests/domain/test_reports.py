"""`decide_report`: the generation fence, and each report being news exactly once."""

from __future__ import annotations

import pytest
from sandhold.domain import events as ev
from sandhold.domain.errors import Rejected
from sandhold.domain.reports import HostReport, decide_report

from .history import (
    DELETED,
    FAILED,
    HOST_A,
    HOST_B,
    PENDING,
    PLACED,
    RUNNING,
    STARTING,
    STOPPED,
    STOPPING,
    Step,
    apply,
    command_ended,
    command_started,
    delete,
    deleted,
    dispatched,
    given,
    given_sandbox,
    placed,
    queued,
    run,
    start,
    start_failed,
    started,
    starting,
    stop,
    stopped,
)

# Running on host-b at generation 2, after a first life on host-a at generation 1,
# with a command dispatched to the current placement.
REPLACED: tuple[Step, ...] = (
    *STOPPED,
    start(),
    placed(HOST_B, 2),
    starting(HOST_B, 2),
    started(HOST_B, 2),
    run(),
    dispatched(host=HOST_B, generation=2),
)


def _every_report(host: str, generation: int) -> list[HostReport]:
    return [
        starting(host, generation),
        started(host, generation),
        start_failed(host, generation),
        stopped(host, generation),
        deleted(host, generation),
        command_started(host=host, generation=generation),
        command_ended(host=host, generation=generation),
    ]


def _name(report: HostReport) -> str:
    return type(report).__struct_config__.tag  # type: ignore[return-value]


def _then_stale(report: HostReport, history: tuple[Step, ...] = REPLACED) -> None:
    with pytest.raises(Rejected) as refusal:
        decide_report(given(*history), report)
    assert refusal.value.code == "stale_generation"
    assert str(report.generation) in refusal.value.message


@pytest.mark.parametrize("report", _every_report(HOST_A, 1), ids=_name)
def test_a_report_from_a_superseded_placement_is_stale(report: HostReport) -> None:
    _then_stale(report)


@pytest.mark.parametrize("report", _every_report(HOST_B, 1), ids=_name)
def test_a_report_from_the_right_host_with_an_old_generation_is_stale(report: HostReport) -> None:
    _then_stale(report)


@pytest.mark.parametrize("report", _every_report(HOST_B, 3), ids=_name)
def test_a_report_from_a_future_generation_is_stale(report: HostReport) -> None:
    _then_stale(report)


@pytest.mark.parametrize("report", _every_report(HOST_A, 2), ids=_name)
def test_a_report_from_another_host_with_the_current_generation_is_stale(
    report: HostReport,
) -> None:
    _then_stale(report)


@pytest.mark.parametrize("report", _every_report(HOST_A, 1), ids=_name)
def test_a_report_before_any_placement_is_stale(report: HostReport) -> None:
    _then_stale(report, history=PENDING)


def test_a_report_for_a_sandbox_that_does_not_exist_is_refused() -> None:
    with pytest.raises(Rejected) as refusal:
        decide_report(None, started())
    assert refusal.value.code == "sandbox_not_found"


# --- news once -----------------------------------------------------------------------

NEWS: dict[str, tuple[tuple[Step, ...], HostReport, str]] = {
    # name: (history, report, the phase or command state it leads to)
    "starting-when-placed": (PLACED, starting(), "starting"),
    "started-when-placed": (PLACED, started(), "running"),
    "started-when-starting": (STARTING, started(), "running"),
    "start-failed-when-placed": (PLACED, start_failed(), "failed"),
    "start-failed-when-starting": (STARTING, start_failed(), "failed"),
    "stopped-when-stopping": (STOPPING, stopped(), "stopped"),
    "stopped-when-running": (RUNNING, stopped(), "stopped"),
    "stopped-when-placed": (PLACED, stopped(), "stopped"),
    "deleted-when-stopped": ((*STOPPED, delete()), deleted(), "deleted"),
    "deleted-when-failed": ((*FAILED, delete()), deleted(), "deleted"),
    "command-started": ((*RUNNING, run(), dispatched()), command_started(), "running"),
    "command-ended-when-running": (
        (*RUNNING, run(), dispatched(), command_started()),
        command_ended(),
        "exited",
    ),
    "command-ended-when-dispatched": (
        (*RUNNING, run(), dispatched()),
        command_ended(state="launch_failed", exit_code=None),
        "launch_failed",
    ),
}


def _reached(history: tuple[Step, ...], report: HostReport) -> str:
    state = apply(given(*history), [report])
    if isinstance(report, ev.CommandStarted | ev.CommandEnded):
        return state.commands[report.command_id].state
    return state.phase


@pytest.mark.parametrize("name", NEWS)
def test_a_report_is_news_once_and_nothing_when_repeated(name: str) -> None:
    history, report, reached = NEWS[name]
    state = given(*history)
    assert decide_report(state, report) == [report]
    assert _reached(history, report) == reached
    assert decide_report(apply(state, [report]), report) == []


NOT_NEWS: dict[str, tuple[tuple[Step, ...], HostReport]] = {
    "starting-when-running": (RUNNING, starting()),
    "starting-when-stopping": (STOPPING, starting()),
    "started-when-stopping": (STOPPING, started()),
    "start-failed-when-running": (RUNNING, start_failed()),
    "stopped-when-failed": (FAILED, stopped()),
    "deleted-when-deleted": (DELETED, deleted()),
    "command-started-for-an-unknown-command": (RUNNING, command_started()),
    "command-started-for-a-queued-command": ((*RUNNING, queued()), command_started()),
    "command-ended-for-an-unknown-command": (RUNNING, command_ended()),
    "command-ended-again-in-another-state": (
        (*RUNNING, run(), dispatched(), command_started(), command_ended()),
        command_ended(state="interrupted", exit_code=None),
    ),
}


@pytest.mark.parametrize("name", NOT_NEWS)
def test_a_report_that_changes_nothing_is_not_news(name: str) -> None:
    history, report = NOT_NEWS[name]
    assert decide_report(given(*history), report) == []


def test_the_first_end_of_a_command_is_the_one_kept() -> None:
    history = (*RUNNING, run(), dispatched(), command_started(), command_ended(exit_code=3))
    late = command_ended(state="interrupted", exit_code=None)
    state = given_sandbox(*history)
    assert decide_report(state, late) == []
    command = state.commands[late.command_id]
    assert (command.state, command.exit_code) == ("exited", 3)


def test_a_late_report_from_the_old_placement_is_accepted_until_it_is_replaced() -> None:
    # Asked to start again, the sandbox waits for a host on its old placement, so the old
    # host can still finish reporting; once placed anew, the same report is stale.
    history = (*RUNNING, run(), dispatched(), command_started(), stop(), stopped(), start())
    late = command_ended(state="interrupted", exit_code=None)
    assert decide_report(given(*history), late) == [late]
    _then_stale(late, history=(*history, placed(HOST_A, 2)))


@pytest.mark.parametrize(
    "history", [RUNNING, STOPPED, FAILED, PLACED], ids=["running", "stopped", "failed", "placed"]
)
def test_a_hosts_word_alone_deletes_no_sandbox(history: tuple[Step, ...]) -> None:
    """A host destroys a copy when told to, after a delete request; a deletion
    it reports for a sandbox nobody asked to delete is refused."""
    with pytest.raises(Rejected) as refusal:
        decide_report(given(*history), deleted())
    assert refusal.value.code == "delete_not_requested"
