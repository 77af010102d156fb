"""NATS credentials: one user per service, host, operator, tenant and admin.

Each is a small JSON file (`{"user", "password", "role", "host", "tenant"}`, mode 0600)
in a credentials directory (`<data dir>/credentials` for `sandhold up`). The
nats-server configuration is rendered from the same directory
(`permissions.authorization`), so a credential exists exactly when its user
does: issuing one and reloading the server adds the user, deleting the file
and reloading removes it.

A process finds its own credential in `--credentials FILE` or
`SANDHOLD_NATS_CREDENTIALS`, or as `user:password@` in the NATS URL.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit

import msgspec

ENV = "SANDHOLD_NATS_CREDENTIALS"

# One subject token (the user name is also the inbox prefix's second token);
# a tenant's user is `tenant-<tenant>` (its `.` written `~`, as in subjects).
_USER = re.compile(r"^([a-z][a-z0-9_-]{0,62}|tenant-[A-Za-z0-9_~-]{1,64})$")
# The domain's tenant names (sandhold.domain.requests.Tenant).
_TENANT = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class Credentials(msgspec.Struct, frozen=True, kw_only=True):
    user: str
    password: str
    role: str
    host: str | None = None  # a host-agent's host id
    tenant: str | None = None  # a tenant's name, for role `tenant`


def user_for(role: str, host: str | None = None, tenant: str | None = None) -> str:
    """The user name of a role (`host-<id>` for a host-agent, `tenant-<name>` for a tenant)."""
    if role == "tenant":
        return f"tenant-{str(tenant).replace('.', '~')}"
    return f"host-{host}" if role == "host-agent" else role


def issue(
    directory: Path, role: str, *, host: str | None = None, tenant: str | None = None
) -> Credentials:
    """The credential of `role` in `directory`, made (0600) if it does not exist yet."""
    if (role == "tenant") != (tenant is not None):
        raise ValueError("a tenant's credential names its tenant, and only a tenant's does")
    if tenant is not None and not _TENANT.match(tenant):
        raise ValueError(f"tenant {tenant!r}: 1-64 of A-Z a-z 0-9 _ . -")
    user = user_for(role, host, tenant)
    if not _USER.match(user):
        raise ValueError(f"user {user!r}: 1-63 of a-z 0-9 _ -, starting with a letter")
    path = path_of(directory, user)
    if path.exists():
        return load(path)
    made = Credentials(user=user, password=_password(), role=role, host=host, tenant=tenant)
    _write_private(path, msgspec.json.encode(made))
    return made


def path_of(directory: Path, user: str) -> Path:
    return Path(directory) / f"{user}.json"


def load(path: Path) -> Credentials:
    try:
        return msgspec.json.decode(Path(path).read_bytes(), type=Credentials)
    except FileNotFoundError:
        raise FileNotFoundError(f"no NATS credentials at {path}") from None
    except msgspec.DecodeError as err:
        raise ValueError(f"{path} is not a sandhold NATS credential: {err}") from None


def every(directory: Path) -> list[Credentials]:
    """Every credential in `directory`, by user name."""
    if not Path(directory).is_dir():
        return []
    return [load(p) for p in sorted(Path(directory).glob("*.json"))]


def from_environment() -> Credentials | None:
    path = os.environ.get(ENV)
    return load(Path(path)) if path else None


def in_url(url: str, credentials: Credentials) -> str:
    """`url` with the credential in it (`nats://user:password@host:port`); each
    of several comma-separated URLs (a cluster's nodes)."""
    if "," in url:
        return ",".join(in_url(one, credentials) for one in url.split(","))
    parts = urlsplit(url)
    netloc = parts.netloc.rsplit("@", 1)[-1]
    secret = f"{quote(credentials.user, safe='')}:{quote(credentials.password, safe='')}"
    return parts._replace(netloc=f"{secret}@{netloc}").geturl()


def user_in_url(url: str) -> str | None:
    username = urlsplit(url).username
    return unquote(username) if username else None


def password_in_url(url: str) -> str | None:
    password = urlsplit(url).password
    return unquote(password) if password else None


def copy_private(source: Path, dest: Path) -> None:
    """A copy of a credential that only its owner can read."""
    _write_private(Path(dest), Path(source).read_bytes())


def _write_private(path: Path, data: bytes) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _password() -> str:
    import secrets  # (here: a client that only loads a credential spares its import)

    return secrets.token_urlsafe(32)
