"""Request keys a compacted sandbox no longer holds, kept as Bloom filters.

A sandbox remembers every idempotency key it was sent, so a retry is known as
one however late it comes. Held as strings (~100 B each) that is memory growing
with every command a live sandbox ever ran, in every service that compacts
(decision 085). `sandbox.compact` keeps the newest keys exactly and folds older
ones, `BLOCK` at a time in the order they came, into one filter each: 2.5 B a
key. A filter never says "no" of a key it holds; it says "maybe" of a key it
does not hold about once in 15,000 (20 bits a key, 14 hashes: 0.007%). So
"not kept and not in any filter" is a new key for certain, and "maybe" is
decided on the whole state read back from the log, as `compact`'s other drops
are (decision 057): exact, and rare.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

BLOCK = 1024  # keys per filter
BITS_PER_KEY = 20
HASHES = 14
_BITS = BLOCK * BITS_PER_KEY


def _positions(key: str) -> list[int]:
    """The key's bits: double hashing from one 128-bit digest (Kirsch and
    Mitzenmacher: as good as independent hashes for a Bloom filter)."""
    digest = hashlib.blake2b(key.encode(), digest_size=16).digest()
    first = int.from_bytes(digest[:8], "little")
    step = int.from_bytes(digest[8:], "little") | 1
    return [(first + i * step) % _BITS for i in range(HASHES)]


def block_of(keys: Iterable[str]) -> bytes:
    """One filter holding `keys` (`BLOCK` of them; fewer only in tests)."""
    bits = bytearray(_BITS // 8)
    for key in keys:
        for p in _positions(key):
            bits[p >> 3] |= 1 << (p & 7)
    return bytes(bits)


def may_hold(blocks: tuple[bytes, ...], key: str) -> bool:
    """False: no block holds `key`, for certain. True: one may."""
    if not blocks:
        return False
    positions = _positions(key)
    return any(all(b[p >> 3] >> (p & 7) & 1 for p in positions) for b in blocks)
