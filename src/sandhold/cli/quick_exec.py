"""`sandhold exec` without nats-py or asyncio: the common case, quickly (decision 058).

Importing nats-py and asyncio takes longer than a short command's whole round
trip (bench l). An `exec` needs little of them: one connection, a consumer of
the sandbox's events, the request stored, its answer, the output as it comes,
and the `command.ended` JetStream stored. This module speaks that much of the
NATS protocol over a blocking socket.

Whatever it does not handle — a server that wants TLS or several URLs,
tracing on, anything refused or not understood before the request is stored,
no end within `HAND_OVER_S`, output whose live delivery missed bytes the
stream kept, a cold start to describe — it hands over to the full client
(`None`, with what it printed so far). Handing over is safe at any point: the
full client sends the same request under the same key, which the scheduler
answers with the same command (decision 001), and prints only what was not
printed here.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
import uuid
from typing import NamedTuple
from urllib.parse import unquote, urlsplit

import msgspec
from sandhold.bus import credentials as creds
from sandhold.bus.codec import (
    OFFSET_HEADER,
    REPLY_HEADER,
    STREAM_HEADER,
    decode_envelope,
    has_fence,
)
from sandhold.bus.names import Names
from sandhold.bus.permissions import inbox_prefix
from sandhold.domain import events as ev
from sandhold.domain import requests as rq
from sandhold.domain.commands import END_STATES
from sandhold.domain.views import CommandView, Reply, ended_view
from sandhold.telemetry import tracing

# A command not ended by then is waited for by the full client, which also
# reads the log when live delivery is quiet: the quick path is for short ones.
HAND_OVER_S = 2.0
CONNECT_TIMEOUT_S = 10.0
REQUEST_TIMEOUT_S = 30.0
# Output chunks travel apart from the events: some may arrive after the end.
OUTPUT_LATE_S = 0.2

_reply_decoder = msgspec.json.Decoder(Reply)


class HandOver(Exception):  # noqa: N818 - not an error: the full client takes it from here
    """The quick path stops here; the full client goes on."""


class Printed:
    """Output written so far, per stream (the full client skips as much)."""

    def __init__(self) -> None:
        self.sizes: dict[str, int] = {"stdout": 0, "stderr": 0}
        self.early: dict[str, dict[int, bytes]] = {}
        self.kept: dict[str, bytearray] = {}  # for --json

    def chunk(self, stream: str, offset: int, data: bytes, *, show: bool) -> None:
        if stream not in self.sizes:
            return
        self.early.setdefault(stream, {})[offset] = data
        waiting = self.early[stream]
        while self.sizes[stream] in waiting:
            piece = waiting.pop(self.sizes[stream])
            if show:
                out = sys.stdout if stream == "stdout" else sys.stderr
                out.buffer.write(piece)
                out.flush()
            self.kept.setdefault(stream, bytearray()).extend(piece)
            self.sizes[stream] += len(piece)


class Message(NamedTuple):
    sid: int  # which subscription it came to
    subject: str
    headers: dict[str, str]
    data: bytes


class Wire:
    """One NATS connection: enough of the client protocol for one exec."""

    def __init__(self, url: str, user: str, password: str) -> None:
        parts = urlsplit(url if "://" in url else f"nats://{url}")
        self._sock = socket.create_connection(
            (parts.hostname or "127.0.0.1", parts.port or 4222), timeout=CONNECT_TIMEOUT_S
        )
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._buf = b""
        info = json.loads(self._line().removeprefix(b"INFO "))
        if info.get("tls_required"):
            raise HandOver("the server wants TLS")
        login = {
            "verbose": False, "pedantic": False, "headers": True, "no_responders": True,
            "protocol": 1, "lang": "python", "version": "sandhold-cli", "name": "sandhold-cli",
            "user": user, "pass": password,
        }  # fmt: skip
        self._send(b"CONNECT " + json.dumps(login).encode() + b"\r\nPING\r\n")
        while (line := self._line()) != b"PONG":
            if line.startswith(b"-ERR"):
                raise HandOver(line.decode(errors="replace"))  # the full client says it well
        self._sids = 0

    def close(self) -> None:
        self._sock.close()

    def subscribe(self, subject: str) -> int:
        """Subscribe; the subscription's id, which each of its messages names."""
        self._sids += 1
        self._send(f"SUB {subject} {self._sids}\r\n".encode())
        return self._sids

    def publish(
        self,
        subject: str,
        payload: bytes,
        *,
        reply: str = "",
        headers: dict[str, str] | None = None,
    ) -> None:
        to = f"{subject} {reply}" if reply else subject
        if not headers:
            self._send(f"PUB {to} {len(payload)}\r\n".encode() + payload + b"\r\n")
            return
        head = "NATS/1.0\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
        raw = head.encode()
        size = f"{len(raw)} {len(raw) + len(payload)}"
        self._send(f"HPUB {to} {size}\r\n".encode() + raw + payload + b"\r\n")

    def next_msg(self, deadline: float) -> Message:
        """The next message to one of our subscriptions. `TimeoutError` at the
        deadline (monotonic)."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            self._sock.settimeout(left)
            try:
                line = self._line()
            except TimeoutError:
                raise
            except OSError as err:
                raise HandOver(f"connection: {err}") from err
            if line == b"PING":
                self._send(b"PONG\r\n")
                continue
            if line.startswith(b"-ERR"):
                raise HandOver(line.decode(errors="replace"))
            # MSG <subject> <sid> [reply] <size>; HMSG ... <header size> <size>. A
            # push consumer's message names the subject it was stored under.
            if line.startswith(b"MSG "):
                subject, sid, *_, size = line[4:].decode().split(" ")
                return Message(int(sid), subject, {}, self._exactly(int(size) + 2)[:-2])
            if line.startswith(b"HMSG "):
                subject, sid, *_, head_size, size = line[5:].decode().split(" ")
                body = self._exactly(int(size) + 2)[:-2]
                cut = int(head_size)
                return Message(int(sid), subject, _headers(body[:cut]), body[cut:])
            # +OK, PONG, INFO (a cluster's news): nothing to do

    def _send(self, data: bytes) -> None:
        self._sock.sendall(data)

    def _line(self) -> bytes:
        while (end := self._buf.find(b"\r\n")) < 0:
            self._fill()
        line, self._buf = self._buf[:end], self._buf[end + 2 :]
        return line

    def _exactly(self, n: int) -> bytes:
        while len(self._buf) < n:
            self._fill()
        data, self._buf = self._buf[:n], self._buf[n:]
        return data

    def _fill(self) -> None:
        data = self._sock.recv(65536)
        if not data:
            raise HandOver("the server closed the connection")
        self._buf += data


def _headers(raw: bytes) -> dict[str, str]:
    """`NATS/1.0[ status]` then `Key: Value` lines; the status as `Status`."""
    lines = raw.decode(errors="replace").split("\r\n")
    found = {}
    status = lines[0][len("NATS/1.0") :].strip()
    if status:
        found["Status"] = status.split(" ", 1)[0]
    for line in lines[1:]:
        key, sep, value = line.partition(":")
        if sep:
            found[key.strip()] = value.strip()
    return found


def exec_quickly(
    *,
    url: str,
    prefix: str,
    credentials: creds.Credentials | None,
    request: rq.RunCommand,
    as_json: bool,
    printed: Printed,
) -> tuple[CommandView, bytes, bytes]:
    """The command's end (its view, as the full client makes it) and its output;
    `HandOver` where the full client must take over."""
    if "," in url or tracing.exporter_setting() != "off":
        raise HandOver("several servers, or tracing (a request's trace starts in the client)")
    user, password = _login(url, credentials)
    names = Names(prefix)
    wire = Wire(url, user, password)
    try:
        return _exec(wire, names, inbox_prefix(user), request, as_json, printed)
    finally:
        wire.close()


def _login(url: str, credentials: creds.Credentials | None) -> tuple[str, str]:
    if credentials is not None:
        if credentials.role == "tenant":
            raise HandOver("a tenant's credential: the full client says why not")
        return credentials.user, credentials.password
    parts = urlsplit(url)
    if parts.username is None:
        raise HandOver("no credential")
    return unquote(parts.username), unquote(parts.password or "")


def _exec(
    wire: Wire,
    names: Names,
    inbox_root: str,
    request: rq.RunCommand,
    as_json: bool,
    printed: Printed,
) -> tuple[CommandView, bytes, bytes]:
    inbox = f"{inbox_root}.{uuid.uuid4().hex}"
    command_id = rq.command_id_for(request.sandbox_id, request.key)
    wire.subscribe(f"{inbox}.*")  # answers: the consumer's, the stored request's, the scheduler's
    # The consumer's own: nats-server delivers a push consumer's messages only to
    # a subscription of exactly its deliver subject (a wildcard one gets none).
    events = wire.subscribe(f"{inbox}.ev")
    wire.subscribe(names.output(request.sandbox_id, command_id) + ".*")
    # The sandbox's events from now on (a consumer made before the request is
    # stored sees every event it causes); JetStream's, so only stored ones.
    stream = names.events_stream
    consumer = {
        "stream_name": stream,
        "config": {
            "deliver_subject": f"{inbox}.ev",
            "deliver_policy": "new",
            "ack_policy": "none",
            "filter_subject": names.events("sandbox", request.sandbox_id),
            "mem_storage": True,
            "num_replicas": 1,
            "inactive_threshold": 30_000_000_000,
        },
    }
    wire.publish(
        f"$JS.API.CONSUMER.CREATE.{stream}", json.dumps(consumer).encode(), reply=f"{inbox}.api"
    )
    exchange = Exchange(wire, events, command_id, printed, as_json)
    deadline = time.monotonic() + REQUEST_TIMEOUT_S
    made = json.loads(exchange.answer(f"{inbox}.api", deadline))
    if "error" in made or "name" not in made:
        raise HandOver("no consumer of the sandbox's events")
    try:
        return _run(wire, names, exchange, inbox, request, printed, deadline)
    finally:
        # Not left for its inactivity limit (30 s): removed as we go (not waited for).
        wire.publish(f"$JS.API.CONSUMER.DELETE.{stream}.{made['name']}", b"")


def _run(
    wire: Wire,
    names: Names,
    exchange: Exchange,
    inbox: str,
    request: rq.RunCommand,
    printed: Printed,
    deadline: float,
) -> tuple[CommandView, bytes, bytes]:
    """The request stored and answered, then the command's end."""
    digest = rq.request_digest(request)
    wire.publish(
        names.request(rq.request_tag(request), request.tenant),
        rq.encode_request(request),
        reply=f"{inbox}.ack",
        headers={
            "Nats-Msg-Id": f"{request.tenant}:{request.key}:{digest}:{inbox[-22:]}",
            "Nats-Expected-Stream": names.requests_stream,
            REPLY_HEADER: f"{inbox}.reply",
        },
    )
    ack = json.loads(exchange.answer(f"{inbox}.ack", deadline) or b"{}")
    if "error" in ack or "seq" not in ack:
        raise HandOver("the request was not stored")
    # Stored: from here on every way out hands over to the same key.
    reply = _reply_decoder.decode(exchange.answer(f"{inbox}.reply", deadline))
    if not reply.ok:
        assert reply.error is not None
        raise Refused(reply.error.code, reply.error.message)
    record = reply.command
    assert record is not None
    if record.state not in END_STATES:
        at, end = exchange.ended(time.monotonic() + HAND_OVER_S)
        record = ended_view(record, end, at=at)
    if record.cold and record.cold_start is None:
        raise HandOver("a cold start to describe")
    # Live delivery is best effort: the rest of what the stream kept is the full client's.
    if not exchange.output_settled(record.output_kept, time.monotonic() + OUTPUT_LATE_S):
        raise HandOver("output missed live")
    return record, bytes(printed.kept.get("stdout", b"")), bytes(printed.kept.get("stderr", b""))


