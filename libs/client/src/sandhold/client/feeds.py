"""A sandbox's live events, shared by the execs waiting on it (decision 089).

An exec learns its command's end from JetStream's own delivery of the
sandbox's events (an ordered consumer: decision 024). Made per exec, that was a
read of the subject's last sequence before the request could be sent, and a
consumer made and deleted at the server, for every command. A client running
commands one after another on a sandbox, as an agent does, now keeps one
follower per sandbox while execs use it and for `IDLE_S` after the last one.
A new follower starts after the highest stream sequence the client's
followers learned recently, with no read at all (decision 099).

Shared, nothing an exec does to its own waiting may reach the others: an exec
cancelled while its feed starts does not cancel the start (every wait on it
goes through `asyncio.wait`), and a feed stopped (idle, or the client closing)
settles what its execs wait for with an error rather than leaving them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable, Iterator

from nats.aio.msg import Msg
from nats.js.client import JetStreamContext
from sandhold.bus.append import stream_last_sequence
from sandhold.bus.codec import decode_envelope
from sandhold.bus.follow import Follower
from sandhold.bus.names import Names
from sandhold.domain import events as ev
from sandhold.domain.envelope import Envelope
from sandhold.domain.errors import InfraError

log = logging.getLogger(__name__)

# How long a sandbox's follower is kept after its last exec: the next command
# of an agent working through a list comes well within it.
IDLE_S = 5.0
# A new follower starts after the highest stream sequence this client learned
# (an event its followers delivered, or a position read) if it learned it this
# recently: no read of the stream's position before the request (decision 099).
FRESH_S = IDLE_S
# How long stopping one follower may take when the client closes (a server
# that no longer answers must not hold the close up).
STOP_S = 2.0

Ended = tuple[float, ev.CommandEnded]  # when it was written, and the event


class Feed:
    """One sandbox's events from a sequence on, to the execs waiting for an end."""

    def __init__(
        self,
        js: JetStreamContext,
        names: Names,
        sandbox_id: str,
        *,
        after: int | None = None,
        learned: Callable[[int], None] = lambda _seq: None,
    ) -> None:
        """`after`: a sequence the stream already holds, where the feed starts
        (None: it reads the stream's last one first); `learned` is told every
        stream sequence the feed comes to know."""
        self._js = js
        self._stream = names.events_stream
        self._subject = names.events("sandbox", sandbox_id)
        self._waiting: dict[str, list[asyncio.Future[Ended]]] = {}
        self._learned = learned
        self.holders = 0
        self.idle_since: float | None = None
        # A sequence the stream held before any request an exec sends through
        # this feed: every event those requests cause comes after it.
        self.positioned: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        if after is not None:
            self.positioned.set_result(after)
        self.follower: Follower[Envelope] | None = None
        self.following: asyncio.Task[None] = asyncio.create_task(self._follow(after))
        self.following.add_done_callback(self._settle)

    async def _follow(self, after: int | None) -> None:
        if after is None:
            # The stream's last sequence, not the subject's: every event a
            # request sent after this read causes comes after it all the same,
            # and a sandbox whose last event is minutes old costs no read of an
            # old block.
            after = await stream_last_sequence(self._js, self._stream)
            self.positioned.set_result(after)
            self._learned(after)
        self.follower = Follower(
            self._js, self._stream, self._subject, decode_envelope, self._on_event,
            start_seq=after + 1, what="sandbox events",
        )  # fmt: skip
        await self.follower.start(timeout=None, target=after)

    def _settle(self, following: asyncio.Task[None]) -> None:
        """An exec waiting for the position of a feed that will never have one
        (its read failed, or the feed was stopped first) is told why."""
        if self.positioned.done():
            if not following.cancelled():
                following.exception()  # (retrieved: execs read the log instead)
            return
        if following.cancelled():  # (stopped: only ever as the client closes)
            why = InfraError("the client is closed", retryable=False)
        else:
            err = following.exception()
            why = InfraError(f"the sandbox's events cannot be followed: {err!r}", retryable=True)
            why.__cause__ = err
        self.positioned.set_exception(why)
        self.positioned.exception()  # (retrieved: an exec that waits raises it itself)

    def _on_event(self, seq: int, _msg: Msg, envelope: Envelope) -> None:
        self._learned(seq)
        event = envelope.event
        if isinstance(event, ev.CommandEnded):
            for ended in self._waiting.pop(event.command_id, ()):
                if not ended.done():
                    ended.set_result((envelope.time, event))

    def wait_for(self, command_id: str) -> asyncio.Future[Ended]:
        """The live `command.ended` of `command_id`, once delivered."""
        ended: asyncio.Future[Ended] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(command_id, []).append(ended)
        return ended

    def forget(self, command_id: str, ended: asyncio.Future[Ended]) -> None:
        waiting = self._waiting.get(command_id, [])
        if ended in waiting:
            waiting.remove(ended)
        if not waiting:
            self._waiting.pop(command_id, None)

    @property
    def broken(self) -> bool:
        """Its follower could not start: the next exec makes a new feed."""
        return self.following.done() and (
            self.following.cancelled() or self.following.exception() is not None
        )

    async def stop(self) -> None:
        self.following.cancel()
        await asyncio.wait([self.following])  # (the caller's own cancel still raises)
        if self.follower is not None:
            with contextlib.suppress(Exception):  # a closed connection has no subscriptions
                await self.follower.stop()


