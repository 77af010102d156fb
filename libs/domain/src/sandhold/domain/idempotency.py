"""Idempotency keys: a request seen before is answered as before, a key reused
for a different request is refused (decision 001)."""

from __future__ import annotations

from collections.abc import Mapping

from sandhold.domain.errors import Rejected


def seen_before(requests: Mapping[str, str], key: str, digest: str) -> bool:
    """True when this exact request (`key` with this body `digest`) was already
    applied to the aggregate; raises `idempotency_conflict` on a reused key."""
    seen = requests.get(key)
    if seen is None:
        return False
    if seen != digest:
        raise Rejected(
            "idempotency_conflict",
            f"idempotency key {key!r} was already used for a different request; "
            "use a new key for new work",
        )
    return True
