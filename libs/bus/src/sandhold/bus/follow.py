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

* Fenced: on the event log (`fence_required`) a message stored without the
  fence header (`Nats-Expected-Last-Subject-Sequence`, which every append
  carries) was not appended the one way, behind the single-writer fence: it is
  skipped, logged and counted (`unfenced`), never read as an event. The stream
  keeps whatever a publisher sent; what the readers take for history does not.

* Paced (`pace_s`, decision 087): once caught up, what came at most that often,
  in one pull batch (`pull_batches`), for a reader no one waits on event by
  event; `reach` fetches at once.

`pull_batches` is the same log read for a reader that sets the pace (an SSE
client behind a slow socket, a read model committing to SQLite): the next
batch is fetched only when the reader asks for it, so a reader that falls
behind costs one batch of memory, not a queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncGenerator, Callable
from typing import Generic, TypeVar

import msgspec
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy
from sandhold.bus.append import last_sequence
from sandhold.bus.bulk import bulk_read, first_of, reader_config
from sandhold.bus.codec import has_fence
from sandhold.bus.electing import patiently

log = logging.getLogger(__name__)

# How long a follower's start waits quietly for the messages it must catch up
# on before it says how far it got (nothing at all: the server not answering).
SAY_AFTER_S = 5.0


def fence_required(stream: str) -> bool:
    """Whether every message of `stream` must carry the fence header: the event
    log's (`<PREFIX>_EVENTS`, `Names.events_stream`), whoever reads it."""
    return stream.endswith("_EVENTS")


def fenced(msg: Msg) -> bool:
    """Whether the message was appended with an expected last subject sequence
    (JetStream stored it only because that sequence was right at the time)."""
    return has_fence(msg.headers)


def _skip_unfenced(msg: Msg, seq: int, what: str) -> None:
    log.error(
        "%s at %s seq %d was stored without the fence header: not an event, skipped",
        what,
        msg.subject,
        seq,
    )


T = TypeVar("T")
# (stream sequence, the message, its decoded value)
Handler = Callable[[int, Msg, T], None]

