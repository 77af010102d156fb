"""A command dispatched to this host whose run instruction had not come when
its cancel or its sandbox's stop was decided never runs, and the host says so:
`not_launched`, not left `dispatched` (decision 098 dispatches a command as it
is queued; the instruction follows a moment later). A real server, driver and
supervisor."""

from __future__ import annotations

from sandhold.domain import events as ev
from sandhold.domain import requests as rq
from sandhold.domain import sandbox as sb
from sandhold.domain import work as wk
from sandhold.domain.fold import fold
from sandhold.hostagent.driver import ProcessDriver

from tests.hostagent.dispatching import Dispatched
from tests.support.waiting import wait_until


async def _end_of(command: Dispatched) -> sb.Command:
    state = fold(sb.evolve, await command.events(), None)
    assert state is not None
    return state.commands[command.command_id]


async def _cancelled(command: Dispatched) -> None:
    cancel = rq.CancelCommand(
        key="cancel-1", sandbox_id=command.sandbox_id, command_id=command.command_id
    )
    await command.decided(cancel)


async def test_a_cancel_that_comes_before_the_run_ends_the_command_not_launched(
    dispatch, driver: ProcessDriver
):
    command = await dispatch(["sh", "-c", "touch ran"])
    marker = driver.workspace(command.sandbox_id) / "ran"
    await _cancelled(command)
    cancel = wk.CancelCommandWork(
        sandbox_id=command.sandbox_id, generation=1, command_id=command.command_id
    )
    await command.agent._do(cancel)
    ended = await _end_of(command)
    assert (ended.state, ended.reason) == ("not_launched", "cancelled before it started")
    # The run instruction, coming after all, finds it ended: nothing runs.
    await command.agent._do(command.work)
    assert not driver.launched(command.sandbox_id, command.command_id)
    assert not marker.exists()
    assert await command.last_types(2) == ["command.cancel_requested", "command.ended"]


async def test_a_run_whose_cancel_was_decided_first_is_not_launched(
    dispatch, driver: ProcessDriver
):
    command = await dispatch(["sh", "-c", "touch ran"])
    marker = driver.workspace(command.sandbox_id) / "ran"
    await _cancelled(command)
    await command.agent._do(command.work)
    ended = await _end_of(command)
    assert (ended.state, ended.reason) == ("not_launched", "cancelled before it started")
    assert not driver.launched(command.sandbox_id, command.command_id)
    assert not marker.exists()


async def test_a_cancel_of_a_launched_command_interrupts_it(dispatch, driver: ProcessDriver):
    # (Its marker is where the tests above look for one: a command that ran leaves it.)
    command = await dispatch(["sh", "-c", "touch ran; exec sleep 30"])
    await command.agent._do(command.work)
    marker = driver.workspace(command.sandbox_id) / "ran"
    await wait_until(marker.exists, timeout=30, what="the command's marker")
    await _cancelled(command)
    cancel = wk.CancelCommandWork(
        sandbox_id=command.sandbox_id, generation=1, command_id=command.command_id
    )
    await command.agent._do(cancel)
    await command.ended()
    assert (await _end_of(command)).state == "interrupted"


async def test_a_stop_ends_the_commands_whose_run_never_came_not_launched(
    dispatch, driver: ProcessDriver
):
    command = await dispatch(["true"])
    await command.decided(rq.StopSandbox(key="stop-1", sandbox_id=command.sandbox_id))
    # (No final save here: what the stop does with commands is what is looked at.)
    stop = wk.StopSandboxWork(sandbox_id=command.sandbox_id, generation=1)
    await command.agent._do(stop)
    ended = await _end_of(command)
    assert (ended.state, ended.reason) == (
        "not_launched",
        "the sandbox was stopping before it started",
    )
    assert await command.last_types(2) == ["command.ended", "sandbox.stopped"]
    assert not driver.launched(command.sandbox_id, command.command_id)


async def test_a_stop_leaves_a_launched_commands_end_to_the_command(
    dispatch, driver: ProcessDriver
):
    command = await dispatch(["sleep", "30"])
    await command.agent._do(command.work)
    await command.decided(rq.StopSandbox(key="stop-1", sandbox_id=command.sandbox_id))
    stop = wk.StopSandboxWork(sandbox_id=command.sandbox_id, generation=1)
    await command.agent._do(stop)
    ended = await _end_of(command)
    assert ended.state != "not_launched", ended
    events = await command.events()
    ends = [e for e in events if isinstance(e.event, ev.CommandEnded)]
    assert len(ends) == 1
