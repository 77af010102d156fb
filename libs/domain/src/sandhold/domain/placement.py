"""Choosing a host for a sandbox: pure, capacity-aware."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec


class HostInfo(msgspec.Struct, frozen=True, kw_only=True):
    host: str
    capacity_sandboxes: int
    memory_bytes: int
    live: bool = True
    # The network modes its isolation enforces; None: an unisolated development
    # host (the process driver), which enforces none and is marked so everywhere.
    network_modes: frozenset[str] | None = None
    disk_quota: bool = False  # whether it can give a sandbox a file system of a set size


def network_modes(capabilities: Mapping[str, str]) -> frozenset[str] | None:
    """What a host's reported capabilities say it can enforce (None: nothing, unisolated)."""
    if capabilities.get("driver", "process") == "process":
        return None
    return frozenset(m for m in capabilities.get("network_modes", "").split(",") if m)


def choose_host(
    hosts: Sequence[HostInfo],
    load: Mapping[str, int],
    *,
    memory_limit_bytes: int | None,
    prefer: str | None = None,
    network: str = "none",
    disk_limit_bytes: int | None = None,
) -> str | None:
    """The live host with the most free sandbox slots that fits, or None.

    `prefer` (the host a stopped sandbox's workspace lives on) wins whenever it
    is live and has room, so a restart finds its files. A host whose isolation
    cannot enforce the sandbox's `network`, or the disk quota it asked for, is
    never chosen.
    """
    fitting = [
        h
        for h in hosts
        if h.live
        and load.get(h.host, 0) < h.capacity_sandboxes
        and (memory_limit_bytes is None or memory_limit_bytes <= h.memory_bytes)
        and (h.network_modes is None or network in h.network_modes)
        and (disk_limit_bytes is None or h.disk_quota)
    ]
    if not fitting:
        return None
    for h in fitting:
        if h.host == prefer:
            return h.host
    best = max(fitting, key=lambda h: (h.capacity_sandboxes - load.get(h.host, 0), h.host))
    return best.host


class Waiting(msgspec.Struct, frozen=True):
    """No host can take the sandbox now: why, as its status shows it."""

    reason: str


def why_waiting(
    hosts: Sequence[HostInfo],
    load: Mapping[str, int],
    *,
    memory_limit_bytes: int | None,
    network: str = "none",
    disk_limit_bytes: int | None = None,
) -> Waiting:
    """Why `choose_host` found no host: the first thing that rules them all out."""
    live = [h for h in hosts if h.live]
    if not hosts:
        return Waiting("no host is registered")
    if not live:
        return Waiting(f"no host is live ({len(hosts)} registered, none renewing its lease)")
    fits = [h for h in live if memory_limit_bytes is None or memory_limit_bytes <= h.memory_bytes]
    if not fits:
        return Waiting(f"no live host has {memory_limit_bytes} bytes of memory")
    fits = [h for h in fits if h.network_modes is None or network in h.network_modes]
    if not fits:
        return Waiting(f"no live host enforces network {network!r}")
    fits = [h for h in fits if disk_limit_bytes is None or h.disk_quota]
    if not fits:
        return Waiting("no live host gives a sandbox a disk quota")
    used = sum(min(load.get(h.host, 0), h.capacity_sandboxes) for h in fits)
    room = sum(h.capacity_sandboxes for h in fits)
    where = "" if len(fits) == 1 else f" on {len(fits)} hosts"
    return Waiting(f"no host has room: {used}/{room}{where}")
