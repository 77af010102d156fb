"""The web console: the gateway's pages for people (decision 049).

Served by the gateway itself, from the same read model and with the same
tokens and tenant rules as the API: a page shows what `GET /api/v1/...` would
show the token it was signed in with, and another tenant's sandbox is the same
404 as one that does not exist. Pages are rendered as plain HTML (no template
engine, no JavaScript build, nothing loaded from elsewhere); one small script
makes them live over SSE.
"""

from __future__ import annotations

from sandhold.gateway.console import actions, auth, commands, hosts, live, sandboxes, tasks
from sandhold.gateway.console.kit import Console
from sandhold.gateway.console.sessions import SESSION_COOKIE, SESSION_S, Session, Sessions
from sandhold.gateway.web import Context

__all__ = ["SESSION_COOKIE", "SESSION_S", "Session", "Sessions", "handlers"]


def handlers(ctx: Context) -> list:
    console = Console(ctx)
    return [
        *auth.handlers(console),
        *sandboxes.handlers(console),
        *commands.handlers(console),
        *actions.handlers(console),
        *tasks.handlers(console),
        *hosts.handlers(console),
        *live.handlers(console),
    ]
