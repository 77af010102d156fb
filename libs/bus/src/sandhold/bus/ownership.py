"""Whose an aggregate is: the tenant its first event names (one direct get).

A sandbox's `sandbox.created` and a task's `task.submitted` carry the tenant
that asked for it; nothing later changes that. The client, the gateway and
the audit tools ask here before they show anyone an aggregate's events or
output, so a tenant never learns more about another's than "not found".
"""

from __future__ import annotations

import msgspec
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from sandhold.bus.codec import decode_envelope, has_fence
from sandhold.bus.names import Names
from sandhold.domain import events as ev


async def first_event(
    js: JetStreamContext, names: Names, kind: str, aggregate_id: str
) -> ev.AnyEvent | None:
    """The aggregate's first event (its creation), or None. Messages stored without
    the fence are passed over, as every reader does (follow.py)."""
    seq = 1
    for _ in range(_LOOK_PAST):
        try:
            # (not a direct get: has_fence must see the headers as stored)
            msg = await js.get_msg(
                names.events_stream, seq=seq, subject=names.events(kind, aggregate_id), next=True
            )
        except NotFoundError:
            return None
        if has_fence(msg.headers):
            try:
                return decode_envelope(msg.data or b"").event
            except msgspec.DecodeError:
                return None
        seq = (msg.seq or seq) + 1
    return None


_LOOK_PAST = 16  # unfenced messages in front of a creation: more is not worth reading


async def tenant_of(js: JetStreamContext, names: Names, kind: str, aggregate_id: str) -> str | None:
    """The tenant of a sandbox or task, or None when there is no such aggregate."""
    created = await first_event(js, names, kind, aggregate_id)
    if isinstance(created, ev.SandboxCreated | ev.TaskSubmitted):
        return created.tenant
    return None
