"""Choosing a host for a sandbox: pure, capacity-aware."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec


class HostInfo(msgspec.Struct, frozen=True, kw_only=True):
    host: str
    capacity_sandboxes: int
    memory_bytes: int
    live: bool = True


def choose_host(
    hosts: Sequence[HostInfo],
    load: Mapping[str, int],
    *,
    memory_limit_bytes: int | None,
    prefer: str | None = None,
) -> str | None:
    """The live host with the most free sandbox slots that fits, or None.

    `prefer` (the host a stopped sandbox's workspace lives on) wins whenever it
    is live and has room, so a restart finds its files.
    """
    fitting = [
        h
        for h in hosts
        if h.live
        and load.get(h.host, 0) < h.capacity_sandboxes
        and (memory_limit_bytes is None or memory_limit_bytes <= h.memory_bytes)
    ]
    if not fitting:
        return None
    for h in fitting:
        if h.host == prefer:
            return h.host
    best = max(fitting, key=lambda h: (h.capacity_sandboxes - load.get(h.host, 0), h.host))
    return best.host
