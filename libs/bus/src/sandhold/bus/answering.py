"""Requests on the REQUESTS work queue: publishing one, and answering it — the
one way, for every kind.

decode strictly → check it came on its own subject, the tenant's the body names → decide (behind the
fence) → reply → ack. A malformed request is answered `malformed_request`
and dead-lettered (never redelivered, counted); a refusal is answered with
its code and acked; an infrastructure error leaves the request for a
redelivery, so a client waiting on its reply gets one once the cause passed.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from sandhold.bus.codec import reflected, reply_inbox
from sandhold.bus.names import Names
from sandhold.bus.reconciler import dead_letter
from sandhold.domain.errors import InfraError, Rejected
from sandhold.telemetry import metrics

log = logging.getLogger(__name__)

R = TypeVar("R")


class RequestKinds(Generic[R]):
    """How one family of requests is read and refused (sandbox and command
    requests for the scheduler, task requests for the orchestrator)."""

    def __init__(
        self,
        *,
        decode: Callable[[bytes], R],
        tag_of: Callable[[R], str],
        tenant_of: Callable[[R], str],
        error: Callable[[str, str], bytes],
        what: str,
    ) -> None:
        self.decode = decode
        self.tag_of = tag_of
        self.tenant_of = tenant_of
        self.error = error
        self.what = what


async def answer(
    nc: NATS,
    names: Names,
    msg: Msg,
    kinds: RequestKinds[R],
    decide: Callable[[R], Awaitable[bytes]],
) -> R | None:
    """Answer one request; `decide` returns the encoded reply (or raises
    `Rejected` / `InfraError`). Returns the request when it was decided."""
    if reflected(msg.headers):
        # A stored message someone had the server bounce onto a request subject
        # (decision 034): never anyone's request. Not answered (its reply header
        # is whatever the bounced message carried), only dropped.
        log.error("a bounced stored message on %s: dropped, not a request", msg.subject)
        metrics.replied("reflected")
        await msg.term()
        return None
    reply_to = reply_inbox(msg.headers)
    try:
        request = kinds.decode(msg.data)
    except (msgspec.DecodeError, msgspec.ValidationError) as err:
        log.warning("malformed %s on %s: %s", kinds.what, msg.subject, err)
        await _reply(nc, reply_to, "malformed_request", kinds.error(
            "malformed_request", f"malformed request: {err}"
        ))  # fmt: skip
        await dead_letter(msg, kinds.what)
        return None
    tag = kinds.tag_of(request)
    tenant = kinds.tenant_of(request)
    sent_as = names.tenant_of_request(msg.subject, tag)
    if sent_as is None:
        expected = names.request(tag, tenant)
        message = (
            f"malformed request: a {tag!r} request was sent to {msg.subject}; send it to {expected}"
        )
        await _reply(nc, reply_to, "malformed_request", kinds.error("malformed_request", message))
        await dead_letter(msg, kinds.what)
        return None
    if sent_as != tenant:
        # The subject says whose request it is (permissions hold a publisher to
        # its own subjects); a body that names another tenant is refused.
        message = f"a request sent as tenant {sent_as!r} names tenant {tenant!r} in its body"
        await _reply(nc, reply_to, "wrong_tenant", kinds.error("wrong_tenant", message))
        await dead_letter(msg, kinds.what)
        return None
    try:
        reply = await decide(request)
    except Rejected as err:
        # Answered: the work queue's loop acknowledges it (`consume`).
        await _reply(nc, reply_to, err.code, kinds.error(err.code, err.message))
        return None
    except InfraError as err:
        log.warning("%s on %s not decided yet: %s", kinds.what, msg.subject, err)
        await msg.nak(delay=1)
        return None
    await _reply(nc, reply_to, "ok", reply)
    return request


async def _reply(nc: NATS, reply_to: str | None, outcome: str, body: bytes) -> None:
    metrics.replied(outcome)
    if reply_to:
        await nc.publish(reply_to, body)
