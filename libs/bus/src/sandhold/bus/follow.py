"""Following the log: the one way anything here reads a stream in order.

`Follower` replays a subject filter of a stream from a sequence, says when it
has caught up with what the stream held when it started, and then keeps
delivering new messages live: an aggregate store's fold, the metrics fold, a
one-off read (`read_subjects`), a CLI watching a task. Each message reaches
the handler once, in stream order, with its sequence and its decoded value.

* Ordered: one JetStream ordered consumer (flow-controlled, no acks), which
  nats-py recreates from the last sequence it delivered whenever it sees a
  gap or its heartbeats stop (a reconnect, a server restart): the follower
  resumes where it was, with nothing delivered twice or skipped.
* Lenient: a message that does not decode is skipped, logged and counted
  (`undecodable`), never fatal; a handler that raises is logged and counted
  the same way. The position moves on either way, so catching up always ends.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Generic, TypeVar

import msgspec
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy
from sandhold.bus.append import last_sequence

log = logging.getLogger(__name__)

T = TypeVar("T")
# (stream sequence, the message, its decoded value)
Handler = Callable[[int, Msg, T], None]

# Heartbeats from the server while the log is quiet; two missed ones (a lost
# connection) make nats-py recreate the consumer from the last sequence seen.
HEARTBEAT_S = 2.0


class Follower(Generic[T]):
    def __init__(
        self,
        js: JetStreamContext,
        stream: str,
        subject_filter: str,
        decode: Callable[[bytes], T],
        handle: Handler[T],
        *,
        start_seq: int = 1,
        what: str = "events",
    ) -> None:
        self._js = js
        self.stream = stream
        self.subject_filter = subject_filter
        self._decode = decode
        self._handle = handle
        self._start_seq = start_seq
        self.what = what
        self.position = start_seq - 1  # the last sequence handled (or skipped)
        self.undecodable = 0
        self.failed = 0
        self.caught_up = asyncio.Event()
        self._target = 0
        self._sub: JetStreamContext.PushSubscription | None = None

    async def start(self, *, timeout: float | None = 60.0, target: int | None = None) -> None:
        """Subscribe, then wait (up to `timeout`; None: not at all) until every
        message the stream held at this moment (or up to `target`) is handled."""
        if target is None:
            target = await last_sequence(self._js, self.stream, self.subject_filter)
        self._target = target
        if self._target <= self.position:
            self.caught_up.set()
        self._sub = await self._js.subscribe(
            self.subject_filter,
            stream=self.stream,
            ordered_consumer=True,
            idle_heartbeat=HEARTBEAT_S,
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
            config=ConsumerConfig(opt_start_seq=self._start_seq),
            cb=self._on_msg,
            pending_msgs_limit=-1,
            pending_bytes_limit=-1,
        )
        if timeout is not None:
            await asyncio.wait_for(self.caught_up.wait(), timeout)

    @property
    def target(self) -> int:
        """The stream's last matching sequence when the follower started."""
        return self._target

    async def stop(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:
            await sub.unsubscribe()

    async def _on_msg(self, msg: Msg) -> None:
        seq = stream_sequence(msg)
        if seq <= self.position:
            return  # a consumer recreated a step behind: already handled
        try:
            value = self._decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as err:
            self.undecodable += 1
            log.error("undecodable %s at %s seq %d: skipped (%s)", self.what, msg.subject, seq, err)
        else:
            try:
                self._handle(seq, msg, value)
            except Exception:
                self.failed += 1
                log.exception("%s at %s seq %d could not be handled", self.what, msg.subject, seq)
        self.position = seq
        if seq >= self._target:
            self.caught_up.set()


async def read_range(
    js: JetStreamContext,
    stream: str,
    subject_filter: str,
    decode: Callable[[bytes], T],
    *,
    start_seq: int = 1,
    until_seq: int | None = None,
    timeout: float = 60.0,
    what: str = "events",
) -> list[tuple[int, Msg, T]]:
    """Every message matching `subject_filter` from `start_seq` up to the last one
    present when the read began (or `until_seq`), with its value: a follower
    that stops once caught up."""
    out: list[tuple[int, Msg, T]] = []
    last = await last_sequence(js, stream, subject_filter)
    if until_seq is not None:
        last = min(last, until_seq)
    if last < start_seq:
        return out

    def keep(seq: int, msg: Msg, value: T) -> None:
        if seq <= last:
            out.append((seq, msg, value))

    follower = Follower(js, stream, subject_filter, decode, keep, start_seq=start_seq, what=what)
    try:
        await follower.start(timeout=timeout, target=last)
    finally:
        await follower.stop()
    return out


def stream_sequence(msg: Msg) -> int:
    """The stream sequence from a JetStream message's reply subject.

    `msg.metadata` parses the whole subject into dataclasses and a datetime:
    about ten times the cost, on the hot path of every replay. The subject is
    `$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>...` (9 tokens), or with a
    domain and account hash in front (12 or more).
    """
    tokens = msg.reply.split(".")
    return int(tokens[5] if len(tokens) == 9 else tokens[7])
