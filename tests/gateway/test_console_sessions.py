"""Console sessions without a server: what a cookie proves, for how long, and
the key they are signed with (kept beside the tokens file, private)."""

from __future__ import annotations

import stat
import time
from pathlib import Path

from sandhold.gateway import tokens
from sandhold.gateway.console import SESSION_S, Sessions


def test_a_session_opens_until_it_expires_and_only_with_its_own_key(tmp_path: Path) -> None:
    path = tmp_path / "tokens.json"
    _, token = tokens.create(path, "acme")
    sessions = Sessions.beside(tokens.Tokens(path))
    now = time.time()

    value = sessions.issue(token, now=now)
    assert value is not None and token not in value
    opened = sessions.open(value, now=now + 60)
    assert opened is not None and opened.tenant == "acme"
    assert sessions.open(value, now=now + SESSION_S + 1) is None  # expired
    other = Sessions(tokens.Tokens(path), b"k" * 32)  # another installation's key
    assert other.open(value, now=now) is None
    assert sessions.issue("sht_unknown") is None
    # Each session has its own CSRF token.
    again = sessions.open(sessions.issue(token, now=now), now=now)
    assert again is not None and again.csrf != opened.csrf


def test_the_key_is_made_once_private_and_kept(tmp_path: Path) -> None:
    path = tmp_path / "tokens.json"
    _, token = tokens.create(path, "acme")
    first = Sessions.beside(tokens.Tokens(path))
    key = tmp_path / "console.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    value = first.issue(token)
    # A restarted gateway reads the same key: the session still opens.
    assert Sessions.beside(tokens.Tokens(path)).open(value) is not None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["console.key", "tokens.json"]
