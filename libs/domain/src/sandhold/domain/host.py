"""The host aggregate: what a host said about itself when it registered."""

from __future__ import annotations

from typing import Literal

import msgspec
from sandhold.domain import events as ev
from sandhold.domain.envelope import Envelope


class ChunkCacheStats(msgspec.Struct, frozen=True, kw_only=True):
    """A host's chunk cache as it publishes it with its lease (`host ls`)."""

    bytes: int  # held now
    limit_bytes: int
    chunks: int
    hits: int  # since its host-agent started
    misses: int
    evictions: int
    corrupt: int  # cached copies that no longer hashed to their name, dropped
    hit_ratio: float | None = None  # hits / (hits + misses); None: never asked


class Host(msgspec.Struct, frozen=True, kw_only=True):
    host: str
    epoch: int
    capacity_sandboxes: int
    memory_bytes: int
    registered_at: float
    capabilities: dict[str, str] = {}
    status: Literal["registered", "lost", "fenced"] = "registered"
    last_renewal_at: float | None = None  # as recovery saw it when it declared the loss
    fence_at: float | None = None


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
        case ev.HostLost() as e if state is not None and e.epoch == state.epoch:
            return msgspec.structs.replace(
                state, status="lost", last_renewal_at=e.last_renewal_at, fence_at=e.fence_at
            )
        case ev.HostFenced() as e if state is not None and e.epoch == state.epoch:
            return msgspec.structs.replace(state, status="fenced")
        case _:
            return state


def decide_register(state: Host | None, registration: ev.HostRegistered) -> list[ev.AnyEvent]:
    """A host registers with a new epoch on every start of its agent."""
    if state is not None and registration.epoch <= state.epoch:
        return []
    return [registration]


def decide_lost(
    state: Host | None, *, epoch: int, last_renewal_at: float, fence_at: float
) -> list[ev.AnyEvent]:
    """Recovery declares a host lost once per epoch; a newer epoch is a new life."""
    if state is None or state.epoch != epoch or state.status != "registered":
        return []
    return [
        ev.HostLost(
            host=state.host, epoch=epoch, last_renewal_at=last_renewal_at, fence_at=fence_at
        )
    ]


def decide_fenced(state: Host | None, *, epoch: int) -> list[ev.AnyEvent]:
    if state is None or state.epoch != epoch or state.status != "lost":
        return []
    return [ev.HostFenced(host=state.host, epoch=epoch)]


HostLiveness = Literal["live", "suspect", "down", "lost", "fenced"]


def liveness(
    host: Host, *, lease_age_s: float | None, ttl_s: float, interval_s: float
) -> HostLiveness:
    """How a host is doing, as `host ls` and `GET /api/v1/hosts` show it: what
    recovery declared (lost, fenced), else from its lease's age: renewed within
    two intervals (live), later but within the TTL (suspect), or not (down)."""
    if host.status != "registered":
        return host.status
    if lease_age_s is None or lease_age_s > ttl_s:
        return "down"
    if lease_age_s > 2 * interval_s:
        return "suspect"
    return "live"