class Refused(Exception):  # noqa: N818 - the scheduler's answer, as `Rejected`
    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


class Exchange:
    """What arrives for one exec, in whatever order it comes: the answers (by
    subject), the command's end, its output."""

    def __init__(
        self, wire: Wire, events: int, command_id: str, printed: Printed, as_json: bool
    ) -> None:
        self._wire, self._events, self._command_id = wire, events, command_id
        self._printed, self._show = printed, not as_json
        self._answers: dict[str, Message] = {}
        self.end: tuple[float, ev.CommandEnded] | None = None

    def answer(self, subject: str, deadline: float) -> bytes:
        """The data of the message to `subject`."""
        while subject not in self._answers:
            try:
                self._take(self._wire.next_msg(deadline))
            except TimeoutError as err:
                raise HandOver(f"no answer on {subject}") from err
        msg = self._answers.pop(subject)
        if msg.headers.get("Status") == "503":
            raise HandOver("no responders")
        return msg.data

    def ended(self, deadline: float) -> tuple[float, ev.CommandEnded]:
        """The stored `command.ended` (its time, the event)."""
        while self.end is None:
            try:
                self._take(self._wire.next_msg(deadline))
            except TimeoutError as err:
                raise HandOver("still running") from err
        return self.end

    def output_settled(self, kept: dict[str, int], deadline: float) -> bool:
        """Whether every byte the stream kept was printed (chunks come apart
        from the events, so some may follow the end: waited for until `deadline`)."""
        while any(self._printed.sizes.get(name, 0) != size for name, size in kept.items()):
            try:
                self._take(self._wire.next_msg(deadline))
            except TimeoutError:
                return False
        return True

    def _take(self, msg: Message) -> None:
        if msg.sid == self._events:
            if has_fence(msg.headers):  # else not an event (follow.py)
                envelope = decode_envelope(msg.data)
                event = envelope.event
                if isinstance(event, ev.CommandEnded) and event.command_id == self._command_id:
                    self.end = (envelope.time, event)
            return
        stream, offset = msg.headers.get(STREAM_HEADER), msg.headers.get(OFFSET_HEADER)
        if stream is not None and offset is not None:
            self._printed.chunk(stream, int(offset), msg.data, show=self._show)
            return
        self._answers[msg.subject] = msg


