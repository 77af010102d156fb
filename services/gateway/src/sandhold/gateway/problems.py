"""Errors as RFC 9457 problem details (`application/problem+json`).

Every refusal has a stable `code` (the same codes the NATS API replies with)
and a `type` URI built from it, so a client can branch on either.
"""

from __future__ import annotations

import msgspec

PROBLEM_MEDIA_TYPE = "application/problem+json"
TYPE_BASE = "urn:sandhold:problem:"


class FieldError(msgspec.Struct, kw_only=True):
    field: str  # a JSON path into the body, e.g. `$.memory_limit_bytes`, or a header/parameter
    message: str


class Problem(msgspec.Struct, kw_only=True, omit_defaults=True):
    """RFC 9457 problem details, with sandhold's `code` and per-field `errors`."""

    type: str
    title: str
    status: int
    code: str
    detail: str = ""
    instance: str = ""
    errors: list[FieldError] = []
    retryable: bool = False


# code -> (HTTP status, title). Codes the scheduler and orchestrator answer with
# come first; the rest are the gateway's own.
STATUS: dict[str, tuple[int, str]] = {
    "sandbox_not_found": (404, "No such sandbox"),
    "command_not_found": (404, "No such command"),
    "snapshot_not_found": (404, "No such snapshot"),
    "save_not_found": (404, "No such save"),
    "task_not_found": (404, "No such task"),
    "connection_not_found": (404, "No such Connection"),
    "idempotency_conflict": (409, "Idempotency key used for a different request"),
    "sandbox_deleted": (409, "Sandbox is deleted"),
    "sandbox_stopping": (409, "Sandbox is stopping"),
    "sandbox_not_running": (409, "Sandbox is not running"),
    "sandbox_lost": (409, "Sandbox is lost"),
    "snapshot_name_taken": (409, "Snapshot name taken"),
    "snapshot_not_completed": (409, "Snapshot not completed"),
    "too_many_connections": (409, "Sandbox has the most Connections it may have"),
    "connections_too_large": (409, "Sandbox's Connections would be too large together"),
    "task_finished": (409, "Task already finished"),
    "malformed_request": (422, "Malformed request"),
    "wrong_tenant": (403, "Request names another tenant"),
    # a poison request, dropped after max_deliver attempts (a dead letter): the
    # server failed, the client did nothing wrong (the 409 default would say so)
    "not_handled": (500, "Request could not be handled"),
    # the gateway's own
    "malformed_body": (400, "Body could not be parsed"),
    "invalid_request": (422, "Request does not match the schema"),
    "invalid_parameter": (400, "Invalid parameter"),
    "invalid_header": (400, "Invalid header"),
    "unauthorized": (401, "Missing or unknown bearer token"),
    "not_found": (404, "Not found"),
    "method_not_allowed": (405, "Method not allowed"),
    "unsupported_media_type": (415, "Unsupported media type"),
    "not_acceptable": (406, "Not acceptable"),
    "body_too_large": (413, "Body too large"),
    "unavailable": (503, "Not answered in time"),
    # over the NATS API (natsapi.py): an answer is one message, at most max_payload
    "response_too_large": (400, "Answer too large for one message"),
    "internal_error": (500, "Internal error"),
}


class ProblemError(Exception):
    """Raised by a handler; the app turns it into a problem response."""

    def __init__(
        self,
        code: str,
        detail: str,
        *,
        status: int | None = None,
        errors: list[FieldError] | None = None,
        retryable: bool = False,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail
        self.status = status or STATUS.get(code, (409, ""))[0]
        self.errors = errors or []
        self.retryable = retryable
        self.headers = headers or {}

    def problem(self, instance: str) -> Problem:
        title = STATUS.get(self.code, (self.status, self.code.replace("_", " ").capitalize()))[1]
        return Problem(
            type=TYPE_BASE + self.code,
            title=title,
            status=self.status,
            code=self.code,
            detail=self.detail,
            instance=instance,
            errors=self.errors,
            retryable=self.retryable,
        )


def field_of(err: msgspec.ValidationError) -> str:
    """The JSON path msgspec names: `... - at `$.argv[0]``, plus the field a
    missing/unknown-field error is about."""
    text, path = str(err), "$"
    marker = " - at `"
    if marker in text:
        text, path = text.rsplit(marker, 1)
        path = path.rstrip("`")
        # A bad key of an object: "... - at `key` in `$.secrets`" names the object.
        path = path.removeprefix("key` in `")
    for start in ("Object missing required field `", "Object contains unknown field `"):
        if text.startswith(start):
            return f"{path}.{text.split('`')[1]}"
    return path
