"""Reading much at once at the speed of what is done with it, not of nats-py.

A service's first start, `sandhold ls` and `export` fold a long stretch of
the log; a restore fetches a gigabyte of chunks. Through nats-py each
delivered message costs about as much as the fold itself: a regex per
protocol line, a header parser that looks at every character of every header
name, a `Msg`, a queue and a task switch (benchmark (b) splits it), and
large messages are read 32 KiB at a time. Here a connection of our own, the
process's own user, rights and inbox, parses the protocol in one synchronous
loop per socket read (`_Wire`):

* `bulk_read` (decision 100): a stretch of a stream through a pull consumer,
  each message handed over as the `Msg` nats-py would have made;
* `bulk_get` (decision 101): many direct gets, `in_flight` at a time.

Each is an optimisation only, never the one way to read: it stops at the
first thing it does not expect (a gap, a lost connection, a status, a stall,
a refusal), and a connection with TLS, nkeys or JWTs is not copied at all.
`bulk_read` hands messages over strictly in stream order, so the caller goes
on from the last sequence it was handed with the ordinary follower, nothing
skipped or handed over twice; `bulk_get` says which it did not hand over.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, cast
from urllib.parse import ParseResult

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

log = logging.getLogger(__name__)

# Messages per pull request, and requests kept in flight: the server always
# has the next batch to send while this process folds the one before, and
# what waits to be folded is at most two batches of messages, whatever the
# log holds (events are a few hundred bytes: a few megabytes at most; a
# server whose buffer for this client overflows drops it, and the usual
# follower reads on).
BATCH = 1000
IN_FLIGHT = 2
# A read that hands nothing over for this long is given up (the caller goes
# on without it). Pull requests last longer: one being filled from a sparse
# stretch is not ended by the server while it is still being filled.
STALL_S = 10.0
EXPIRES_S = 60.0
# Whatever `take` is handed comes from one sid: the only subscription made here.
_SID = b"1"

Take = Callable[[int, Msg], None]


class Stopped(Exception):
    """Why a bulk read or get ended before its end (the caller goes on)."""


async def bulk_read(
    nc: NATS,
    js: JetStreamContext,
    stream: str,
    subject_filter: str,
    *,
    after: int,
    until: int,
    take: Take,
    batch: int | None = None,
) -> None:
    """Hand `take` every message of `stream` matching `subject_filter` after
    sequence `after`, in stream order, until one at or past `until` was handed
    over, or the stream holds no more of them for now. Returns early,
    having said why in the log, at anything unexpected: the caller knows how
    far it got from what it was handed."""
    target = _plain_target(nc)
    if target is None:
        log.info("bulk read of %s: not on a connected, plain connection; reading as usual", stream)
        return
    consumer = f"bulk-{uuid.uuid4().hex}"
    reader: _Reader | None = None
    try:
        await js.add_consumer(
            stream, reader_config(consumer, subject_filter, after=after, inactive_s=30.0)
        )
        host, port, login = target
        loop = asyncio.get_running_loop()
        api = getattr(js, "_prefix", "$JS.API")  # (nats-py's, with a domain's in it)
        reader = _Reader(
            f"{api}.CONSUMER.MSG.NEXT.{stream}.{consumer}".encode(),
            nc.new_inbox().encode(),
            login,
            nc.options.get("name") or "sandhold",
            take,
            until,
            batch or BATCH,
            nc,
        )
        await asyncio.wait_for(loop.create_connection(lambda: reader, host, port), STALL_S)
        await reader.run()
    except asyncio.CancelledError:
        raise
    except Exception as err:  # noqa: BLE001 - the caller reads on the usual way
        log.info("bulk read of %s stopped (%s); reading on as usual", stream, err)
    finally:
        if reader is not None:
            reader.close()
        # Not waited for: the read is over, whoever waits on it waits no longer.
        # (If this fails too, the server drops the consumer once it is idle.)
        removing = asyncio.ensure_future(_delete(js, stream, consumer))
        _removing.add(removing)
        removing.add_done_callback(_removing.discard)


_removing: set[asyncio.Future[None]] = set()  # consumers being deleted after their read


async def _delete(js: JetStreamContext, stream: str, consumer: str) -> None:
    with contextlib.suppress(Exception):
        await asyncio.wait_for(js.delete_consumer(stream, consumer), 5)


async def bulk_get(
    nc: NATS,
    js: JetStreamContext,
    stream: str,
    subjects: list[str],
    *,
    take: Callable[[int, bytes], None],
    before: Callable[[int], Awaitable[None]] | None = None,
    in_flight: int = 32,
) -> list[int]:
    """Direct gets of each subject's last message, `in_flight` at a time, each
    answer's data handed to `take` with the subject's index as it comes (in any
    order); `before(i)` is awaited before subject `i` is asked for (room for
    its answer). Returns the indexes of the subjects not handed over, in order:
    none stored, or not asked or answered because the read stopped (said in
    the log: anything unexpected, `take` raising among them); the caller reads
    those the usual way. What `before` raises is raised."""
    left = list(range(len(subjects)))
    target = _plain_target(nc)
    if target is None or not subjects:
        return left
    host, port, login = target
    api = getattr(js, "_prefix", "$JS.API")
    getter = _Getter(
        f"{api}.DIRECT.GET.{stream}.".encode(),
        subjects,
        nc.new_inbox().encode(),
        login,
        nc.options.get("name") or "sandhold",
        take,
    )
    watching: asyncio.Future[None] | None = None
    making_room = False
    try:
        loop = asyncio.get_running_loop()
        await asyncio.wait_for(loop.create_connection(lambda: getter, host, port), STALL_S)
        watching = asyncio.ensure_future(getter.run())
        await first_of(getter.ready.wait(), watching)
        for index in left:
            while getter.outstanding >= in_flight and not getter.stopped:
                getter.answered.clear()
                await first_of(getter.answered.wait(), watching)
            if getter.stopped:
                break
            if before is not None:
                # Raced with the watch: room that only answers would free is
                # not waited for once no more answers can come.
                making_room = True
                made = await _unless_ended(before(index), watching)
                making_room = False
                if not made:
                    break
            getter.ask(index)
        getter.finish()
        await watching
    except asyncio.CancelledError:
        raise
    except Exception as err:  # noqa: BLE001 - the caller reads on the usual way
        if making_room:
            raise
        log.info("bulk get from %s stopped (%s); reading on as usual", stream, err)
    finally:
        getter.close()
        if watching is not None:
            watching.cancel()
            await asyncio.gather(watching, return_exceptions=True)  # (its end, not ours)
    return [i for i in left if i not in getter.handed]


async def _unless_ended(work: Awaitable[None], watching: asyncio.Future[None]) -> bool:
    """`work` done (True; what it raised is raised), or given up because the
    watch ended first (False)."""
    task: asyncio.Future[None] = asyncio.ensure_future(work)
    try:
        await asyncio.wait({task, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        return False
    task.result()
    return True


async def first_of(waiting: Awaitable[object], task: asyncio.Future[None]) -> None:
    """Until `waiting` is done, or `task` ended (its error raised)."""
    waiter: asyncio.Future[Any] = asyncio.ensure_future(waiting)
    try:
        await asyncio.wait({waiter, task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
    if task.done() and not waiter.done():
        task.result()  # raises what ended it


def reader_config(
    name: str, subject_filter: str, *, after: int, inactive_s: float
) -> ConsumerConfig:
    """A pull consumer of one reader's own: the messages after sequence `after`,
    no acks, and dropped by the server once its reader vanished (`inactive_s`)."""
    return ConsumerConfig(
        name=name,
        filter_subject=subject_filter,
        deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
        opt_start_seq=after + 1,
        ack_policy=AckPolicy.NONE,
        inactive_threshold=inactive_s,
    )


def _plain_target(nc: NATS) -> tuple[str, int, dict[str, str]] | None:
    """Where and as whom to connect: the server `nc` is connected to, with its
    user and password (or token). None where more than that is asked (TLS,
    nkeys or JWTs, a websocket): those connections read the usual way."""
    url: ParseResult | None = nc.connected_url
    if url is None or url.scheme not in ("nats", "") or url.hostname is None:
        return None
    options = nc.options
    if options.get("tls") is not None or getattr(nc, "_signature_cb", None) is not None:
        return None
    login: dict[str, str] = {}
    user, password, token = options.get("user"), options.get("password"), options.get("token")
    if callable(user) or callable(password) or callable(token):
        return None
    if user is not None and password is not None:
        login = {"user": user, "pass": password}
    elif token is not None:
        login = {"auth_token": token}
    elif url.username is not None:
        login = (
            {"user": url.username, "pass": url.password}
            if url.password is not None
            else {"auth_token": url.username}
        )
    return url.hostname, url.port or 4222, login


class _Wire(asyncio.Protocol):
    """One connection of our own with one subscription (everything under an
    inbox of the user's), the protocol parsed in one loop per socket read.
    Subclasses say what to ask once connected and what to do with a message
    or a status; anything unexpected ends it (`Stopped`)."""

    def __init__(self, inbox: bytes, login: dict[str, str], name: str) -> None:
        self._inbox = inbox
        self._login = login
        self._name = name
        self._transport: asyncio.Transport | None = None
        self._buf = b""
        self._greeted = False  # the server's INFO read, CONNECT sent
        self._done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.moved = 0  # answers taken in (`run` watches it for a stall)

    async def run(self) -> None:
        """Until the work is done; `Stopped` (or what the connection failed
        with) otherwise, also when nothing came for `STALL_S` while waited for."""
        while True:
            seen = self.moved
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._done), STALL_S)
            if self._done.done():
                return self._done.result()
            if self.moved == seen and self._waiting():
                raise Stopped(f"nothing in {STALL_S:.0f} s")

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
        if not self._done.done():
            self._done.set_exception(Stopped("closed"))
        self._done.exception()  # (retrieved: no "never retrieved" warning)

    @property
    def stopped(self) -> bool:
        return self._done.done()

    # --- for subclasses --------------------------------------------------------------

    def _ready(self) -> None:
        """Connected and subscribed: ask for the first answers."""

    def _message(self, subject: bytes, reply: bytes, head: bytes | None, payload: bytes) -> None:
        """One message (`head`: its header block, None when stored without)."""
        raise NotImplementedError

    def _status(self, subject: bytes, status: bytes) -> None:
        """A status the server sent (`404 No Messages`, `408 Request Timeout`…)."""
        raise Stopped(f"the server said {status.decode(errors='replace')!r}")

    def _waiting(self) -> bool:
        """Whether an answer is due (a stall is one that does not come)."""
        return True

    # --- asyncio.Protocol --------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # (a TCP one: made here)

    def connection_lost(self, exc: Exception | None) -> None:
        self._end(Stopped(f"connection lost ({exc})" if exc else "connection closed"))

    def data_received(self, data: bytes) -> None:
        buf = self._buf + data if self._buf else data
        try:
            used = self._parse(buf)
        except Exception as err:  # noqa: BLE001 - ends the read, not the process
            self._end(err if isinstance(err, Stopped) else Stopped(f"{type(err).__name__}: {err}"))
            used = len(buf)
        self._buf = buf[used:]

    # --- the protocol ----------------------------------------------------------------

    def _parse(self, buf: bytes) -> int:
        """Everything whole in `buf`, in order; how many bytes were used."""
        pos = 0
        size = len(buf)
        message = self._message
        while not self._done.done():
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                return pos
            headed = buf.startswith(b"HMSG ", pos)
            if headed or buf.startswith(b"MSG ", pos):
                # [H]MSG <subject> <sid> [<reply>] [<header bytes>] <total bytes>
                fields = buf[pos + (5 if headed else 4) : eol].split(b" ")
                start = eol + 2
                end = start + int(fields[-1])
                if size < end + 2:
                    return pos
                pos = end + 2
                if not headed:
                    message(fields[0], fields[2] if len(fields) == 4 else b"", None, buf[start:end])
                elif buf.startswith(b"NATS/1.0 ", start):
                    line = buf[start + len(b"NATS/1.0 ") : buf.find(b"\r\n", start)]
                    self._status(fields[0], line.strip())
                else:
                    split = start + int(fields[-2])
                    reply = fields[2] if len(fields) == 5 else b""
                    message(fields[0], reply, buf[start:split], buf[split:end])
            elif buf.startswith(b"PING", pos):
                self._write(b"PONG\r\n")
                pos = eol + 2
            elif buf.startswith(b"INFO ", pos):
                info = buf[pos + 5 : eol]
                pos = eol + 2
                if not self._greeted:
                    self._greet(json.loads(info))
            elif buf.startswith(b"-ERR", pos):
                raise Stopped(buf[pos:eol].decode(errors="replace"))
            else:  # +OK, PONG
                pos = eol + 2
        return size

    def _greet(self, info: dict[str, object]) -> None:
        if info.get("tls_required"):
            raise Stopped("the server asks for TLS")
        connect = {
            "verbose": False,
            "pedantic": False,
            "lang": "python3",
            "version": "sandhold-bulk",
            "protocol": 1,
            "headers": True,
            "no_responders": True,
            "name": f"{self._name} (bulk read)",
            **self._login,
        }
        self._greeted = True
        self._write(b"CONNECT " + json.dumps(connect).encode() + b"\r\n")
        self._write(b"SUB " + self._inbox + b".> " + _SID + b"\r\n")
        self._ready()

    def _write(self, data: bytes) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(data)

    def _end(self, err: Exception | None) -> None:
        if self._done.done():
            return
        if err is None:
            self._done.set_result(None)
        else:
            self._done.set_exception(err)


class _Reader(_Wire):
    """A stretch of a stream through a pull consumer: each message handed to
    `take` in stream order as soon as it is whole."""

    def __init__(
        self,
        pull_subject: bytes,
        inbox: bytes,
        login: dict[str, str],
        name: str,
        take: Take,
        until: int,
        batch: int,
        nc: NATS,
    ) -> None:
        super().__init__(inbox, login, name)
        self._pull = pull_subject
        self._take = take
        self._until = until
        self._batch = batch
        self._nc = nc  # (each Msg names the client it came from)
        self._delivered = 0  # the consumer's sequence of the last message handed over
        self._asked = 0  # messages asked for so far

    def _ready(self) -> None:
        for _ in range(IN_FLIGHT):
            self._ask()

    def _message(self, subject: bytes, reply: bytes, head: bytes | None, payload: bytes) -> None:
        # $JS.ACK.[<domain>.<account>.]<stream>.<consumer>.<delivered>.
        #   <stream seq>.<consumer seq>.<time>.<pending>[.<token>]
        tokens = reply.split(b".")
        if len(tokens) < 9:
            raise Stopped(f"a message that is not a consumer's: reply {reply!r}")
        at = 5 if len(tokens) == 9 else 7
        seq, delivered = int(tokens[at]), int(tokens[at + 1])
        if delivered != self._delivered + 1:
            raise Stopped(f"consumer sequence {delivered} after {self._delivered}")
        self._delivered = delivered
        self.moved += 1
        self._take(
            seq,
            Msg(
                self._nc,
                subject.decode(),
                reply.decode(),
                payload,
                # (stored without headers: nats-py says None too)
                None if head is None else _headers(head),
            ),
        )
        if seq >= self._until or tokens[at + 3] == b"0":
            # (nothing more to come for now: the usual follower waits for it)
            self._end(None)
        elif self._asked - delivered <= (IN_FLIGHT - 1) * self._batch:
            self._ask()

    def _ask(self) -> None:
        """One more pull request for the next `batch` messages."""
        body = b'{"batch":%d,"expires":%d}' % (self._batch, int(EXPIRES_S * 1e9))
        self._write(b"PUB %s %s.p %d\r\n%s\r\n" % (self._pull, self._inbox, len(body), body))
        self._asked += self._batch


class _Getter(_Wire):
    """Direct gets of subjects' last messages, each answer handed to `take`
    with the index of the subject asked for, as it comes."""

    def __init__(
        self,
        get_prefix: bytes,
        subjects: list[str],
        inbox: bytes,
        login: dict[str, str],
        name: str,
        take: Callable[[int, bytes], None],
    ) -> None:
        super().__init__(inbox, login, name)
        self._get = get_prefix
        self._subjects = subjects
        self._take = take
        self.handed: set[int] = set()
        self._asked: set[int] = set()  # asked and not answered
        self.ready = asyncio.Event()  # connected: asking may begin
        self.answered = asyncio.Event()  # set at each answer
        self._closing = False  # everything asked: done once all are answered

    @property
    def outstanding(self) -> int:
        """Asked and not answered."""
        return len(self._asked)

    def ask(self, index: int) -> None:
        subject = self._subjects[index].encode()
        self._write(b"PUB %s%s %s.%d 0\r\n\r\n" % (self._get, subject, self._inbox, index))
        if not self._asked:
            self.moved += 1  # (a stall is counted from now: a wait for room is none)
        self._asked.add(index)

    def finish(self) -> None:
        """Nothing more will be asked: done once every answer came."""
        self._closing = True
        if self.outstanding == 0:
            self._end(None)

    def _ready(self) -> None:
        self.ready.set()

    def _waiting(self) -> bool:
        return self.outstanding > 0 or not self.ready.is_set()

    def _message(self, subject: bytes, reply: bytes, head: bytes | None, payload: bytes) -> None:
        index = self._answer(subject)
        self._take(index, payload)
        self.handed.add(index)
        self._answered()

    def _status(self, subject: bytes, status: bytes) -> None:
        if not status.startswith(b"404"):
            super()._status(subject, status)
        self._answer(subject)  # none stored: the caller asks the usual way
        self._answered()

    def _answer(self, subject: bytes) -> int:
        index = int(subject.rsplit(b".", 1)[1])
        if index not in self._asked:
            raise Stopped(f"an answer to no question asked: {subject!r}")
        self._asked.discard(index)
        self.moved += 1
        return index

    def _answered(self) -> None:
        self.answered.set()
        if self._closing and self.outstanding == 0:
            self._end(None)


# What `bytes.strip()` strips, which is what nats-py strips a header's name and
# value of (`str.strip()` would strip other whitespace too).
_ASCII_SPACE = " \t\n\r\x0b\x0c"


def _headers(block: bytes) -> dict[str, str] | None:
    """A stored message's headers (`NATS/1.0\\r\\nName: value\\r\\n…\\r\\n\\r\\n`),
    read as nats-py reads them (names ASCII with no whitespace in them, names and
    values stripped, values decoded leniently), in half of nats-py's time: one
    decode of the whole block instead of one per name and value."""
    out: dict[str, str] = {}
    for line in block.decode("utf-8", "replace").split("\r\n")[1:]:
        name, sep, value = line.partition(":")
        name = name.strip(_ASCII_SPACE)
        if sep and name.isascii() and (name.split() == [name] or not name):
            out[name] = value.strip(_ASCII_SPACE)
    return out or None  # (as nats-py: no header at all is None)