def run(args: argparse.Namespace) -> int | None:
    """`sandhold exec`, quickly: the exit code, or None when the full client is
    to go on (`args.key` then holds the key used, `args.printed` what was printed)."""
    from sandhold.cli.main import _server, credentials_of
    from sandhold.cli.report import EXIT_REJECTED, report_exec
    from sandhold.cli.secret_args import secrets_of

    args.key = args.key or uuid.uuid4().hex
    args.printed = None
    if not args.argv:
        return None  # the full path says what is wrong
    try:
        secrets = secrets_of(args.secret, args.secret_file)
        request = rq.RunCommand(
            key=args.key,
            tenant="default",
            sandbox_id=args.id,
            argv=args.argv,
            cwd=args.cwd,
            env=dict(pair.split("=", 1) for pair in args.env),
            secrets=secrets,
            timeout_s=args.timeout,
            user=args.user,
        )
        rq.decode_request(rq.encode_request(request))  # as the scheduler will check it
    except (ValueError, msgspec.ValidationError):
        return None
    url, prefix = _server(args)
    printed = Printed()
    try:
        command, stdout, stderr = exec_quickly(
            url=url,
            prefix=prefix,
            credentials=credentials_of(args),
            request=request,
            as_json=args.json,
            printed=printed,
        )
    except Refused as refusal:
        print(f"sandhold: {refusal.code}: {refusal.message}", file=sys.stderr)
        return EXIT_REJECTED
    except (HandOver, OSError, ValueError, msgspec.DecodeError):
        args.printed = dict(printed.sizes)
        return None
    return report_exec(command, stdout, stderr, args.json)
