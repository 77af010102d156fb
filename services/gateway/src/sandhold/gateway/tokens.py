"""Bearer tokens mapped to tenants, kept hashed in one JSON file.

The file holds only SHA-256 digests of the tokens, so a token is shown once,
when it is made, and reading the file never reveals one. The gateway re-reads
the file when it changes: a token made or revoked with `sandhold token` takes
effect without a restart.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import time
from pathlib import Path

import msgspec
from sandhold.domain.requests import Tenant

TOKEN_PREFIX = "sht_"


class TokenEntry(msgspec.Struct, kw_only=True):
    name: str
    tenant: Tenant
    sha256: str
    created_at: float


class TokenFile(msgspec.Struct, kw_only=True):
    tokens: list[TokenEntry] = []


_decoder = msgspec.json.Decoder(TokenFile)
_encoder = msgspec.json.Encoder()


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def read(path: Path) -> TokenFile:
    try:
        return _decoder.decode(path.read_bytes())
    except FileNotFoundError:
        return TokenFile()


def _write(path: Path, body: TokenFile) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(msgspec.json.format(_encoder.encode(body), indent=2) + b"\n")
    os.replace(tmp, path)


def create(path: Path, tenant: str, name: str | None = None) -> tuple[TokenEntry, str]:
    """Make a token for `tenant`; returns its entry and the token (the only time
    it is seen). Raises ValueError for a bad tenant or a name already used."""
    try:
        msgspec.convert({"tenant": tenant}, _TenantOnly)
    except msgspec.ValidationError as err:
        raise ValueError(f"tenant {tenant!r}: 1-64 of A-Z a-z 0-9 _ . -") from err
    body = read(path)
    name = name or f"{tenant}-{secrets.token_hex(3)}"
    if any(t.name == name for t in body.tokens):
        raise ValueError(f"a token named {name!r} exists already")
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    entry = TokenEntry(name=name, tenant=tenant, sha256=digest(token), created_at=time.time())
    body.tokens.append(entry)
    _write(path, body)
    return entry, token


def revoke(path: Path, name: str) -> bool:
    body = read(path)
    kept = [t for t in body.tokens if t.name != name]
    if len(kept) == len(body.tokens):
        return False
    _write(path, TokenFile(tokens=kept))
    return True


class _TenantOnly(msgspec.Struct):
    tenant: Tenant


class Tokens:
    """Looks a bearer token up: its tenant, or None. Re-reads the file on change."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stamp: tuple[int, int, int] | None = None
        self._by_digest: dict[str, str] = {}

    def _reload(self) -> None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            self._stamp, self._by_digest = None, {}
            return
        # Every write replaces the file (a new inode), so a revoke and a create of
        # the same size within one timestamp tick still count as a change.
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        if stamp == self._stamp:
            return
        with contextlib.suppress(msgspec.DecodeError, OSError):
            body = read(self.path)
            self._by_digest = {t.sha256: t.tenant for t in body.tokens}
            self._stamp = stamp

    def tenant_of(self, token: str) -> str | None:
        return self.tenant_of_digest(digest(token))

    def tenant_of_digest(self, wanted: str) -> str | None:
        """The tenant of the token with this digest while it is not revoked (a
        console session keeps the digest, never the token)."""
        self._reload()
        found = None
        # Compare every digest in constant time (no early exit that leaks which one).
        for known, tenant in self._by_digest.items():
            if hmac.compare_digest(known, wanted):
                found = tenant
        return found
