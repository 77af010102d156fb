"""What the HTTP handlers share: the context, auth, parameters, errors."""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Awaitable
from typing import Any, get_args, get_type_hints

import msgspec
from litestar import Request, Response
from sandhold.bus.names import Names
from sandhold.client import Client
from sandhold.domain import sandbox as sb
from sandhold.domain import saves as sv
from sandhold.domain.commands import CommandState
from sandhold.domain.errors import InfraError, Rejected
from sandhold.gateway.problems import FieldError, ProblemError
from sandhold.gateway.readmodel import ReadModel
from sandhold.gateway.tokens import Tokens

log = logging.getLogger("sandhold.gateway")

_encoder = msgspec.json.Encoder()
# \Z, not $: `$` also matches before a final newline, and "sb-…\n" is no id.
SANDBOX_ID = re.compile(r"^sb-[0-9a-f]{16}\Z")
COMMAND_ID = re.compile(r"^cmd-[0-9a-f]{16}\Z")
SAVE_ID = re.compile(r"^sv-[0-9a-f]{16}\Z")
TASK_ID = re.compile(r"^tk-[0-9a-f]{16}\Z")
_KEY = re.compile(r"^[\x21-\x7e]{1,200}\Z")
MAX_LIMIT = 500


class Context:
    """What every handler needs: the bus, the read model, the tokens."""

    def __init__(
        self,
        nc: Any,
        names: Names,
        read_model: ReadModel,
        tokens: Tokens,
        *,
        keepalive_s: float = 15.0,
        request_timeout: float = 30.0,
    ) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.names = names
        self.read_model = read_model
        self.tokens = tokens
        self.keepalive_s = keepalive_s
        self.request_timeout = request_timeout

    def client(self, tenant: str) -> Client:
        return Client(self.nc, self.names, tenant=tenant, request_timeout=self.request_timeout)


def json_response(value: object, status: int = 200, headers: dict[str, str] | None = None):
    return Response(
        content=_encoder.encode(value),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )


# --- request helpers -------------------------------------------------------------


# Set in the ASGI scope by the NATS API (natsapi.py) for the tenant its subject
# names; no HTTP request can set a scope key, only a header.
TENANT_SCOPE_KEY = "sandhold.tenant"


def tenant_of(ctx: Context, request: Request) -> str:
    over_nats = request.scope.get(TENANT_SCOPE_KEY)
    if isinstance(over_nats, str):
        return over_nats
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    tenant = ctx.tokens.tenant_of(token.strip()) if scheme.lower() == "bearer" else None
    if tenant is None:
        raise ProblemError(
            "unauthorized",
            "send `Authorization: Bearer <token>`; `sandhold token create` makes one",
            headers={"WWW-Authenticate": 'Bearer realm="sandhold"'},
        )
    return tenant


def idempotency_key(request: Request) -> str:
    key = request.headers.get("idempotency-key")
    if key is None:
        return uuid.uuid4().hex  # no key: every call is new work
    if not _KEY.match(key):
        raise ProblemError(
            "invalid_header",
            "Idempotency-Key: 1-200 printable ASCII characters without spaces",
            errors=[FieldError(field="Idempotency-Key", message="must match ^[\\x21-\\x7e]+$")],
        )
    return key


async def json_body(request: Request) -> bytes:
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media and media != "application/json" and not media.endswith("+json"):
        raise ProblemError(
            "unsupported_media_type",
            f"send the body as application/json, not {media}",
        )
    return await request.body()


def check_id(value: str, pattern: re.Pattern[str], code: str, what: str) -> str:
    # An id that cannot exist is reported like one that does not.
    if not pattern.match(value):
        raise ProblemError(code, f"no {what} {value}")
    return value


def query_int(request: Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    if not is_digits(raw) or not low <= int(raw) <= high:
        raise ProblemError(
            "invalid_parameter",
            f"{name} must be an integer from {low} to {high}",
            errors=[FieldError(field=name, message=f"integer {low}..{high}")],
        )
    return int(raw)


def is_digits(raw: str) -> bool:
    """ASCII digits only: `str.isdigit()` is also true for '²' or '٣', which
    `int()` refuses (a 500 instead of a 400)."""
    return raw.isascii() and raw.isdigit()


def query_choice(request: Request, name: str, choices: frozenset[str]) -> str | None:
    raw = request.query_params.get(name)
    if raw is not None and raw not in choices:
        raise ProblemError(
            "invalid_parameter",
            f"{name} must be one of {', '.join(sorted(choices))}",
            errors=[FieldError(field=name, message="unknown value")],
        )
    return raw


def query_bool(request: Request, name: str) -> bool:
    raw = request.query_params.get(name, "false").lower()
    if raw not in ("true", "false", "1", "0"):
        raise ProblemError("invalid_parameter", f"{name} must be true or false")
    return raw in ("true", "1")


# A page's cursor is where the previous page ended: its last row's order value (a
# time) and id, as `<time>~<id>`. Any value of this shape names a point in the
# list, so a client-made one is answered with the page after it, never an error.
CURSOR_PATTERN = r"^[0-9]{1,12}(\.[0-9]{1,20})?~[a-z]{2,3}-[0-9a-f]{16}$"
_CURSOR = re.compile(CURSOR_PATTERN)


def encode_cursor(order: float, row_id: str) -> str:
    return f"{float(order)!r}~{row_id}"


def decode_cursor(request: Request) -> list | None:
    raw = request.query_params.get("cursor")
    if raw is None:
        return None
    if not _CURSOR.match(raw):
        raise ProblemError("invalid_parameter", "cursor: pass back a next_cursor this API returned")
    order, row_id = raw.split("~")
    return [float(order), row_id]


async def fresh(ctx: Context) -> None:
    """Lists answer after the read model has what the log had when asked (a
    write acknowledged before the list is in it), waiting at most a moment."""
    end = await ctx.read_model.log_end(ctx.js)
    await ctx.read_model.wait_for(end, 2.0)


async def call(action: Awaitable[Any]) -> Any:
    try:
        return await action
    except Rejected as err:
        raise ProblemError(err.code, err.message) from err
    except InfraError as err:
        raise ProblemError(
            "unavailable",
            f"{err}; retry with the same Idempotency-Key to get the result",
            retryable=True,
            headers={"Retry-After": "1"},
        ) from err


# Phases, command states and save states a list can be filtered by: the domain's own.
PHASES = frozenset(get_args(sb.Phase))
COMMAND_STATES = frozenset(v for part in get_args(CommandState) for v in get_args(part))
SAVE_KINDS = frozenset(get_args(get_type_hints(sv.SaveRecord)["kind"]))
SAVE_STATES = frozenset(get_args(sv.SaveState))
