"""Request keys a compacted sandbox no longer holds, kept as 64-bit fingerprints.

A sandbox remembers every idempotency key it was sent, so a retry is known as
one however late it comes. Held as strings (~100 B each) that is memory growing
with every command a live sandbox ever ran, in every service that compacts
(decision 085). `sandbox.compact` keeps the newest keys exactly and moves older
ones, `BLOCK` at a time in the order they came, into sorted runs of 8-byte
fingerprints: 8 B a key. Runs are merged as a binary counter (two of one size
make one of twice the size), so a sandbox with n forgotten keys has at most
log2(n / BLOCK) + 1 runs, each searched by bisection.

A fingerprint not found: a new key, for certain. Found: a key sent before,
except with a chance of n / 2^64 (one in ~10^13 with a million keys): a
decision still takes it to the whole state read back from the log, which is
exact; a caller that only waits on a key it sent may take it as sent.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from bisect import bisect_left
from collections.abc import Iterable

BLOCK = 1024  # keys moved at a time: the smallest run

# Runs are the machine's uint64 arrays as bytes; checkpoints move between machines
# of one byte order only (every platform sandhold runs on is little-endian).
if sys.byteorder != "little":
    raise ImportError("fingerprint runs are stored little-endian; this machine is not")


def fingerprint(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


def with_block(runs: tuple[bytes, ...], keys: Iterable[str]) -> tuple[bytes, ...]:
    """`runs` with one more block of keys: a run of its own, then merged with the
    last run while that is no larger. The result depends only on the blocks
    added and their order, so compacting after every event or once after many
    gives the same runs."""
    run = sorted(fingerprint(key) for key in keys)
    kept = list(runs)
    while kept and len(kept[-1]) <= len(run) * 8:
        # (Two sorted runs one after the other: Timsort merges them in one pass.)
        run = sorted([*array("Q", kept.pop()), *run])
    return (*kept, array("Q", run).tobytes())


def may_hold(runs: tuple[bytes, ...], key: str) -> bool:
    """False: the key was never moved here, for certain. True: it was (see above)."""
    if not runs:
        return False
    wanted = fingerprint(key)
    for run in runs:
        values = memoryview(run).cast("Q")
        at = bisect_left(values, wanted)
        if at < len(values) and values[at] == wanted:
            return True
    return False


def count(runs: tuple[bytes, ...]) -> int:
    """How many keys the runs hold."""
    return sum(len(run) for run in runs) // 8
