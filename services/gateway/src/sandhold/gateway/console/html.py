"""How the console's pages are written: plain HTML, escaped here, nothing loaded
from elsewhere (decision 049)."""

from __future__ import annotations

import html
import time
from typing import Any

from litestar import Response
from litestar.datastructures import Cookie
from sandhold.gateway.console.sessions import Session

SECURITY_HEADERS = {
    # Everything a page loads comes from the gateway; no page may be framed.
    "Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'; form-action 'self'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


def esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def when(ts: float | None) -> str:
    """A time: UTC in the page, shown in the viewer's zone by the script (UTC on hover)."""
    if not ts:
        return '<span class="muted">—</span>'
    utc = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts))
    iso = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))
    return f'<time datetime="{iso}" title="{utc}">{utc}</time>'


def page(
    title: str,
    body: str,
    session: Session | None = None,
    *,
    status: int = 200,
    cookies: list[Cookie] | None = None,
    script: bool = True,
) -> Response:
    nav = ""
    if session is not None:
        nav = (
            '<nav aria-label="sections"><a href="/sandboxes">Sandboxes</a> · '
            '<a href="/tasks">Tasks</a> · <a href="/hosts">Hosts</a></nav>'
            f'<span class="muted">tenant {esc(session.tenant)}</span>'
            '<form method="post" action="/sign-out">'
            f"{csrf_field(session)}"
            '<button type="submit">Sign out</button></form>'
        )
    tail = '<script src="/console.js" defer></script>' if script else ""
    document = (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{esc(title)} · sandhold</title>"
        '<link rel="stylesheet" href="/console.css"></head><body>'
        '<a class="skip" href="#main">Skip to the content</a>'
        f"<header><strong>sandhold</strong>{nav}</header>"
        f'<main id="main"><h1>{esc(title)}</h1>{body}</main>{tail}</body></html>'
    )
    return Response(
        content=document,
        status_code=status,
        media_type="text/html; charset=utf-8",
        headers=SECURITY_HEADERS,
        cookies=cookies or [],
    )


def fragment(body: str) -> Response:
    """A piece of a page, swapped in by the script."""
    return Response(content=body, media_type="text/html; charset=utf-8", headers=SECURITY_HEADERS)


def asset(content: str, media_type: str) -> Response:
    """The stylesheet or the script: served by the gateway itself, like everything a page loads."""
    return Response(
        content=content,
        media_type=f"{media_type}; charset=utf-8",
        headers={"Cache-Control": "max-age=300", "X-Content-Type-Options": "nosniff"},
    )


def redirect(location: str, cookies: list[Cookie] | None = None) -> Response:
    return Response(
        content=b"",
        status_code=303,
        headers={"Location": location, **SECURITY_HEADERS},
        cookies=cookies or [],
    )


def cookie(name: str, value: str, max_age: int) -> Cookie:
    # Secure is left to a TLS proxy in front: the gateway itself speaks plain HTTP
    # on loopback, where a Secure cookie would never be sent back.
    return Cookie(
        key=name,
        value=value,
        max_age=max_age,
        path="/",
        httponly=True,
        samesite="strict",
    )


def csrf_field(session: Session) -> str:
    return f'<input type="hidden" name="csrf" value="{esc(session.csrf)}">'


def error(message: str) -> str:
    return f'<p class="error" role="alert">{esc(message)}</p>'


def choices(action: str, name: str, blank: str, values: list[str], chosen: str | None) -> str:
    """A filter: a GET form with one select."""
    options = "".join(
        f'<option value="{esc(v)}"{" selected" if v == chosen else ""}>{esc(v)}</option>'
        for v in values
    )
    return (
        f'<form method="get" action="{esc(action)}"><label for="{esc(name)}">'
        f"{esc(name.capitalize())}</label> "
        f'<select id="{esc(name)}" name="{esc(name)}"><option value="">{esc(blank)}</option>'
        f'{options}</select> <button type="submit">Show</button></form>'
    )


def table(
    head: list[str], rows: list[list[str]], empty: str, wide: frozenset[int] = frozenset()
) -> str:
    """Cells are HTML already; columns in `wide` are hidden on a narrow screen."""
    if not rows:
        return f'<p class="muted">{esc(empty)}</p>'

    def cls(i: int) -> str:
        return ' class="wide"' if i in wide else ""

    th = "".join(f"<th scope=col{cls(i)}>{esc(h)}</th>" for i, h in enumerate(head))
    body = "".join(
        "<tr>" + "".join(f"<td{cls(i)}>{cell}</td>" for i, cell in enumerate(row)) + "</tr>"
        for row in rows
    )
    return f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"


def facts(pairs: list[tuple[str, str]]) -> str:
    """A definition list; values are HTML already."""
    items = "".join(f"<dt>{esc(name)}</dt><dd>{value}</dd>" for name, value in pairs)
    return f"<dl>{items}</dl>"


def state_and_reason(state: str, reason: str = "") -> str:
    return esc(state) + (f" — {esc(reason)}" if reason else "")
