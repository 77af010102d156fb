"""A command's page: its status and its output, streaming live; the commands
table of a sandbox's page."""

from __future__ import annotations

import shlex

import msgspec
from litestar import Request, Response, get
from litestar.params import FromPath
from litestar.response import Stream
from sandhold.domain.views import CommandView
from sandhold.gateway.console.html import (
    error,
    esc,
    facts,
    fragment,
    page,
    state_and_reason,
    table,
    when,
)
from sandhold.gateway.console.kit import Console
from sandhold.gateway.console.sessions import Session
from sandhold.gateway.problems import ProblemError
from sandhold.gateway.routes_sandboxes import output_response
from sandhold.gateway.web import COMMAND_ID, SANDBOX_ID, Context, call

LIST_LIMIT = 500
SHOWN_ARGV = 200  # characters of a command line in the table

_command_decoder = msgspec.json.Decoder(CommandView)


def handlers(console: Console) -> list:
    ctx = console.ctx

    async def signed_in_command(
        request: Request, sandbox_id: str, command_id: str
    ) -> tuple[Session, CommandView] | Response:
        session = console.signed_in(request)
        if isinstance(session, Response):
            return session
        try:
            if not (SANDBOX_ID.match(sandbox_id) and COMMAND_ID.match(command_id)):
                raise ProblemError("command_not_found", f"no command {command_id}")
            client = ctx.client(session.tenant)
            return session, await call(client.show_command(sandbox_id, command_id))
        except ProblemError as err:
            if err.code not in ("sandbox_not_found", "command_not_found"):
                raise
            return page("Not found", error(f"No command {command_id}."), session, status=404)

    @get("/sandboxes/{sandbox_id:str}/commands/{command_id:str}", include_in_schema=False)
    async def command_page(
        request: Request, sandbox_id: FromPath[str], command_id: FromPath[str]
    ) -> Response:
        found = await signed_in_command(request, sandbox_id, command_id)
        if isinstance(found, Response):
            return found
        session, command = found
        here = f"/sandboxes/{command.sandbox_id}/commands/{command.id}"
        body = (
            f'<p><a href="/sandboxes/{esc(command.sandbox_id)}">Sandbox '
            f"{esc(command.sandbox_id)}</a></p>"
            '<section aria-labelledby="status-h"><h2 id="status-h">Status</h2>'
            f'<div id="status" data-refresh="{here}/status">{_command_status(command)}</div>'
            "</section>"
            '<section aria-labelledby="output-h"><h2 id="output-h">Output</h2>'
            '<p id="output-live" class="muted" role="status">Loading the output…</p>'
            f'<pre id="output" data-output="{here}/output" tabindex="0" '
            'aria-label="the command\'s output; standard error is marked"></pre></section>'
        )
        return page(f"Command {command.id}", body, session)

    @get("/sandboxes/{sandbox_id:str}/commands/{command_id:str}/status", include_in_schema=False)
    async def command_status(
        request: Request, sandbox_id: FromPath[str], command_id: FromPath[str]
    ) -> Response:
        found = await signed_in_command(request, sandbox_id, command_id)
        if isinstance(found, Response):
            return found
        return fragment(_command_status(found[1]))

    @get("/sandboxes/{sandbox_id:str}/commands/{command_id:str}/output", include_in_schema=False)
    async def command_output(
        request: Request, sandbox_id: FromPath[str], command_id: FromPath[str]
    ) -> Stream | Response:
        """The output as the page's EventSource takes it (`output_response`)."""
        found = await signed_in_command(request, sandbox_id, command_id)
        if isinstance(found, Response):
            return found
        return output_response(ctx, request, sandbox_id, command_id, hold=console.hold(request))

    return [command_page, command_status, command_output]


async def commands_table(ctx: Context, sandbox_id: str) -> str:
    rows = await ctx.read_model.query(
        "SELECT view FROM commands WHERE sandbox_id = ? ORDER BY queued_at DESC, id LIMIT ?",
        (sandbox_id, LIST_LIMIT),
    )
    return command_rows([_command_decoder.decode(r[0]) for r in rows])


def _ended_how(c: CommandView) -> str:
    if c.exit_code is not None:
        how = f"exit code {c.exit_code}"
    elif c.signal is not None:
        how = f"signal {c.signal}"
    else:
        how = ""
    return state_and_reason(c.state, ", ".join(x for x in (how, c.reason) if x))


def command_rows(commands: list[CommandView]) -> str:
    rows = [
        [
            f'<a href="/sandboxes/{esc(c.sandbox_id)}/commands/{esc(c.id)}">{esc(c.id)}</a>',
            f"<code>{esc(shlex.join(c.argv)[:SHOWN_ARGV])}</code>",
            _ended_how(c),
            when(c.queued_at),
            when(c.ended_at),
        ]
        for c in commands
    ]
    head = ["Command", "Argv", "State", "Queued", "Ended"]
    return table(head, rows, "No commands yet.", wide=frozenset({3, 4}))


def _command_status(c: CommandView) -> str:
    kept = ", ".join(f"{esc(k)} {n} bytes" for k, n in sorted(c.output_kept.items()))
    return facts(
        [
            ("Argv", f"<code>{esc(shlex.join(c.argv))}</code>"),
            ("State", _ended_how(c)),
            ("Host", esc(c.host or "—")),
            ("Queued", when(c.queued_at)),
            ("Ended", when(c.ended_at)),
            ("Output kept", (kept or "none") + ("" if c.output_complete else " (incomplete)")),
        ]
    )
