"""The gateway's API over NATS, for a tenant's own clients (decision 028).

A tenant's NATS user (`sandhold credentials create --tenant T`) may publish to
`<prefix>.api.<T>` and read its own inbox, nothing else: no JetStream API, no
request or event subject. Each message there is one call of the HTTP API,

    {"method": "POST", "path": "/api/v1/sandboxes", "headers": {...}, "body": {...}}

answered on the message's reply subject with

    {"status": 201, "headers": {...}, "body": {...}}

The call is served by the gateway's own app, in process, as the tenant the
subject names: the same handlers, validation, errors and tenant rules as over
HTTP, so the OpenAPI document describes both. An event stream (`…/events`) is
answered with one page of events (`Accept: application/json`, long polling
with `?wait=`), since an answer is one message.
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Annotated, Any, Literal
from urllib.parse import unquote

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from sandhold.bus.codec import reflected
from sandhold.bus.names import Names, tenant_of_token
from sandhold.gateway.problems import PROBLEM_MEDIA_TYPE, ProblemError
from sandhold.gateway.web import TENANT_SCOPE_KEY

log = logging.getLogger("sandhold.gateway.nats")

# Headers a call may set: what the HTTP API reads (the tenant is the subject's).
_CALL_HEADERS = frozenset({"idempotency-key", "last-event-id", "content-type"})
_TENANT = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # sandhold.domain.requests.Tenant
CALL_TIMEOUT_S = 75.0  # longer than a request's wait for its service (30 s) or a page's (30 s)
MAX_CALLS = 256  # at once per gateway; more wait for a slot...
MAX_WAITING = 4 * MAX_CALLS  # ...up to this many in all, then "busy, retry" at once


class ApiCall(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    method: Literal["GET", "POST", "DELETE"]
    path: Annotated[str, msgspec.Meta(pattern=r"^/api/v1/[\x21-\x7e]*$", max_length=4096)]
    headers: dict[str, Annotated[str, msgspec.Meta(max_length=4096)]] = {}
    body: msgspec.Raw = msgspec.Raw()  # any JSON value; empty for a call without one


class ApiAnswer(msgspec.Struct, kw_only=True):
    status: int
    headers: dict[str, str]
    body: msgspec.Raw | str | None = None


_decode_call = msgspec.json.Decoder(ApiCall).decode
_encoder = msgspec.json.Encoder()


class NatsApi:
    """Serves `<prefix>.api.*` in a queue group: several gateways share the calls."""

    def __init__(
        self,
        nc: NATS,
        names: Names,
        app: Any,
        *,
        max_calls: int = MAX_CALLS,
        max_waiting: int = MAX_WAITING,
    ) -> None:
        self._nc = nc
        self._names = names
        self._app = app
        self._slots = asyncio.Semaphore(max_calls)
        self._max_waiting = max_waiting
        self._calls: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        await self._nc.subscribe(self._names.all_api, queue="gateway", cb=self._on_msg)

    async def close(self) -> None:
        for call in list(self._calls):
            call.cancel()
        await asyncio.gather(*self._calls, return_exceptions=True)

    async def _on_msg(self, msg: Msg) -> None:
        if reflected(msg.headers):
            log.error("a bounced stored message on %s: not a call, dropped", msg.subject)
            return
        if not msg.reply:
            log.warning("a call on %s without a reply subject: nobody to answer", msg.subject)
            return
        if len(self._calls) >= self._max_waiting:  # a flood must not grow without bound
            busy = ProblemError("unavailable", "the gateway is busy: retry", retryable=True)
            await msg.respond(_encoder.encode(_problem(busy, "")))
            return
        # A long poll must not hold up the calls after it: each runs on its own.
        call = asyncio.ensure_future(self._answer(msg))
        self._calls.add(call)
        call.add_done_callback(self._calls.discard)

    async def _answer(self, msg: Msg) -> None:
        async with self._slots:
            answer = await self.answer(msg.subject, msg.data)
        data = _encoder.encode(answer)
        if len(data) > self._nc.max_payload:
            data = _encoder.encode(
                _problem(
                    ProblemError(
                        "response_too_large",
                        f"the answer is {len(data)} bytes, over the bus's limit of "
                        f"{self._nc.max_payload}: ask for less (a smaller `limit`), or use HTTP",
                    ),
                    "",
                )
            )
        await msg.respond(data)

    async def answer(self, subject: str, data: bytes) -> ApiAnswer:
        """The answer to one call sent to `subject`."""
        tenant = tenant_of_token(subject.rpartition(".")[2])
        if not _TENANT.match(tenant):
            return _problem(ProblemError("invalid_parameter", f"no tenant {tenant!r}"), "")
        try:
            call = _decode_call(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as err:
            return _problem(
                ProblemError(
                    "malformed_body",
                    f"a call is {{method, path, headers, body}} as JSON (docs/api.md): {err}",
                ),
                "",
            )
        headers = [
            (name.lower().encode(), value.encode("utf-8", "replace"))
            for name, value in call.headers.items()
            if name.lower() in _CALL_HEADERS
        ]
        body = bytes(call.body)
        if body and not any(name == b"content-type" for name, _ in headers):
            headers.append((b"content-type", b"application/json"))
        # One answer per call: an event stream answers with one page of events.
        headers += [(b"accept", b"application/json"), (b"host", b"nats")]
        try:
            status, out_headers, out = await asyncio.wait_for(
                call_app(
                    self._app,
                    method=call.method,
                    path=call.path,
                    headers=headers,
                    body=body,
                    scope={TENANT_SCOPE_KEY: tenant},
                ),
                CALL_TIMEOUT_S,
            )
        except TimeoutError:
            return _problem(
                ProblemError("unavailable", f"no answer in {CALL_TIMEOUT_S:.0f} s", retryable=True),
                call.path,
            )
        answer_headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in out_headers}
        media = answer_headers.get("content-type", "").split(";")[0].strip()
        value: msgspec.Raw | str | None = None
        if out and media in ("application/json", PROBLEM_MEDIA_TYPE):
            value = msgspec.Raw(out)
        elif out:
            value = out.decode("utf-8", "replace")
        return ApiAnswer(status=status, headers=answer_headers, body=value)


def _problem(err: ProblemError, path: str) -> ApiAnswer:
    return ApiAnswer(
        status=err.status,
        headers={"content-type": PROBLEM_MEDIA_TYPE},
        body=msgspec.Raw(_encoder.encode(err.problem(path))),
    )


async def call_app(
    app: Any,
    *,
    method: str,
    path: str,
    headers: list[tuple[bytes, bytes]],
    body: bytes,
    scope: dict[str, object],
) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """One HTTP request through an ASGI app in this process: (status, headers, body)."""
    path_only, _, query = path.partition("?")
    asgi_scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": unquote(path_only),
        "raw_path": path_only.encode(),
        "query_string": query.encode(),
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 0),
        "server": ("nats", 0),
        "state": {},
        **scope,
    }
    delivered = False
    done = asyncio.Event()

    async def receive() -> dict[str, object]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await done.wait()  # the client "disconnects" once the answer is complete
        return {"type": "http.disconnect"}

    status = 500
    out_headers: list[tuple[bytes, bytes]] = []
    chunks: list[bytes] = []

    async def send(message: dict[str, Any]) -> None:
        nonlocal status, out_headers
        if message["type"] == "http.response.start":
            status = message["status"]
            out_headers = list(message.get("headers", []))
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                done.set()

    try:
        await app(asgi_scope, receive, send)
    finally:
        done.set()
    return status, out_headers, b"".join(chunks)
