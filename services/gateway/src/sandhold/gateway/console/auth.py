"""Signing in and out, the home page, and the console's two assets."""

from __future__ import annotations

import secrets

from litestar import Request, Response, get, post
from sandhold.gateway.console.assets import SCRIPT, STYLE
from sandhold.gateway.console.html import asset, cookie, esc, page, redirect
from sandhold.gateway.console.kit import Console, forbidden, same, same_origin
from sandhold.gateway.console.sessions import SESSION_COOKIE, SESSION_S, SIGN_IN_COOKIE

MAX_TOKEN = 200  # longer than any token `sandhold token create` makes


def _sign_in_form(csrf: str, error: str = "") -> str:
    problem = f'<p class="error" role="alert">{esc(error)}</p>' if error else ""
    return (
        f"{problem}"
        '<form method="post" action="/sign-in">'
        f'<input type="hidden" name="csrf" value="{esc(csrf)}">'
        '<p><label for="token">HTTP token</label><br>'
        f'<input id="token" name="token" type="password" autocomplete="off" required '
        f'maxlength="{MAX_TOKEN}" size="50" autofocus></p>'
        '<p><button type="submit">Sign in</button></p></form>'
        '<p class="muted">A token comes from <code>sandhold token create &lt;tenant&gt;</code>;'
        " the console shows that tenant's sandboxes and nothing else.</p>"
    )


def handlers(console: Console) -> list:
    @get("/console.css", include_in_schema=False)
    async def stylesheet() -> Response:
        return asset(STYLE, "text/css")

    @get("/console.js", include_in_schema=False)
    async def script() -> Response:
        return asset(SCRIPT, "text/javascript")

    @get("/", include_in_schema=False)
    async def home(request: Request) -> Response:
        return redirect("/sandboxes" if console.session_of(request) else "/sign-in")

    @get("/sign-in", include_in_schema=False)
    async def sign_in_page(request: Request) -> Response:
        csrf = secrets.token_hex(16)
        return page(
            "Sign in",
            _sign_in_form(csrf),
            cookies=[cookie(SIGN_IN_COOKIE, csrf, 3600)],
        )

    @post("/sign-in", include_in_schema=False)
    async def sign_in(request: Request) -> Response:
        form = await console.form_of(request)
        expected = request.cookies.get(SIGN_IN_COOKIE, "")
        if not expected or not same_origin(request) or not same(form.get("csrf", ""), expected):
            return forbidden(None)
        token = form.get("token", "").strip()
        value = None
        if not token:
            error = "Enter a token."
        elif len(token) > MAX_TOKEN or not token.isprintable():
            error = f"That is not a token: at most {MAX_TOKEN} printable characters."
        else:
            value = console.sessions.issue(token)
            error = "No such token (or it was revoked)."
        if value is None:
            return page("Sign in", _sign_in_form(expected, error), status=401)
        return redirect(
            "/sandboxes",
            cookies=[
                cookie(SESSION_COOKIE, value, int(SESSION_S)),
                cookie(SIGN_IN_COOKIE, "", 0),
            ],
        )

    @post("/sign-out", include_in_schema=False)
    async def sign_out(request: Request) -> Response:
        if console.session_of(request) is None:
            return redirect("/sign-in", cookies=[cookie(SESSION_COOKIE, "", 0)])
        posted = await console.posted(request)
        if isinstance(posted, Response):
            return posted
        return redirect("/sign-in", cookies=[cookie(SESSION_COOKIE, "", 0)])

    return [stylesheet, script, home, sign_in_page, sign_in, sign_out]
