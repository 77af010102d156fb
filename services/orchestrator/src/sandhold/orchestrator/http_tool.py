"""Tool steps' HTTP requests: on threads of their own, with a total deadline and
an egress policy.

urllib blocks, so each request runs on a thread of this pool (not the loop's
default executor: a stuck request must not delay seed captures). Its timeout
is per socket operation; the step's own limit is enforced around the whole
call, and a thread still stuck after it is left to urllib's socket timeout.

Egress `public` (the default for a standalone orchestrator) refuses hosts that
resolve to loopback, private, link-local or otherwise non-global addresses:
a manifest must not reach the control plane's own network (NATS monitoring,
metrics, cloud metadata). `any` allows them (the embedded `sandhold up`, a
single machine whose user owns every hook). Redirects are never followed: a
3xx is the step's result.

The host is resolved once, and the connection goes to the address that was
checked (the Host header and TLS's SNI and certificate check keep the name): a
second lookup could answer differently (DNS rebinding: public for the check,
loopback for the connect). Proxy settings in the environment are ignored, so a
request never goes anywhere but where it says.
"""

from __future__ import annotations

import asyncio
import functools
import http.client
import ipaddress
import socket
import ssl
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

from sandhold.domain.task import OUTPUT_KEPT
from sandhold.domain.task_manifest import RecordedHttpCall

Egress = Literal["any", "public"]


class EgressDenied(ValueError):
    """The request's host is not allowed by the egress policy (permanent)."""


class HttpTool:
    def __init__(self, *, egress: Egress = "public", threads: int = 8) -> None:
        self.egress = egress
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="http-step")

    async def perform(self, call: RecordedHttpCall, idempotency_key: str) -> tuple[int, str]:
        """(status, body); raises OSError (incl. TimeoutError) when there is no
        answer, ValueError when the request cannot or may not be sent."""
        loop = asyncio.get_running_loop()
        work = loop.run_in_executor(self._pool, perform, call, idempotency_key, self.egress)
        async with asyncio.timeout(float(call.timeout) + 5.0):
            return await work

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):  # noqa: ANN002, ANN003 - urllib's signature
        return None  # urllib then raises HTTPError with the 3xx: a result like any status


class _PinnedHTTP(http.client.HTTPConnection):
    """Connects to `address`, whatever the name resolves to by then."""

    def __init__(self, host: str, *, address: str, timeout: float | None = None) -> None:
        super().__init__(host, timeout=timeout)
        self._address = address

    def connect(self) -> None:
        self.sock = socket.create_connection((self._address, self.port), self.timeout)


class _PinnedHTTPS(http.client.HTTPSConnection):
    def __init__(
        self, host: str, *, address: str, context: ssl.SSLContext, timeout: float | None = None
    ) -> None:
        super().__init__(host, timeout=timeout, context=context)
        self._address = address

    def connect(self) -> None:
        raw = socket.create_connection((self._address, self.port), self.timeout)
        context = self._context  # type: ignore[attr-defined]  # set by HTTPSConnection
        self.sock = context.wrap_socket(raw, server_hostname=self.host)  # SNI: the name


class _Pinned(urllib.request.HTTPHandler, urllib.request.HTTPSHandler):
    def __init__(self, address: str) -> None:
        urllib.request.HTTPHandler.__init__(self)
        urllib.request.HTTPSHandler.__init__(self, context=ssl.create_default_context())
        self._address = address

    def http_open(self, req: urllib.request.Request):  # noqa: ANN201 - urllib's
        return self.do_open(functools.partial(_PinnedHTTP, address=self._address), req)

    def https_open(self, req: urllib.request.Request):  # noqa: ANN201
        connection = functools.partial(
            _PinnedHTTPS,
            address=self._address,
            context=self._context,  # type: ignore[attr-defined]
        )
        return self.do_open(connection, req)


def perform(call: RecordedHttpCall, idempotency_key: str, egress: Egress) -> tuple[int, str]:
    """One HTTP request (blocking); an HTTP error status is a result, not an error."""
    address = resolve(call.url, public_only=egress == "public")
    opener = urllib.request.build_opener(
        urllib.request.ProxyHandler({}), _NoRedirects, _Pinned(address)
    )
    data = call.body.encode() if call.body is not None else None
    headers = {"Idempotency-Key": idempotency_key, "User-Agent": "sandhold-orchestrator"}
    headers.update(call.headers)
    request = urllib.request.Request(call.url, data=data, method=call.method, headers=headers)
    try:
        with opener.open(request, timeout=float(call.timeout)) as response:
            return response.status, response.read(OUTPUT_KEPT).decode("utf-8", "replace")
    except urllib.error.HTTPError as err:
        return err.code, err.read(OUTPUT_KEPT).decode("utf-8", "replace")


def resolve(url: str, *, public_only: bool) -> str:
    """The one address the request will go to; with `public_only`, refuse a host
    with any non-global address among its answers."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname
    if not host:
        raise EgressDenied(f"{url!r} names no host")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    answers = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    if not answers:
        raise OSError(f"{host} does not resolve")
    if public_only:
        for *_, address in answers:
            ip = ipaddress.ip_address(address[0])
            if not ip.is_global:
                raise EgressDenied(
                    f"{host} resolves to {ip}, which the orchestrator's egress policy "
                    "(public) does not allow"
                )
    return str(answers[0][4][0])


def check_public(url: str) -> None:
    """Refuse a URL whose host resolves to any non-global address."""
    resolve(url, public_only=True)
