"""Deciding a host-agent's report of what happened on its host.

This is the generation fence in the domain: a report from a placement that has
since been superseded is rejected, so a host that was paused, cut off or
replaced can never change the sandbox's record.
"""

from __future__ import annotations

from sandhold.domain import events as ev
from sandhold.domain.errors import Rejected
from sandhold.domain.sandbox import ACTIVE_PHASES, Sandbox, deletion_asked
from sandhold.domain.saves import IN_FLIGHT

HostReport = (
    ev.SaveCaptured
    | ev.SaveUploaded
    | ev.SaveUnchanged
    | ev.SaveFailed
    | ev.SandboxStarting
    | ev.SandboxStarted
    | ev.SandboxStartFailed
    | ev.SandboxStopped
    | ev.SandboxDeleted
    | ev.CommandStarted
    | ev.CommandEnded
    | ev.ConnectionsDelivered
    | ev.ConnectionsDropped
)


def decide_report(state: Sandbox | None, report: HostReport) -> list[ev.AnyEvent]:
    """`[report]` when it is news, `[]` when already recorded; raises `Rejected` when stale."""
    if state is None:
        raise Rejected("sandbox_not_found", "report for a sandbox that does not exist")
    if report.generation != state.generation or report.host != state.host:
        raise Rejected(
            "stale_generation",
            f"report from {report.host} generation {report.generation}, but sandbox "
            f"{state.id} is at {state.host} generation {state.generation}",
        )
    if state.phase in ("lost", "recovering"):
        # Declared lost: nothing its host says about that placement counts any more.
        raise Rejected("sandbox_lost", f"sandbox {state.id} was declared lost on {state.host}")
    match report:
        case ev.SandboxStarting():
            news = state.phase == "placed"
        case ev.SandboxStarted() | ev.SandboxStartFailed():
            news = state.phase in ("placed", "starting")
        case ev.SandboxStopped():
            news = state.phase in ACTIVE_PHASES
        case ev.SandboxDeleted():
            if not deletion_asked(state):
                # A host destroys a copy only when told to, after a delete request:
                # its word alone does not delete a sandbox nobody asked to delete.
                raise Rejected("delete_not_requested", f"no delete of {state.id} was requested")
            news = state.phase != "deleted"
        case ev.CommandStarted():
            command = state.commands.get(report.command_id)
            news = command is not None and command.state == "dispatched"
        case ev.CommandEnded():
            command = state.commands.get(report.command_id)
            news = command is not None and not command.ended
        case ev.ConnectionsDelivered(revision=revision):
            delivered = state.connections_delivered
            news = state.phase in ("starting", "running") and (
                delivered is None or revision > delivered
            )
        case ev.ConnectionsDropped():
            news = (
                state.phase in ("starting", "running") and state.connections_delivered is not None
            )
        case ev.SaveCaptured():
            save = state.saves.get(report.save_id)
            news = save is not None and save.state == "requested"
        case ev.SaveUploaded():
            save = state.saves.get(report.save_id)
            news = save is not None and save.state in ("requested", "captured")
        case ev.SaveUnchanged():
            save = state.saves.get(report.save_id)
            news = save is not None and save.state == "requested"
            if news and save is not None and (save.kind != "scheduled" or save.parent_id is None):
                # A Snapshot is a restore point of its own and a final save is the
                # stop's: both are stored whatever they hold (decision 067). (A
                # late report of an ended save is no news, as any other report's.)
                raise Rejected(
                    "save_must_be_stored",
                    f"save {save.id} ({save.kind}, parent {save.parent_id}) cannot end unchanged",
                )
        case ev.SaveFailed():
            save = state.saves.get(report.save_id)
            news = save is not None and save.state in IN_FLIGHT
    return [report] if news else []
