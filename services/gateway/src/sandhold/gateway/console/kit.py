"""What every console page needs: the gateway's context and the visitor's session."""

from __future__ import annotations

import hmac
import time
from collections.abc import AsyncIterator

from litestar import Request, Response
from sandhold.gateway.console.html import page, redirect
from sandhold.gateway.console.sessions import SESSION_COOKIE, Session, Sessions
from sandhold.gateway.web import Context

RECHECK_S = 5.0  # how often an open stream looks at its session again


def same(given: str, expected: str) -> bool:
    """A constant-time comparison that takes any text (compare_digest refuses
    str with non-ASCII characters with a TypeError: a 500 for a form's `é`)."""
    return hmac.compare_digest(given.encode(), expected.encode())


def same_origin(request: Request) -> bool:
    """No `Origin`, or this gateway's. A browser sends it with every POST; a page
    on another port of the same host is the same site for cookies (SameSite does
    not see ports) but not the same origin, so its forms stop here."""
    origin = request.headers.get("origin")
    if origin is None:
        return True
    return origin == f"{request.url.scheme}://{request.headers.get('host', '')}"


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
        if not same_origin(request) or not same(form.get("csrf", ""), session.csrf):
            return forbidden(session)
        return session, form

    async def while_signed_in(
        self, request: Request, frames: AsyncIterator[bytes]
    ) -> AsyncIterator[bytes]:
        """A stream's frames for as long as its session holds: a revoked token or
        an expired session ends it at a frame after the next check (keep-alives
        come every few seconds, so within about that long)."""
        checked = time.monotonic()
        try:
            async for frame in frames:
                if time.monotonic() - checked >= RECHECK_S:
                    if self.session_of(request) is None:
                        return
                    checked = time.monotonic()
                yield frame
        finally:
            await frames.aclose()  # type: ignore[attr-defined]

    def hold(self, request: Request):
        """`while_signed_in` for this request, as the API's stream helpers take it."""
        return lambda frames: self.while_signed_in(request, frames)


def forbidden(session: Session | None) -> Response:
    body = (
        '<p class="error" role="alert">This form was not sent from a page of this'
        " console (its CSRF token is missing or wrong). Nothing was done.</p>"
        '<p><a href="/">Back</a></p>'
    )
    return page("Refused", body, session, status=403)
