"""The orchestrator's side of the sandbox API: requests it sends, states it waits for.

Every request the orchestrator sends has a key derived from the task (and
step and attempt), and is published with a `Nats-Msg-Id` derived from that
key alone. Sending it again is therefore harmless twice over: JetStream drops
a repeat inside its duplicate window (and says so: `duplicate` on the ack,
which is how a restart learns that a request did leave), and the sandbox
aggregate answers a key it has seen with the original result.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import TypeVar

import msgspec
from nats.aio.client import Client as NATS
from sandhold.bus import secret_store
from sandhold.bus.cancelling import cancel_and_wait
from sandhold.bus.names import Names
from sandhold.bus.requesting import publish_request
from sandhold.bus.store import AggregateStore
from sandhold.domain import requests as rq
from sandhold.domain import sandbox as sb
from sandhold.domain.errors import Rejected
from sandhold.domain.views import Reply

T = TypeVar("T")
_reply_decoder = msgspec.json.Decoder(Reply)


class Sent(msgspec.Struct, frozen=True):
    """A request stored by JetStream. `duplicate`: it had been stored before."""

    duplicate: bool
    reply: asyncio.Future[Reply] | None


class Sandboxes:
    def __init__(self, nc: NATS, names: Names, store: AggregateStore[sb.Sandbox]) -> None:
        self._nc = nc
        self._js = nc.jetstream()
        self._names = names
        self._store = store
        # sandbox id -> (set on each change, how many wait): held only while waited on
        self._changed: dict[str, tuple[asyncio.Event, int]] = {}
        store.listen(self._on_change)

    def _on_change(self, sandbox_id: str) -> None:
        waited = self._changed.get(sandbox_id)
        if waited is not None:
            waited[0].set()

    def state(self, sandbox_id: str) -> sb.Sandbox | None:
        return self._store.get(sandbox_id)[0]

    async def whole(self, sandbox_id: str) -> sb.Sandbox | None:
        """The sandbox with every command it ran, read back from the log: the
        store keeps no ended command (decision 057)."""
        state, _ = await self._store.read_whole(sandbox_id)
        return state

    async def task_secrets(self, task_id: str) -> dict[str, str] | None:
        """The values of a task's secrets, kept since its submit; None once gone."""
        return await secret_store.fetch(self._js, self._names, self._names.task_secret(task_id))

    # --- sending ----------------------------------------------------------------

    async def send(self, request: rq.AnyRequest) -> Sent:
        """Store the request in the REQUESTS stream; the reply comes later."""
        inbox = self._nc.new_inbox()
        sub = await self._nc.subscribe(inbox, max_msgs=1)
        # The id is the key's alone (not the inbox's, as a client's is): a resend
        # after a restart is then shown to be one (`duplicate`).
        msg_id = f"{request.tenant}:{request.key}:{rq.request_digest(request)}"
        try:
            ack = await publish_request(
                self._js,
                self._names,
                self._names.request(rq.request_tag(request), request.tenant),
                rq.encode_request(request),
                msg_id=msg_id,
                reply_to=inbox,
            )
        except BaseException:
            await sub.unsubscribe()
            raise
        if ack.duplicate:
            # The first copy was stored earlier: its reply went to that sender.
            await sub.unsubscribe()
            return Sent(True, None)

        async def reply() -> Reply:
            try:
                msg = await sub.next_msg(timeout=None)
            finally:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
            return _reply_decoder.decode(msg.data)

        return Sent(False, asyncio.ensure_future(reply()))

    async def request(
        self, request: rq.AnyRequest, accepted: Callable[[sb.Sandbox], bool], *, sandbox_id: str
    ) -> None:
        """Send and wait until the scheduler accepted it: its reply, or (when the
        reply went elsewhere) the state showing it. Raises `Rejected`."""
        sent = await self.send(request)
        await self.settle(sent, accepted, sandbox_id=sandbox_id)

    async def settle(
        self,
        sent: Sent,
        accepted: Callable[[sb.Sandbox], bool],
        *,
        sandbox_id: str,
        timeout: float | None = None,
    ) -> None:
        waiting = asyncio.ensure_future(
            self.wait(sandbox_id, lambda s: True if accepted(s) else None, timeout=timeout)
        )
        pending = {waiting} | ({sent.reply} if sent.reply is not None else set())
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if waiting in done:
                    waiting.result()
                    return
                reply = sent.reply.result() if sent.reply is not None else None
                if reply is not None and not reply.ok:
                    assert reply.error is not None
                    raise Rejected(reply.error.code, reply.error.message)
                if reply is not None and reply.ok:
                    return
        finally:  # ended, not only cancelled: a wait left polling for ever (decision 080)
            await cancel_and_wait([f for f in (waiting, sent.reply) if f is not None])

    # --- waiting ----------------------------------------------------------------

    async def wait(
        self,
        sandbox_id: str,
        check: Callable[[sb.Sandbox], T | None],
        *,
        timeout: float | None = None,
        poll_s: float = 5.0,
    ) -> T:
        """Until `check(state)` gives something. The live projection wakes us; every
        few seconds the log is read directly in case a live event was missed. A
        sandbox the store does not hold is judged as the log has it (not folded
        yet, or forgotten: deleted with nothing left, decision 061)."""
        changed, waiting = self._changed.get(sandbox_id, (asyncio.Event(), 0))
        self._changed[sandbox_id] = (changed, waiting + 1)
        try:
            return await self._wait(sandbox_id, changed, check, timeout, poll_s)
        finally:
            changed, waiting = self._changed[sandbox_id]
            if waiting == 1:
                del self._changed[sandbox_id]
            else:
                self._changed[sandbox_id] = (changed, waiting - 1)

    async def _wait(
        self,
        sandbox_id: str,
        changed: asyncio.Event,
        check: Callable[[sb.Sandbox], T | None],
        timeout: float | None,
        poll_s: float,
    ) -> T:
        deadline = None if timeout is None else time.monotonic() + timeout
        last_sync = time.monotonic()
        while True:
            changed.clear()
            state = self.state(sandbox_id)
            if state is None:
                state = await self.whole(sandbox_id)
            if state is not None:
                found = check(state)
                if found is not None:
                    return found
            left = poll_s if deadline is None else min(poll_s, deadline - time.monotonic())
            if left <= 0:
                raise TimeoutError(f"{sandbox_id}: not there after {timeout}s")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):  # unlike wait_for, never eats a cancel
                    await changed.wait()
            if time.monotonic() - last_sync >= poll_s:
                await self._store.sync(sandbox_id)
                last_sync = time.monotonic()