# The catch-up a `bulk` follower leaves to `bulk_read`: from this many sequences
# on. Its own connection and consumer cost a few milliseconds, less than
# nats-py's delivery of a thousand messages; a sparse filter (a kind with few
# events in a long log) may pay them for fewer, once per start.
BULK_SPAN = 1000

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
        pace_s: float | None = None,
        bulk: bool = False,
    ) -> None:
        """`bulk`: catch up on a long stretch (`BULK_SPAN` sequences or more)
        with `bulk_read` (decision 100), for a reader that starts by folding
        much of the log and waits for it (a start with no timeout, which waits
        for nothing, reads as usual).

        `pace_s`: live, take what came at most this often, in one batch (a
        pull consumer), instead of each message as it is stored (decision 087).
        For a reader nobody waits on message by message: one wakeup per pace,
        not one per event, in a process that shares two cores with the exec
        path. `reach` does not wait for the pace."""
        self._js = js
        self.stream = stream
        self.subject_filter = subject_filter
        self._decode = decode
        self._handle = handle
        self.what = what
        self.position = start_seq - 1  # the last sequence handled (or skipped)
        self.undecodable = 0
        self.unfenced = 0
        self.failed = 0
        self._require_fence = fence_required(stream)
        self.caught_up = asyncio.Event()
        self._target = 0
        self._moved = asyncio.Event()  # set whenever the position moves on
        self._sub: JetStreamContext.PushSubscription | None = None
        self._pace_s = pace_s
        self._paced: asyncio.Task[None] | None = None
        self._hurry = asyncio.Event()  # someone waits in `reach`: fetch now
        self._bulk = bulk
        self.bulk_taken = 0  # messages handed over by `bulk_read`

    async def start(self, *, timeout: float | None = 60.0, target: int | None = None) -> None:
        """Subscribe, then wait (up to `timeout`; None: not at all) until every
        message the stream held at this moment (or up to `target`) is handled."""
        if target is None:
            target = await last_sequence(
                self._js, self.stream, self.subject_filter, on_first_wait=self._no_answer
            )
        self._target = target
        if self._target <= self.position:
            self.caught_up.set()
        # (Not for a start that waits for nothing: the bulk read is waited for.)
        if self._bulk and timeout is not None and target - self.position >= BULK_SPAN:
            deadline = asyncio.get_running_loop().time() + timeout
            await self._bulk_catch_up(deadline)
            timeout = max(0.0, deadline - asyncio.get_running_loop().time())
        if self._pace_s is not None:
            self._paced = asyncio.create_task(self._follow_paced(self._pace_s))
            if timeout is not None and not self.caught_up.is_set():
                async with asyncio.timeout(timeout):
                    await first_of(self.caught_up.wait(), self._paced)
            return
        # The consumer is made by the stream's leader: through an election it is
        # asked for again, each time with a config of its own (nats-py writes
        # the delivery inbox into it): one made by an attempt cut short delivers
        # to an inbox nothing listens to, and the server removes it (ephemeral).
        self._sub = await patiently(
            lambda: self._js.subscribe(
                self.subject_filter,
                stream=self.stream,
                ordered_consumer=True,
                idle_heartbeat=HEARTBEAT_S,
                deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
                # From where a bulk read left off (else where it was asked to).
                config=ConsumerConfig(opt_start_seq=self.position + 1),
                cb=self._on_msg,
                pending_msgs_limit=-1,
                pending_bytes_limit=-1,
            ),
            attempt_s=1.0,
            on_first_wait=self._no_answer,
        )
        if timeout is not None:
            await self._catch_up(timeout)

    async def _bulk_catch_up(self, deadline: float) -> None:
        """As much of the catch-up as `bulk_read` does (all of it, unless it
        stops early); the usual consumer reads on from wherever it stopped."""
        nc = getattr(self._js, "_nc", None)  # (nats-py keeps the client there)
        if nc is None:
            return

        def take(seq: int, msg: Msg) -> None:
            self.bulk_taken += 1
            self._take(seq, msg)

        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout_at(deadline):
                await bulk_read(
                    nc, self._js, self.stream, self.subject_filter,
                    after=self.position, until=self._target, take=take,
                )  # fmt: skip

    def _no_answer(self, err: Exception) -> None:
        log.warning("following %s on %s: no answer (%r); asking again", self.what, self.stream, err)

    async def _catch_up(self, timeout: float) -> None:
        """Wait until caught up, saying how far it got after `SAY_AFTER_S`: a
        start that waits on a server that does not answer does not wait unheard."""
        began = self.position
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(min(timeout, SAY_AFTER_S)):
                await self.caught_up.wait()
        if self.caught_up.is_set():
            return
        if timeout > SAY_AFTER_S:
            (log.info if self.position > began else log.warning)(
                "following %s on %s: at %d of %d after %.0f s%s; waiting up to %.0f s more",
                self.what, self.stream, self.position, self._target, SAY_AFTER_S,
                "" if self.position > began else ", nothing received",
                timeout - SAY_AFTER_S,
            )  # fmt: skip
        async with asyncio.timeout(max(0.0, timeout - SAY_AFTER_S)):
            await self.caught_up.wait()

    @property
    def target(self) -> int:
        """The stream's last matching sequence when the follower started."""
        return self._target

    async def stop(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:
            await sub.unsubscribe()
        paced, self._paced = self._paced, None
        if paced is not None:
            paced.cancel()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await paced

    async def _follow_paced(self, pace_s: float) -> None:
        batch = 512
        batches = pull_batches(
            self._js, self.stream, self.subject_filter, after=self.position, batch=batch,
            what=self.what, skip_unfenced=False,
        )  # fmt: skip
        try:
            async for msgs in batches:
                for seq, msg in msgs:
                    try:
                        await self._on_msg(msg)
                    except Exception:  # as nats-py does for a push callback: on to the next
                        self.failed += 1
                        log.exception(
                            "%s at %s seq %d could not be read", self.what, msg.subject, seq
                        )
                        self._passed(seq)
                if len(msgs) < batch:  # all there was: let the next ones gather
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(pace_s):
                            await self._hurry.wait()
                    self._hurry.clear()
        finally:
            await batches.aclose()

    async def _on_msg(self, msg: Msg) -> None:
        self._take(stream_sequence(msg), msg)

    def _take(self, seq: int, msg: Msg) -> None:
        if seq <= self.position:
            return  # a consumer recreated a step behind: already handled
        if self._require_fence and not fenced(msg):
            self.unfenced += 1
            _skip_unfenced(msg, seq, self.what)
            self._passed(seq)
            return
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
        self._passed(seq)

    def _passed(self, seq: int) -> None:
        self.position = seq
        if seq >= self._target:
            self.caught_up.set()
        self._moved.set()

    async def reach(self, seq: int, *, timeout: float) -> None:
        """Wait until every message up to sequence `seq` is handled (or passed
        over); `TimeoutError` after `timeout` seconds."""
        async with asyncio.timeout(timeout):
            while self.position < seq:
                self._moved.clear()
                self._hurry.set()
                await self._moved.wait()


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
    bulk: bool = False,
) -> list[tuple[int, Msg, T]]:
    """Every message matching `subject_filter` from `start_seq` up to the last one
    present when the read began (or `until_seq`), with its value: a follower
    that stops once caught up (`bulk`: for a read of much of the log)."""
    out: list[tuple[int, Msg, T]] = []
    # From the leader: a replica a moment behind would hide what the caller has
    # just been told was stored (a `create` answered, then "no sandbox").
    last = await last_sequence(js, stream, subject_filter, from_leader=True)
    if until_seq is not None:
        last = min(last, until_seq)
    if last < start_seq:
        return out

    def keep(seq: int, msg: Msg, value: T) -> None:
        if seq <= last:
            out.append((seq, msg, value))

    follower = Follower(
        js, stream, subject_filter, decode, keep, start_seq=start_seq, what=what, bulk=bulk
    )
    try:
        await follower.start(timeout=timeout, target=last)
    finally:
        await follower.stop()
    return out


