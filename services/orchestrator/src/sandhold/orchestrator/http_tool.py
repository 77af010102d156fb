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
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
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


_opener = urllib.request.build_opener(_NoRedirects)


def perform(call: RecordedHttpCall, idempotency_key: str, egress: Egress) -> tuple[int, str]:
    """One HTTP request (blocking); an HTTP error status is a result, not an error."""
    if egress == "public":
        check_public(call.url)
    data = call.body.encode() if call.body is not None else None
    headers = {"Idempotency-Key": idempotency_key, "User-Agent": "sandhold-orchestrator"}
    headers.update(call.headers)
    request = urllib.request.Request(call.url, data=data, method=call.method, headers=headers)
    try:
        with _opener.open(request, timeout=float(call.timeout)) as response:
            return response.status, response.read(OUTPUT_KEPT).decode("utf-8", "replace")
    except urllib.error.HTTPError as err:
        return err.code, err.read(OUTPUT_KEPT).decode("utf-8", "replace")


def check_public(url: str) -> None:
    """Refuse a URL whose host resolves to any non-global address."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname
    if not host:
        raise EgressDenied(f"{url!r} names no host")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    for *_, address in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        ip = ipaddress.ip_address(address[0])
        if not ip.is_global:
            raise EgressDenied(
                f"{host} resolves to {ip}, which the orchestrator's egress policy "
                "(public) does not allow"
            )
