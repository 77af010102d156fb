"""What every console page needs: the gateway's context and the visitor's session."""

from __future__ import annotations

import hmac

from litestar import Request, Response
from sandhold.gateway.console.html import page, redirect
from sandhold.gateway.console.sessions import SESSION_COOKIE, Session, Sessions
from sandhold.gateway.web import Context


class Console:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self._sessions: Sessions | None = None  # on first use: building the app reads no file

    @property
    def sessions(self) -> Sessions:
        if self._sessions is None:
            self._sessions = Sessions.beside(self.ctx.tokens)
        return self._sessions

    def session_of(self, request: Request) -> Session | None:
        return self.sessions.open(request.cookies.get(SESSION_COOKIE))

    def signed_in(self, request: Request) -> Session | Response:
        """The visitor's session, or the way to the sign-in page."""
        session = self.session_of(request)
        return redirect("/sign-in") if session is None else session

    @staticmethod
    async def form_of(request: Request) -> dict[str, str]:
        form = await request.form()
        return {k: v for k, v in form.items() if isinstance(v, str)}

    async def posted(self, request: Request) -> tuple[Session, dict[str, str]] | Response:
        """A form sent by a signed-in visitor from one of this console's pages:
        its session and fields; else the sign-in, or a refusal (nothing done)."""
        session = self.signed_in(request)
        if isinstance(session, Response):
            return session
        form = await self.form_of(request)
        if not hmac.compare_digest(form.get("csrf", ""), session.csrf):
            return forbidden(session)
        return session, form


def forbidden(session: Session | None) -> Response:
    body = (
        '<p class="error" role="alert">This form was not sent from a page of this'
        " console (its CSRF token is missing or wrong). Nothing was done.</p>"
        '<p><a href="/">Back</a></p>'
    )
    return page("Refused", body, session, status=403)
