"""Signed session cookies for the console's users.

Signing in with a token sets `sandhold_session`: HttpOnly, SameSite=Strict,
signed with the gateway's console key (`console.key` beside the tokens file,
made on first start), carrying the token's SHA-256 digest (never the token),
an expiry and a nonce. It holds across gateway restarts; each request looks
the digest up in the tokens file again, so a revoked token's session ends at
its next request. Every form carries a CSRF token derived from the session's
nonce.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
import time
from dataclasses import dataclass

import msgspec
from sandhold.gateway.tokens import Tokens, digest

SESSION_COOKIE = "sandhold_session"
SIGN_IN_COOKIE = "sandhold_sign_in"  # the sign-in form's CSRF value, before any session
SESSION_S = 12 * 3600.0
KEY_FILE = "console.key"


class _Payload(msgspec.Struct, forbid_unknown_fields=True):
    d: str  # the token's SHA-256
    e: float  # expiry, unix seconds
    n: str  # nonce: the session's CSRF tokens derive from it


_payload = msgspec.json.Decoder(_Payload)
_encode = msgspec.json.Encoder().encode


@dataclass(frozen=True)
class Session:
    tenant: str
    csrf: str


class Sessions:
    """Signed session cookies for the console's users."""

    def __init__(self, tokens: Tokens, key: bytes) -> None:
        if len(key) < 32:
            raise ValueError("a console key has at least 32 bytes")
        self._tokens = tokens
        self._key = key

    @classmethod
    def beside(cls, tokens: Tokens) -> Sessions:
        """With the key kept next to the tokens file (made on first use, 0600)."""
        path = tokens.path.with_name(KEY_FILE)
        try:
            key = path.read_bytes()
        except FileNotFoundError:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{KEY_FILE}.{os.getpid()}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(32))
            try:
                os.link(tmp, path)  # the first of two starting gateways wins
            except FileExistsError:
                pass
            finally:
                tmp.unlink()
            key = path.read_bytes()
        return cls(tokens, key)

    def _sign(self, body: bytes) -> str:
        return hmac.new(self._key, body, hashlib.sha256).hexdigest()

    def issue(self, token: str, *, now: float | None = None) -> str | None:
        """A session cookie's value for `token`, or None if the token is unknown."""
        wanted = digest(token)
        if self._tokens.tenant_of_digest(wanted) is None:
            return None
        expires = (time.time() if now is None else now) + SESSION_S
        body = _encode(_Payload(d=wanted, e=expires, n=secrets.token_hex(16)))
        # No padding: a cookie value with "=" in it would be sent quoted.
        return f"{base64.urlsafe_b64encode(body).decode().rstrip('=')}.{self._sign(body)}"

    def open(self, value: str | None, *, now: float | None = None) -> Session | None:
        """The session a cookie value stands for, if it is intact, current and
        its token is not revoked."""
        if not value or len(value) > 1000:
            return None
        encoded, _, signature = value.partition(".")
        try:
            body = base64.urlsafe_b64decode(encoded.encode() + b"=" * (-len(encoded) % 4))
        except ValueError:
            return None
        if not hmac.compare_digest(self._sign(body).encode(), signature.encode()):
            return None
        try:
            payload = _payload.decode(body)
        except msgspec.DecodeError:
            return None
        if payload.e < (time.time() if now is None else now):
            return None
        tenant = self._tokens.tenant_of_digest(payload.d)
        if tenant is None:
            return None
        return Session(tenant=tenant, csrf=self._sign(b"csrf:" + payload.n.encode()))
