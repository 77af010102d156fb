"""The host aggregate: what a host said about itself when it registered."""

from __future__ import annotations

import msgspec
from sandhold.domain import events as ev
from sandhold.domain.envelope import Envelope


class Host(msgspec.Struct, frozen=True, kw_only=True):
    host: str
    epoch: int
    capacity_sandboxes: int
    memory_bytes: int
    registered_at: float
    capabilities: dict[str, str] = {}


def evolve(state: Host | None, envelope: Envelope) -> Host | None:
    match envelope.event:
        case ev.HostRegistered() as e:
            return Host(
                host=e.host,
                epoch=e.epoch,
                capacity_sandboxes=e.capacity_sandboxes,
                memory_bytes=e.memory_bytes,
                registered_at=envelope.time,
                capabilities=e.capabilities,
            )
        case _:
            return state


def decide_register(state: Host | None, registration: ev.HostRegistered) -> list[ev.AnyEvent]:
    """A host registers with a new epoch on every start of its agent."""
    if state is not None and registration.epoch <= state.epoch:
        return []
    return [registration]
