"""The tasks pages: a table by state."""

from __future__ import annotations

from litestar import Request, Response, get
from sandhold.domain.task_views import task_view
from sandhold.gateway.console.html import choices, error, esc, page, state_and_reason, table, when
from sandhold.gateway.console.kit import Console
from sandhold.gateway.routes_tasks import TASK_STATES, task_decoder
from sandhold.gateway.web import fresh

LIST_LIMIT = 500


def handlers(console: Console) -> list:
    ctx = console.ctx

    @get("/tasks", include_in_schema=False)
    async def tasks_page(request: Request) -> Response:
        session = console.signed_in(request)
        if isinstance(session, Response):
            return session
        state = request.query_params.get("state") or None
        filter_ = choices("/tasks", "state", "all", sorted(TASK_STATES), state)
        if state is not None and state not in TASK_STATES:
            return page("Tasks", error(f"No task state “{state}”.") + filter_, session, status=400)
        await fresh(ctx)
        sql = "SELECT body FROM tasks WHERE tenant = ?"
        params: list = [session.tenant]
        if state is not None:
            sql += " AND state = ?"
            params.append(state)
        sql += " ORDER BY submitted_at DESC, id LIMIT ?"
        params.append(LIST_LIMIT)
        rows = await ctx.read_model.query(sql, tuple(params))
        decoder = task_decoder()
        views = [task_view(decoder.decode(r[0])) for r in rows]
        return page("Tasks", filter_ + _task_table(views), session)

    return [tasks_page]


def _task_table(views: list) -> str:
    rows = [
        [
            f'<a href="/tasks/{esc(v.id)}">{esc(v.id)}</a>',
            esc(v.name),
            state_and_reason(v.state, v.reason),
            esc(v.sandbox_id or "—"),
            when(v.submitted_at),
            esc(v.hang_warnings),
        ]
        for v in views
    ]
    head = ["Task", "Name", "State", "Sandbox", "Submitted", "Hang warnings"]
    return table(head, rows, "No tasks.", wide=frozenset({3, 5}))
