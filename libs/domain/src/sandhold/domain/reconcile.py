"""What the scheduler must do next for a sandbox, read off its state alone.

`plan` is level-triggered: it looks only at the state, never at which event
just arrived, so it can run after every change, after a restart, or in two
schedulers at once. Its events are appended with the usual fence; its work
messages carry deterministic ids, so sending one twice is harmless.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
from sandhold.domain import events as ev
from sandhold.domain import work as wk
from sandhold.domain.placement import Waiting
from sandhold.domain.sandbox import Sandbox, accepts_commands, dispatch_to, wakes_on_command

# A host, or why there is none (written down once per reason), or None: not
# this scheduler's to decide (another holds the placement claim).
ChooseHost = Callable[[Sandbox], str | Waiting | None]


class Plan(msgspec.Struct, frozen=True):
    events: list[ev.AnyEvent]
    work: list[tuple[str, wk.AnyWork]]  # (host, instruction)


def plan(
    state: Sandbox, choose_host: ChooseHost, host_alive: Callable[[str], bool] = lambda _: True
) -> Plan:
    events: list[ev.AnyEvent] = []
    work: list[tuple[str, wk.AnyWork]] = []
    sid, gen, host = state.id, state.generation, state.host
    # (A sandbox reaped for being idle holds its commands: they wake it.)
    can_launch = accepts_commands(state)

    for command in state.queued_commands():
        if command.cancel_requested:
            events.append(_not_launched(state, command.id, "cancelled before it started"))
        elif state.delete_requested or not can_launch:
            events.append(
                _not_launched(state, command.id, f"the sandbox was {state.phase} before it started")
            )
        elif (to := dispatch_to(state)) is not None:
            events.append(
                ev.CommandDispatched(command_id=command.id, host=to.host, generation=to.generation)
            )

    # Queued commands that will run: not cancelled, not on a sandbox being deleted
    # (those end above). Only these are demand that wakes or recovers a sandbox.
    demand = [
        c.id
        for c in state.queued_commands()
        if not c.cancel_requested and not state.delete_requested
    ]
    if state.phase == "stopped" and demand and wakes_on_command(state):
        # Started again from its final save, wherever there is room; then they run.
        first = demand[0]
        events.append(
            ev.SandboxStartRequested(request_key=f"wake:{first}", request_digest="", woken_by=first)
        )

    if state.phase in ("stopped", "failed", "deleted"):
        # The host is done with this placement; a command it never reported on
        # may or may not have run, and sandhold says so instead of guessing.
        lost_generation = state.lost.generation if state.lost is not None else None
        for command in state.unended_commands():
            if command.generation == lost_generation:
                continue  # ended by recovery as the loss implies (infrastructure_lost)
            if command.state in ("dispatched", "running"):
                events.append(
                    ev.CommandEnded(
                        command_id=command.id,
                        state="unknown",
                        reason="the sandbox stopped before its host reported how the command ended",
                        host=state.host,
                        generation=state.generation,
                        output_complete=False,
                    )
                )

    # After a host failure nothing is placed until the failed host can no longer
    # write (the fence): then a start, a command, or the eager policy brings it back.
    fenced = state.lost is None or state.lost.fenced
    if state.phase in ("pending", "recovering") and not state.delete_requested and fenced:
        chosen = choose_host(state)
        if isinstance(chosen, str):
            events.append(
                ev.SandboxPlaced(
                    host=chosen, generation=gen + 1, restore_save_id=state.restore_point()
                )
            )
        elif isinstance(chosen, Waiting) and chosen.reason != state.reason:
            events.append(ev.SandboxWaiting(reason=chosen.reason))
    elif state.phase == "lost" and fenced and demand:
        # A command queued in the moment before the loss is demand, as a new one
        # would be: it brings the sandbox back (else it waits for a command that
        # may never come; decision 043).
        events.append(ev.SandboxRecoveryRequested(cause="command"))
    elif (
        state.phase == "lost"
        and fenced
        and state.recovery_policy == "eager"
        and not state.delete_requested
    ):
        events.append(ev.SandboxRecoveryRequested(cause="eager"))
    elif state.phase == "placed" and host is not None:
        start = wk.StartSandboxWork(
            sandbox_id=sid,
            generation=gen,
            memory_limit_bytes=state.memory_limit_bytes,
            network=state.network,
            image=state.image,
            pids_limit=state.pids_limit,
            cpu_limit=state.cpu_limit,
            disk_limit_bytes=state.disk_limit_bytes,
            restore_save_id=state.restore_save_id,
            restore_manifest_digest=state.restore_digest(),
            connections_revision=state.connections_revision,
            connection_value_ids=_value_ids(state),
        )
        work.append((host, start))
    elif state.phase == "stopping" and host is not None:
        final = state.saves.get(state.final_save_id) if state.final_save_id else None
        stop = wk.StopSandboxWork(
            sandbox_id=sid,
            generation=gen,
            final_save_id=final.id if final is not None else None,
            parent_save_id=final.parent_id if final is not None else None,
            deadline_s=state.stop_deadline_s,
        )
        work.append((host, stop))

    if state.delete_requested and state.phase in ("lost", "recovering"):
        # The failed host holds the only copy; it destroys stale copies itself.
        events.append(ev.SandboxDeleted(host=None, generation=gen))
    if state.delete_requested and state.phase in ("pending", "stopped", "failed"):
        # A dead host cannot destroy its copy; it drops it itself when it returns.
        if host is None or not host_alive(host):
            events.append(ev.SandboxDeleted(host=None, generation=gen))
        else:
            work.append((host, wk.DestroySandboxWork(sandbox_id=sid, generation=gen)))

    if state.phase == "running" and host is not None and not state.connections_current:
        deliver = wk.DeliverConnectionsWork(
            sandbox_id=sid,
            generation=gen,
            revision=state.connections_revision,
            connection_value_ids=_value_ids(state),
        )
        work.append((host, deliver))
    if state.phase == "running" and host is not None:
        for command in state.unended_commands():
            if command.generation != gen:
                continue
            if command.state == "dispatched" and not command.cancel_requested:
                work.append((host, _run_work(state, command.id)))
            if command.cancel_requested and command.state in ("dispatched", "running"):
                cancel = wk.CancelCommandWork(sandbox_id=sid, generation=gen, command_id=command.id)
                work.append((host, cancel))
    return Plan(events, work)


def _value_ids(state: Sandbox) -> dict[str, str]:
    return {name: c.value_id for name, c in state.connections.items()}


def _run_work(state: Sandbox, command_id: str) -> wk.RunCommandWork:
    c = state.commands[command_id]
    return wk.RunCommandWork(
        sandbox_id=state.id,
        generation=state.generation,
        command_id=c.id,
        argv=c.argv,
        cwd=c.cwd,
        env=c.env,
        timeout_s=c.timeout_s,
        kill_grace_s=c.kill_grace_s,
        user=c.user,
        request_key=c.request_key,
    )


def secrets_gone(state: Sandbox, command_id: str) -> ev.CommandEnded:
    """A command whose secrets are no longer kept cannot run as asked."""
    return _not_launched(
        state,
        command_id,
        "its secrets are no longer kept (a week unlaunched, or lost with the bus): send it again",
    )


def _not_launched(state: Sandbox, command_id: str, reason: str) -> ev.CommandEnded:
    return ev.CommandEnded(
        command_id=command_id,
        state="not_launched",
        reason=reason,
        host=state.host,
        generation=state.generation,
    )
