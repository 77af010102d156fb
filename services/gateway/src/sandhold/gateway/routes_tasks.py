"""Tasks: submit a manifest (YAML or JSON), list, show, cancel, follow events."""

from __future__ import annotations

import asyncio
from typing import Any, get_args

import msgspec
import yaml
from litestar import Request, Response, get, post
from litestar.params import FromPath
from litestar.response import Stream
from sandhold.domain import task as tk
from sandhold.domain.requests import Secrets
from sandhold.domain.task_manifest import TaskManifest
from sandhold.domain.task_views import TaskView, task_view
from sandhold.gateway import bodies as b
from sandhold.gateway.problems import FieldError, ProblemError
from sandhold.gateway.routes_sandboxes import (
    event_response,
    last_event_id,
    owned,
    page,
    page_wait,
)
from sandhold.gateway.web import (
    MAX_LIMIT,
    TASK_ID,
    Context,
    call,
    check_id,
    decode_cursor,
    fresh,
    idempotency_key,
    json_response,
    query_choice,
    query_int,
    tenant_of,
)

YAML_TYPES = frozenset({"application/yaml", "application/x-yaml", "text/yaml", "text/x-yaml"})
TASK_STATES = frozenset(get_args(tk.TaskState))


class TaskPage(b.Page, kw_only=True):
    items: list[TaskView]


class _NoAliases(yaml.SafeLoader):
    """YAML without anchors' aliases: a manifest needs none, and refusing them
    rules out the exponential "billion laughs" expansion."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(
                None, None, "aliases (*name) are not accepted in a manifest", event.start_mark
            )
        return super().compose_node(parent, index)


def parse_body(data: bytes, content_type: str) -> tuple[TaskManifest, dict[str, str]]:
    """A manifest from a YAML or JSON body, and the values of its secrets: 400 if
    it does not parse, 422 naming the field if it does not match the schema.

    Over HTTP the body is the manifest, so a task's secrets come in it:
    `secrets` as an object (name -> value) names them and gives their values;
    the manifest recorded names them only (a list), as `task submit --secret`."""
    media = content_type.split(";")[0].strip().lower()
    if media in YAML_TYPES:
        try:
            parsed = yaml.load(data, Loader=_NoAliases)  # noqa: S506 - a SafeLoader
        except yaml.YAMLError as err:
            raise ProblemError("malformed_body", f"the body is not valid YAML: {err}") from err
    elif not media or media == "application/json" or media.endswith("+json"):
        try:
            parsed = msgspec.json.decode(data)
        except msgspec.DecodeError as err:
            raise ProblemError("malformed_body", f"the body is not valid JSON: {err}") from err
    else:
        raise ProblemError(
            "unsupported_media_type",
            f"send the manifest as application/yaml or application/json, not {media}",
        )
    values: dict[str, str] = {}
    if isinstance(parsed, dict) and isinstance(parsed.get("secrets"), dict):
        values = b.convert(parsed["secrets"], Secrets)
        parsed = {**parsed, "secrets": sorted(values)}
    return b.convert(parsed, TaskManifest), values


def handlers(ctx: Context) -> list:
    def tid(value: str) -> str:
        return check_id(value, TASK_ID, "task_not_found", "task")

    @post("/api/v1/tasks")
    async def submit_task(request: Request) -> Response:
        tenant = tenant_of(ctx, request)
        key = idempotency_key(request)
        # Off the event loop: a 1 MB manifest is seconds of pure-Python YAML, and
        # every other request and event stream of this gateway would wait for it.
        manifest, secrets = await asyncio.to_thread(
            parse_body, await request.body(), request.headers.get("content-type", "")
        )
        try:
            submit = tk.SubmitTask(key=key, tenant=tenant, manifest=manifest, secrets=secrets)
        except ValueError as err:  # names without values (a list): nothing to give them
            raise ProblemError(
                "invalid_request",
                f"{err}: over HTTP give `secrets` as an object, name to value (their "
                "values are never recorded), or submit with `sandhold task submit "
                "--secret NAME=VALUE` (docs/tasks.md)",
                errors=[FieldError(field="$.secrets", message=str(err))],
            ) from err
        view = await call(ctx.client(tenant).send_task(submit))
        return json_response(view, 202, headers={"Location": f"/api/v1/tasks/{view.id}"})

    @get("/api/v1/tasks")
    async def list_tasks(request: Request) -> Response:
        tenant = tenant_of(ctx, request)
        state = query_choice(request, "state", TASK_STATES)
        limit = query_int(request, "limit", 100, 1, MAX_LIMIT)
        after = decode_cursor(request)
        await fresh(ctx)
        sql = "SELECT body, submitted_at, id FROM tasks WHERE tenant = ?"
        params: list = [tenant]
        if state is not None:
            sql += " AND state = ?"
            params.append(state)
        rows, next_cursor = await page(ctx, sql, params, after, limit, "submitted_at")
        decoder = task_decoder()
        return json_response(
            TaskPage(items=[task_view(decoder.decode(r[0])) for r in rows], next_cursor=next_cursor)
        )

    @get("/api/v1/tasks/{task_id:str}")
    async def show_task(request: Request, task_id: FromPath[str]) -> Response:
        client = ctx.client(tenant_of(ctx, request))
        return json_response(await call(client.show_task(tid(task_id))))

    @post("/api/v1/tasks/{task_id:str}/cancel", status_code=200)
    async def cancel_task(request: Request, task_id: FromPath[str]) -> Response:
        tenant = tenant_of(ctx, request)
        key = idempotency_key(request)
        view = await call(
            ctx.client(tenant).send_task(
                tk.CancelTask(key=key, tenant=tenant, task_id=tid(task_id))
            )
        )
        return json_response(view)

    @get("/api/v1/tasks/{task_id:str}/events")
    async def task_events(request: Request, task_id: FromPath[str]) -> Stream | Response:
        tenant = tenant_of(ctx, request)
        after, wait_s = last_event_id(request), page_wait(request)
        await owned(ctx, tenant, "task", tid(task_id))
        subject = ctx.names.events("task", task_id)
        return await event_response(ctx, request, subject, after, wait_s)

    return [submit_task, list_tasks, show_task, cancel_task, task_events]


def task_decoder() -> msgspec.json.Decoder:
    from sandhold.gateway.readmodel import KINDS

    return KINDS["task"].decoder