async def pull_batches(
    js: JetStreamContext,
    stream: str,
    subject_filter: str,
    *,
    after: int,
    batch: int = 256,
    batch_bytes: int | None = None,
    idle_s: float = 5.0,
    what: str = "events",
    skip_unfenced: bool = True,
) -> AsyncGenerator[list[tuple[int, Msg]]]:
    """Every message matching `subject_filter` after sequence `after`, in stream
    order and in batches of at most `batch` (and, given `batch_bytes`, about that
    many bytes: big messages come fewer at a time), then new ones as they come.

    A batch is fetched only when the caller asks for the next one. An empty
    batch means `idle_s` passed with nothing new (a quiet log, or a bus that is
    away): a caller can send a keep-alive or give up. A consumer that fails or
    goes away (a restart, a reconnect, the server's idle clean-up) is made again
    after the last sequence handed out, so nothing is skipped or repeated.
    """
    position = after
    size = batch
    delay = 0.5
    # (`skip_unfenced` False: the caller skips them itself, `Follower` counting them.)
    require_fence = skip_unfenced and fence_required(stream)
    while True:
        consumer = f"pull-{uuid.uuid4().hex}"
        sub = None
        try:
            # Inside the try: while NATS is away, making the consumer fails too.
            await js.add_consumer(
                stream,
                reader_config(
                    consumer, subject_filter, after=position, inactive_s=max(30.0, 4 * idle_s)
                ),
            )
            sub = await js.pull_subscribe_bind(consumer=consumer, stream=stream)
            delay = 0.5
            while True:
                try:
                    msgs = await sub.fetch(size, timeout=idle_s)
                except TimeoutError:
                    yield []
                    await sub.consumer_info()  # raises if the consumer went away
                    continue
                if batch_bytes is not None:
                    got = sum(len(m.data) for m in msgs)
                    size = max(1, min(batch, batch_bytes * len(msgs) // max(1, got)))
                fresh = [(seq, m) for m in msgs if (seq := stream_sequence(m)) > position]
                if not fresh:
                    continue
                last = fresh[-1][0]
                if require_fence:
                    for seq, m in fresh:
                        if not fenced(m):
                            _skip_unfenced(m, seq, what)
                    fresh = [(seq, m) for seq, m in fresh if fenced(m)]
                if fresh:
                    yield fresh
                position = last
        except asyncio.CancelledError:
            raise
        except Exception as err:  # noqa: BLE001 - a lost consumer is made again
            log.info("reading %s on %s: %s; resuming after %d", what, subject_filter, err, position)
        finally:
            if sub is not None:
                # A reader that is cancelled (a client gone: its whole scope is
                # cancelled) must not leave the consumer behind: shield the clean-up.
                cleanup = asyncio.ensure_future(_remove(js, stream, consumer, sub))
                _removing.add(cleanup)
                cleanup.add_done_callback(_removing.discard)
                await asyncio.shield(cleanup)
        yield []  # the caller hears of the wait as of a quiet log
        await asyncio.sleep(delay)
        delay = min(delay * 2, 5.0)


_removing: set[asyncio.Future[None]] = set()  # clean-ups running on after a cancellation


async def _remove(
    js: JetStreamContext, stream: str, consumer: str, sub: JetStreamContext.PullSubscription
) -> None:
    with contextlib.suppress(Exception):
        await asyncio.wait_for(sub.unsubscribe(), 5)
    with contextlib.suppress(Exception):
        await asyncio.wait_for(js.delete_consumer(stream, consumer), 5)


def stream_sequence(msg: Msg) -> int:
    """The stream sequence from a JetStream message's reply subject.

    `msg.metadata` parses the whole subject into dataclasses and a datetime:
    about ten times the cost, on the hot path of every replay. The subject is
    `$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>...` (9 tokens), or with a
    domain and account hash in front (12 or more).
    """
    tokens = msg.reply.split(".")
    return int(tokens[5] if len(tokens) == 9 else tokens[7])
