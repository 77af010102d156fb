"""HTTP requests start (or continue) traces too: an ASGI middleware."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from sandhold.telemetry import context

# Read only here: a Mapping, which servers' TypedDict scopes (Litestar's) also are.
Scope = Mapping[str, Any]
ASGIApp = Callable[[Scope, Any, Any], Awaitable[None]]


class TraceMiddleware:
    """Each HTTP request runs in a server span that continues the caller's
    `traceparent` header (or starts a trace): the requests the handler publishes
    carry it on, so one HTTP call is one trace through every service."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        parent = next(
            (v.decode("latin-1") for k, v in scope.get("headers", ()) if k == b"traceparent"),
            None,
        )
        with context.span(f"HTTP {scope['method']}", parent=parent, kind="server"):
            await self.app(scope, receive, send)
