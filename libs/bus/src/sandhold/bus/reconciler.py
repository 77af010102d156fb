"""Loops every service shares: reconciling aggregates marked dirty, consuming a
work queue, and sending an instruction to a host's work queue."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

import msgspec
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.api import Header
from sandhold.bus.cancelling import cancel_and_wait
from sandhold.bus.names import Names
from sandhold.domain.work import AnyWork, SaveSandboxWork
from sandhold.telemetry import context, metrics

log = logging.getLogger(__name__)

_work_encoder = msgspec.json.Encoder()


class DirtyLoop:
    """Calls `handle(aggregate_id)` for every id marked since the last pass.

    Marking twice before a pass handles it once; a handler that raises is
    logged and the id is tried again half a second later. An id marked `later`
    (a periodic look at what waits on something outside its log) is handled
    only when nothing else is marked: a command's dispatch never waits behind
    a sweep of two hundred sandboxes waiting for room.
    """

    def __init__(
        self,
        handle: Callable[[str], Awaitable[None]],
        *,
        what: str,
        trace_of: Callable[[str], str | None] | None = None,
        kind: str = "sandbox",
    ) -> None:
        self._handle = handle
        self._what = what
        self._id_field = f"{kind}_id"  # how log lines of a pass name the aggregate
        # A pass continues the trace of the aggregate's latest event (`AggregateStore.trace_of`).
        self._trace_of = trace_of or (lambda _: None)
        self._dirty: set[str] = set()
        self._later: set[str] = set()
        self._wake = asyncio.Event()

    def mark(self, aggregate_id: str, *, later: bool = False) -> None:
        (self._later if later else self._dirty).add(aggregate_id)
        self._wake.set()

    def _next(self) -> str | None:
        if self._dirty:
            aggregate_id = self._dirty.pop()
            self._later.discard(aggregate_id)
            return aggregate_id
        return self._later.pop() if self._later else None

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while (aggregate_id := self._next()) is not None:
                try:
                    with (
                        context.carry(self._trace_of(aggregate_id)),
                        context.working_on(**{self._id_field: aggregate_id}),
                    ):
                        await self._handle(aggregate_id)
                except Exception:
                    log.exception("%s of %s failed; will retry", self._what, aggregate_id)
                    await asyncio.sleep(0.5)
                    self.mark(aggregate_id)
                # A pass that decides nothing never waits for anything: let what
                # arrived meanwhile (a request, its events) be marked first.
                await asyncio.sleep(0)


async def send_work(js: JetStreamContext, names: Names, host: str, work: AnyWork) -> bool:
    """Publish to `<prefix>.work.<host>` (a save to the host's queue of saves);
    the deterministic id makes a resend harmless. True if the stream stored it,
    False if it dropped it as a copy of one it had (`SentWork`)."""
    headers: dict[str, str] = {Header.MSG_ID: work.msg_id}
    traceparent = context.traceparent()
    if traceparent:
        headers[context.TRACEPARENT] = traceparent
    ack = await js.publish(
        names.work(host, saves=isinstance(work, SaveSandboxWork)),
        _work_encoder.encode(work),
        stream=names.hostwork_stream,
        headers=headers,
    )
    return not ack.duplicate


class SentWork:
    """The host work this process had stored, and when (decision 097).

    A pass sends every instruction its sandbox's state calls for, and a
    sandbox's every event brings a pass: a command `dispatched` while others
    run beside it had its instruction sent again on each. Within the stream's
    duplicate window (`streams.py`, 120 s) JetStream drops such a copy, so
    one not sent for `quiet_s` after the first was stored changes nothing
    but a round trip (and a secrets read) on the way of the pass's new work.
    Only a store this process saw counts: a copy another scheduler stored
    first leaves its window's start unknown here. And only on the connection
    it was seen on (`connection`, e.g. its count of reconnects): a server that
    restarted remembers the ids of the messages it still holds only."""

    def __init__(
        self,
        quiet_s: float,
        *,
        connection: Callable[[], object] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._quiet_s = quiet_s
        self._connection = connection
        self._clock = clock
        self._stored_at: dict[str, float] = {}  # msg id -> when; oldest first
        self._on = connection()

    def recent(self, msg_id: str) -> bool:
        if (on := self._connection()) != self._on:
            self._on = on
            self._stored_at.clear()
        stored_at = self._stored_at.get(msg_id)
        return stored_at is not None and self._clock() - stored_at < self._quiet_s

    def stored(self, msg_id: str) -> None:
        now = self._clock()
        self._stored_at.pop(msg_id, None)
        self._stored_at[msg_id] = now
        while (oldest := next(iter(self._stored_at))) != msg_id:
            if now - self._stored_at[oldest] < self._quiet_s:
                break
            del self._stored_at[oldest]


# How long a pull waits for messages at the server.
FETCH_S = 2.0


async def consume(
    sub: JetStreamContext.PullSubscription,
    handle: Callable[[Msg], Awaitable[None]],
    *,
    what: str,
    lane: Callable[[Msg], str] | None = None,
    concurrency: int = 1,
    keep_alive_s: float | None = None,
    fetch_s: float = FETCH_S,
) -> None:
    """Take messages off a durable pull consumer forever: one at a time, or
    with `lane`, in lanes: messages of one lane (one sandbox) one after another
    in the order they came, up to `concurrency` messages of all lanes at once,
    so one sandbox's long restore or final save holds up no other's command.

    Nothing stops the loop: a fetch that fails (a reconnect, a server busy
    electing a leader) is retried, and a handler that raises unexpectedly has
    its message redelivered later instead of taking the consumer down with it.

    With `keep_alive_s`, every message in hand (handled, or waiting for its
    lane) is told to the server as still in progress that often, so the
    consumer's `ack_wait` can be short: it then bounds only how long a message
    lost on its way here (its connection's node killed as it delivered) waits
    to be delivered again, not how long a handler may take.

    A handler that returns has handled its message: it is acknowledged here,
    unless the handler answered it otherwise (a nak, a term). The ack waits
    for the next fetch to return, with the next message or empty after
    `fetch_s` (decision 092): acked while a later message is in the queue, a
    message never empties a work-queue stream, which costs nats-server a new
    block file and a tombstone, two more fsyncs, every time it happens.
    """
    in_hand = _InHand(keep_alive_s)
    handled = _Handled(in_hand, what)
    lanes = _Lanes(handle, what, lane, concurrency, in_hand, handled) if lane is not None else None
    keeping_alive = asyncio.create_task(in_hand.keep_alive(what)) if keep_alive_s else None
    try:
        while True:
            try:
                # A pull waits at the server until it expires: one left by an instance
                # that died still takes a message (redelivered only after ack_wait),
                # so it expires soon; an idle consumer costs a request each time.
                # One message per pull, never a batch: nats-py's fetch of a batch
                # leaves the server a pull with room for more once it has one
                # message, and the status that ends a pull nobody waits for any
                # more (sent at its expiry) can end the next fetch's first
                # request; a message then delivered to that leftover pull is held
                # by the next fetch until the leftover expires, up to FETCH_S
                # (measured: a command's run instruction held 0.6-0.9 s after a
                # restore). `fetch(1)` returns with its first message, and takes
                # what a leftover pull delivered from the queue at once.
                msgs = await sub.fetch(batch=1, timeout=fetch_s)
            except NatsTimeoutError:
                await handled.ack()  # nothing came: the queue may empty now
                continue
            except Exception as err:
                log.warning("fetching %s failed, retrying: %r", what, err)
                await handled.ack()  # not held for as long as fetching fails
                await asyncio.sleep(0.5)
                continue
            await handled.ack()  # (the one fetched keeps the queue from emptying)
            for msg in msgs:
                if lanes is None:
                    in_hand.add(msg)
                    handled.add(msg, await _handle_one(msg, handle, what))
                else:
                    await lanes.add(msg)
    finally:
        if keeping_alive is not None:
            keeping_alive.cancel()
        # Stopping: what was handled is said so now, not delivered again to the
        # next instance (nats-py sends it with the rest before the connection
        # closes): before the lanes' cancellation, which can be cut short by the
        # next cancel of a stop that keeps cancelling, and after it.
        await handled.ack()
        try:
            if lanes is not None:
                await lanes.cancel()
        finally:
            await handled.ack()


class _Handled:
    """Messages handled and not yet acknowledged: acked together at the next
    fetch's return (`consume`). A message the handler answered itself (a nak,
    a term, an ack) is not acked again, nor one whose handler failed (nak'd,
    or if even that failed, delivered again after the consumer's ack_wait)."""

    def __init__(self, in_hand: _InHand, what: str) -> None:
        self._in_hand = in_hand
        self._what = what
        self._msgs: list[Msg] = []

    def add(self, msg: Msg, handled: bool) -> None:
        if handled and not msg.is_acked:
            self._msgs.append(msg)  # kept alive meanwhile: still in hand
        else:
            self._in_hand.discard(msg)

    async def ack(self) -> None:
        msgs, self._msgs = self._msgs, []
        for msg in msgs:
            self._in_hand.discard(msg)
            if msg.is_acked:
                continue
            try:
                await msg.ack()
            except Exception as err:  # noqa: BLE001 - at worst it is delivered again
                log.warning("acknowledging a message of %s failed: %r", self._what, err)


class _InHand:
    """The messages taken off a consumer and not yet answered, kept alive at
    the server (`+WPI`) every `every_s` while they are held here."""

    def __init__(self, every_s: float | None) -> None:
        self._every_s = every_s
        self._msgs: dict[int, Msg] = {}  # (by identity: a Msg is not hashable)

    def add(self, msg: Msg) -> None:
        self._msgs[id(msg)] = msg

    def discard(self, msg: Msg) -> None:
        self._msgs.pop(id(msg), None)

    async def keep_alive(self, what: str) -> None:
        assert self._every_s
        while True:
            await asyncio.sleep(self._every_s)
            for key, msg in list(self._msgs.items()):
                if key not in self._msgs or msg.is_acked:
                    # Answered meanwhile (a publish can wait for a flush): a +WPI
                    # after a nak would push its redelivery back by ack_wait.
                    continue
                try:
                    await msg.in_progress()
                except Exception as err:  # noqa: BLE001 - at worst it is delivered again
                    log.warning("keeping a message of %s in progress failed: %r", what, err)


# Messages waiting in lanes, per handler allowed to run: a lane held up by a
# slow message keeps its next ones here, without taking another lane's turn.
_WAITING_PER_RUNNING = 8


class _Lanes:
    """Messages handled concurrently across lanes, in order within each: at
    most `limit` handlers run at once, and at most `_WAITING_PER_RUNNING` times
    that are in hand (running or waiting for their lane)."""

    def __init__(
        self,
        handle: Callable[[Msg], Awaitable[None]],
        what: str,
        lane: Callable[[Msg], str],
        limit: int,
        in_hand: _InHand,
        handled: _Handled,
    ) -> None:
        self._handle = handle
        self._held = in_hand
        self._handled = handled
        self._what = what
        self._lane = lane
        self._running_room = asyncio.Semaphore(max(1, limit))
        self._room = asyncio.Semaphore(max(1, limit) * _WAITING_PER_RUNNING)
        self._last: dict[str, asyncio.Task[None]] = {}  # each lane's newest message
        self._in_hand: set[asyncio.Task[None]] = set()  # running or waiting for their lane

    async def add(self, msg: Msg) -> None:
        """Queue `msg` behind its lane's messages; waits while the lanes hold all
        they may (no more are fetched meanwhile: the backlog stays on the server)."""
        key = self._lane(msg)
        self._held.add(msg)  # from now until its handler returns (or is cancelled)
        try:
            await self._room.acquire()
        except BaseException:
            self._held.discard(msg)
            raise
        task = asyncio.create_task(self._run(self._last.get(key), msg))
        self._last[key] = task
        self._in_hand.add(task)
        task.add_done_callback(lambda t: self._done(key, t))

    async def _run(self, before: asyncio.Task[None] | None, msg: Msg) -> None:
        try:
            if before is not None:
                await asyncio.wait([before])  # its outcome is its own
            async with self._running_room:
                self._handled.add(msg, await _handle_one(msg, self._handle, self._what))
        except BaseException:
            self._held.discard(msg)  # cancelled (stopping): not acked, delivered again
            raise
        finally:
            self._room.release()

    def _done(self, key: str, task: asyncio.Task[None]) -> None:
        self._in_hand.discard(task)
        if self._last.get(key) is task:
            del self._last[key]

    async def cancel(self) -> None:
        await cancel_and_wait(list(self._in_hand))


async def _handle_one(msg: Msg, handle: Callable[[Msg], Awaitable[None]], what: str) -> bool:
    """One message, in a span that continues the sender's trace, measured from
    when JetStream stored it to when it was handled; whether its handler
    returned (False: it raised, and the message was given back)."""
    delivered, stored_ns = delivery(msg)
    if delivered > 1:
        metrics.redelivered(what)
    headers = msg.headers or {}
    outcome = "handled"
    with context.span(what, parent=headers.get(context.TRACEPARENT), kind="consumer"):
        try:
            await handle(msg)
        except Exception:
            outcome = "failed"
            log.exception("handling %s on %s failed; it will be redelivered", what, msg.subject)
            with contextlib.suppress(Exception):
                await msg.nak(delay=1)
    if stored_ns is not None:
        metrics.message_handled(what, msg.subject, outcome, time.time() - stored_ns / 1e9)
    return outcome == "handled"


async def dead_letter(msg: Msg, what: str) -> None:
    """Give up on a message that can never be handled (a poison message): it is
    terminated, never redelivered, and counted."""
    metrics.dead_lettered(what)
    await msg.term()


def delivery(msg: Msg) -> tuple[int, int | None]:
    """(times delivered, when stored in ns since the epoch) from the reply subject
    `$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ns>.<pending>` (or with a
    domain and account hash in front); parsed by hand as `stream_sequence` does.
    A subject of another shape counts as a first delivery of unknown age."""
    tokens = (msg.reply or "").split(".")
    try:
        if len(tokens) == 9:
            return int(tokens[4]), int(tokens[7])
        return int(tokens[6]), int(tokens[9])
    except (IndexError, ValueError):
        return 1, None
