"""The HTTP API: sandboxes, commands, saves, hosts, tasks and their events.

Every `/api/v1` route needs `Authorization: Bearer <token>`; the token's
tenant is the tenant of every request it makes (a `tenant` in a body is
refused as an unknown field). Writes become the same requests the NATS API
takes, published to the REQUESTS stream and acknowledged by JetStream before
the scheduler decides; the reply is the answer. A single resource is read by
folding its log (always current); lists come from the read model.
"""

from __future__ import annotations

import logging
import re

import msgspec
from litestar import HttpMethod, Litestar, Request, Response, get, route
from litestar.exceptions import HTTPException
from nats.errors import Error as NatsError
from sandhold.gateway import console, routes_sandboxes, routes_tasks
from sandhold.gateway.problems import PROBLEM_MEDIA_TYPE, ProblemError
from sandhold.gateway.web import Context, json_response
from sandhold.telemetry.asgi import TraceMiddleware

log = logging.getLogger("sandhold.gateway")

_encoder = msgspec.json.Encoder()


def create_app(ctx: Context, *, extra_handlers: list | None = None) -> Litestar:
    handlers = [
        *routes_sandboxes.handlers(ctx),
        *routes_tasks.handlers(ctx),
        *console.handlers(ctx),
        *(extra_handlers or []),
        _openapi_handler(ctx),
        _health_handler(ctx),
    ]
    allowed = _methods_by_path(handlers)
    # Litestar answers OPTIONS with only the first handler's methods when a path
    # has several handlers: list them all (registered first, so they win).
    options = [_options_handler(path, methods) for path, methods in allowed.items()]
    app = Litestar(
        route_handlers=[*options, *handlers],
        openapi_config=None,
        exception_handlers={
            ProblemError: _problem_response,
            HTTPException: _http_problem,
            Exception: _internal_problem,
        },
        request_max_body_size=1_000_000,
        logging_config=None,
        middleware=[TraceMiddleware],
    )
    app.state.allowed = [
        (re.compile("^" + re.sub(r"\{[^}]+\}", "[^/]+", path) + "$"), methods)
        for path, methods in allowed.items()
    ]
    return app


def _methods_by_path(handlers: list) -> dict[str, list[str]]:
    allowed: dict[str, set[str]] = {}
    for handler in handlers:
        for path in handler.paths:
            allowed.setdefault(path, set()).update(handler.http_methods)
    return {path: sorted({*methods, "OPTIONS"}) for path, methods in allowed.items()}


def _options_handler(path: str, methods: list[str]):
    allow = ", ".join(methods)

    @route(path, http_method=[HttpMethod.OPTIONS], include_in_schema=False)
    async def options() -> Response:
        return Response(content=b"", status_code=204, headers={"Allow": allow})

    return options


def _openapi_handler(ctx: Context):
    from sandhold.gateway.openapi import document

    body = _encoder.encode(document())

    @get("/openapi.json", sync_to_thread=False)
    def openapi() -> Response:
        return Response(content=body, media_type="application/json")

    return openapi


def _health_handler(ctx: Context):
    @get("/healthz")
    async def healthz() -> Response:
        return json_response({"ok": True, "read_model_position": ctx.read_model.position})

    return healthz


def _problem_response(request: Request, exc: ProblemError) -> Response:
    return Response(
        content=_encoder.encode(exc.problem(request.url.path)),
        status_code=exc.status,
        media_type=PROBLEM_MEDIA_TYPE,
        headers=exc.headers,
    )


_HTTP_CODES = {
    400: "invalid_parameter",
    401: "unauthorized",
    404: "not_found",
    405: "method_not_allowed",
    406: "not_acceptable",
    413: "body_too_large",
    415: "unsupported_media_type",
}


def _http_problem(request: Request, exc: HTTPException) -> Response:
    code = _HTTP_CODES.get(exc.status_code, "invalid_request")
    detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    headers = {k: v for k, v in (exc.headers or {}).items() if k.lower() != "allow"}
    if exc.status_code == 405:  # RFC 9110: say what is allowed
        for pattern, methods in getattr(request.app.state, "allowed", []):
            if pattern.match(request.url.path):
                headers["Allow"] = ", ".join(methods)
    problem = ProblemError(code, detail, status=exc.status_code, headers=headers)
    return _problem_response(request, problem)


def _internal_problem(request: Request, exc: Exception) -> Response:
    if isinstance(exc, NatsError | TimeoutError | ConnectionError):
        # NATS unreachable or slow: nothing was half-done (publishes are acked or not)
        log.warning("NATS unavailable on %s %s: %r", request.method, request.url.path, exc)
        return _problem_response(
            request,
            ProblemError(
                "unavailable",
                "the message bus did not answer; retry (with the same Idempotency-Key)",
                retryable=True,
                headers={"Retry-After": "1"},
            ),
        )
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return _problem_response(
        request, ProblemError("internal_error", "the gateway failed; see its log", status=500)
    )
