"""A command is watched from its launch, while its start is being reported; its
end is reported only after its start, even when that report failed once and
was tried again; and a command that ends within moments of its start has its
end alone reported, with its pid (decision 095); a watcher stopped lets its
supervisor go. A real server, driver and supervisor."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from sandhold.domain import events as ev
from sandhold.domain import sandbox as sb
from sandhold.domain.errors import InfraError
from sandhold.domain.fold import fold
from sandhold.hostagent import service
from sandhold.hostagent.driver import ProcessDriver

from tests.support.waiting import wait_until


async def test_the_end_waits_for_a_start_whose_report_failed_once(
    dispatch, driver: ProcessDriver, monkeypatch: pytest.MonkeyPatch
):
    # (It runs past the delay, so its start is reported; it ends while the
    # report of its start is still being tried again.)
    monkeypatch.setattr(service, "START_REPORT_DELAY_S", 0.05)
    command = await dispatch(["sleep", "0.3"])
    agent = command.agent
    reports: list[str] = []
    retried = asyncio.Event()
    report = agent._report

    async def first_start_report_fails(sandbox: str, event: Any, cause: str) -> None:
        reports.append(event.__struct_config__.tag)
        if reports == ["command.started"]:
            raise InfraError("the bus did not answer", retryable=True)
        if reports == ["command.started", "command.started"]:
            await retried.wait()  # held until the test has looked
        await report(sandbox, event, cause)

    agent._report = first_start_report_fails  # type: ignore[method-assign]
    await agent._do(command.work)  # launched: its start is the watcher's to report
    handle = driver.handle(command.sandbox_id, command.command_id)
    await asyncio.wait_for(handle.wait(), 30)  # it has ended: its end is known
    await wait_until(
        lambda: reports == ["command.started", "command.started"],
        timeout=30,
        what="the start's report tried again",
    )
    assert "command.ended" not in reports, "nothing reported before the start"
    retried.set()
    await command.ended()
    assert await command.last_types(3) == ["command.queued", "command.started", "command.ended"]
    assert reports == ["command.started", "command.started", "command.ended"]


async def test_a_command_that_ends_at_once_has_its_end_alone_reported_with_its_pid(
    dispatch, driver: ProcessDriver, monkeypatch: pytest.MonkeyPatch
):
    # (A delay no loaded machine outlasts between a `true`'s start and its end.)
    monkeypatch.setattr(service, "START_REPORT_DELAY_S", 30.0)
    command = await dispatch(["true"])
    await command.agent._do(command.work)
    await command.ended()
    assert await command.last_types(2) == ["command.queued", "command.ended"]
    events = await command.events()
    pid = await driver.handle(command.sandbox_id, command.command_id).started()
    assert isinstance(pid, int)
    state = fold(sb.evolve, events, None)
    assert state is not None
    assert state.commands[command.command_id].state == "exited"
    assert state.commands[command.command_id].pid == pid


async def test_a_command_still_running_after_the_delay_has_its_start_reported(
    dispatch, driver: ProcessDriver, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(service, "START_REPORT_DELAY_S", 0.05)
    command = await dispatch(["sleep", "1"])
    await command.agent._do(command.work)
    await command.ended()
    assert await command.last_types(3) == ["command.queued", "command.started", "command.ended"]
    events = await command.events()
    started, end = events[-2].event, events[-1].event
    assert isinstance(started, ev.CommandStarted) and isinstance(end, ev.CommandEnded)
    assert end.pid == started.pid


async def test_waiting_to_report_a_start_holds_up_no_other_work(
    dispatch, driver: ProcessDriver, monkeypatch: pytest.MonkeyPatch
):
    # The sandbox's lane takes its next instruction once the command is launched,
    # not once its start is reported (which waits to see whether it ends at once).
    monkeypatch.setattr(service, "START_REPORT_DELAY_S", 60.0)
    command = await dispatch(["sleep", "30"])
    await asyncio.wait_for(command.agent._do(command.work), 30)  # well within the delay
    handle = driver.handle(command.sandbox_id, command.command_id)
    assert isinstance(await handle.started(), int)
    assert handle.exit_record() is None, "returned while the command runs"
    assert [e.type for e in await command.events()][-1] == "command.queued"


async def test_an_adopted_command_whose_start_went_unreported_has_it_reported(
    dispatch, driver: ProcessDriver, make_driver, monkeypatch: pytest.MonkeyPatch
):
    # The agent before launched it and died within the delay: its start was never
    # reported. The next agent adopts it, and reports its start while it runs.
    monkeypatch.setattr(service, "START_REPORT_DELAY_S", 0.05)
    command = await dispatch(["sleep", "30"])
    launched = await driver.launch(command.sandbox_id, command.command_id, ["sleep", "30"])
    assert isinstance(await launched.started(), int)
    await driver.close()  # (the agent before: gone, its supervisor is not)
    agent = command.agent
    agent.driver = await make_driver()
    agent._generation_file(command.sandbox_id).write_text("1")  # (as its start wrote it)
    await agent.sandboxes.sync(command.sandbox_id)
    await agent._adopt_commands()
    assert set(agent._watchers) == {command.command_id}

    async def started() -> bool:
        return [e.type for e in await command.events()][-1] == "command.started"

    await wait_until(started, timeout=30, what="the adopted command's start reported")
    event = (await command.events())[-1].event
    assert isinstance(event, ev.CommandStarted) and event.pid == await launched.started()


async def test_a_watcher_cancelled_again_while_its_start_report_unwinds_still_lets_go(
    dispatch, driver: ProcessDriver, monkeypatch: pytest.MonkeyPatch
):
    # A stop cancels watchers again and again; one cancellation can reach the
    # watcher while it waits for its start's report to end. Its supervisor must
    # still be let go: kept, it could be handed another command (decision 088).
    command = await dispatch(["sleep", "30"])
    agent = command.agent
    reporting, unwinding = asyncio.Event(), asyncio.Event()

    async def slow_to_unwind(_handle: Any, launch: Any) -> None:
        reporting.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            unwinding.set()
            await asyncio.sleep(0.3)  # (a report's round trip, finished before it ends)
            raise
        finally:
            launch.start_told.set()

    let_go: list[str] = []
    real_let_go = driver.let_go
    monkeypatch.setattr(agent, "_report_start", slow_to_unwind)
    monkeypatch.setattr(driver, "let_go", lambda s, c: (let_go.append(c), real_let_go(s, c)))
    await agent._do(command.work)
    watcher = agent._watchers[command.command_id]
    await asyncio.wait_for(reporting.wait(), 10)
    watcher.cancel()
    await asyncio.wait_for(unwinding.wait(), 10)
    watcher.cancel()  # (again, while the start's report unwinds)
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(watcher, 10)
    assert let_go == [command.command_id]
    assert await driver.interrupt(command.sandbox_id, command.command_id, grace_s=0.0)