class Feeds:
    """The feeds of one client, by sandbox; each stopped `IDLE_S` after its last use."""

    def __init__(self, js: JetStreamContext, names: Names) -> None:
        self._js = js
        self._names = names
        self._feeds: dict[str, Feed] = {}
        self._stopping: set[asyncio.Task[None]] = set()
        self._reaper: asyncio.Task[None] | None = None
        self._closed = False
        # The highest stream sequence learned, and when (the loop's clock): a
        # lower bound of the stream's last sequence from then on.
        self._known = 0
        self._known_at = -math.inf

    def __len__(self) -> int:
        return len(self._feeds)

    @property
    def closed(self) -> bool:
        return self._closed

    def get(self, sandbox_id: str) -> Feed | None:
        return self._feeds.get(sandbox_id)

    @contextlib.contextmanager
    def holding(self, sandbox_id: str) -> Iterator[Feed]:
        """The sandbox's feed (made if there is none, or its last one broke),
        kept while held."""
        if self._closed:
            raise InfraError("the client is closed", retryable=False)
        feed = self._feeds.get(sandbox_id)
        if feed is None or feed.broken:
            if feed is not None:
                self._stop_later(feed)
            feed = self._feeds[sandbox_id] = Feed(
                self._js, self._names, sandbox_id, after=self._recent(), learned=self._learn
            )
        feed.holders += 1
        feed.idle_since = None
        try:
            yield feed
        finally:
            feed.holders -= 1
            if feed.holders == 0 and self._feeds.get(sandbox_id) is feed:
                feed.idle_since = asyncio.get_running_loop().time()
                if not self._closed and (self._reaper is None or self._reaper.done()):
                    self._reaper = asyncio.create_task(self._reap())

    def _learn(self, seq: int) -> None:
        if seq > self._known:
            self._known, self._known_at = seq, asyncio.get_running_loop().time()

    def _recent(self) -> int | None:
        """A sequence the stream holds, learned within `FRESH_S`, or None.

        Every event a request sent from now on causes comes after it, whatever
        the stream stored since, so a feed may start there. (That assumes the
        stream's sequences only grow: a stream recreated, or a server that lost
        its last writes, within `FRESH_S` makes an exec wait on the log's 2 s
        path instead, until the bound ages out.) Learned recently, it is near
        the stream's end: the server finds the sandbox's events after it in the
        blocks it holds in memory."""
        if asyncio.get_running_loop().time() - self._known_at > FRESH_S:
            return None
        return self._known

    def _stop_later(self, feed: Feed) -> None:
        stopping = asyncio.create_task(feed.stop())
        self._stopping.add(stopping)
        stopping.add_done_callback(self._stopping.discard)

    async def _reap(self) -> None:
        """Stop the feeds idle for `IDLE_S`, until none is left idle."""
        loop = asyncio.get_running_loop()
        while True:
            idle = [f.idle_since for f in self._feeds.values() if f.idle_since is not None]
            if not idle:
                return
            await asyncio.sleep(max(0.0, min(idle) + IDLE_S - loop.time()))
            now = loop.time()
            # Chosen and taken out at once, then stopped: a feed made meanwhile
            # for the same sandbox is never the one removed.
            due = [
                (sandbox_id, feed)
                for sandbox_id, feed in self._feeds.items()
                if feed.idle_since is not None and now - feed.idle_since >= IDLE_S
            ]
            for sandbox_id, feed in due:
                del self._feeds[sandbox_id]
                self._stop_later(feed)

    async def close(self) -> None:
        # Everything set going before the first wait: a close cut short (its
        # caller cancelled) still stops every feed.
        self._closed = True
        for feed in self._feeds.values():
            self._stop_later(feed)
        self._feeds = {}
        if self._reaper is not None:
            self._reaper.cancel()
        if self._stopping:
            await asyncio.wait(set(self._stopping), timeout=STOP_S)
