"""A duty one instance of a service does at a time: the instance holding its claim.

Where a service runs twice and a duty must not be done by both at once (the
saver's verification and garbage collection, which judge the save store
together; the scheduler's placement, which counts each host's sandboxes), the
instance doing it holds a claim: the key `<role>.claim.<duty>` in the instance
bucket (decision 036; the role's own keys, permissions.py), renewed by
compare-and-set on the revision it wrote last.

* Taking it: `create` (no one holds it), or, once the key's revision has stood
  still for `ttl + margin` seconds by this process's own clock, `update` on that
  revision (the holder stopped renewing: it died, is cut off, or is paused).
  Two taking it at once: the compare-and-set lets one.
* Holding it: the holder acts while its last renewal that succeeded was *sent*
  less than `ttl` ago. A renewal refused for its revision means someone took
  it over (this instance was thought gone): it stops at once.
* Giving it up on a graceful stop deletes the key (on its revision), so the twin
  takes it at its next look instead of waiting out the TTL.

The holder counts from sending, a contender from first seeing, so by the time a
contender takes over, the holder has stopped on its own clock; the margin
covers the rest (the look cadence, transit). What no lease can cover is a
process paused between its last check and an action: where the action is an
append, the log's fence refuses it; each duty says what else it does about it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
import uuid
from collections.abc import Callable

import msgspec
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

log = logging.getLogger(__name__)


class ClaimValue(msgspec.Struct, frozen=True, kw_only=True):
    holder: str  # the instance, e.g. "saver-2"
    pid: int
    nonce: str  # this very claimant (two in one process, a restart under one name)
    renewed_at: float  # the holder's wall clock, for people reading the bucket
    ttl_s: float


_decode = msgspec.json.Decoder(ClaimValue).decode
_encode = msgspec.json.Encoder().encode


def claim_key(role: str, duty: str) -> str:
    return f"{role}.claim.{duty}"


class Claim:
    """One instance's claim on one duty. `run()` keeps looking (renewing while
    held, taking it over once its holder stopped); `held()` says whether to act
    now; `on_change(held)` hears when that changes, a new term included (a hold
    that ran out between two looks and was renewed at the next one: False, then
    True); `release()` gives it up."""

    def __init__(
        self,
        kv: KeyValue,
        role: str,
        duty: str,
        holder: str,
        *,
        ttl: float = 10.0,
        margin: float | None = None,
        on_change: Callable[[bool], None] | None = None,
    ) -> None:
        if ttl <= 0:
            raise ValueError(f"a claim's ttl must be positive, not {ttl}")
        self._kv = kv
        self.key = claim_key(role, duty)
        self.holder = holder
        self.ttl = ttl
        self.margin = margin if margin is not None else max(0.5, ttl / 4)
        self.interval = min(1.0, ttl / 4)  # how often it looks (and renews)
        self._nonce = uuid.uuid4().hex
        self._on_change = on_change
        self._revision = 0  # the key's revision as this claimant last wrote it
        self._held_until = -math.inf  # monotonic
        self._acting = False  # what `on_change` was last told
        self._acting_term: int | None = None  # and of which term
        self._observed: tuple[int, float] | None = None  # (revision, monotonic first seen)
        self.seen_holder: str | None = None  # who holds it, as last read
        self.term = 0  # grows each time this claimant takes it (again)

    def held(self) -> bool:
        return time.monotonic() < self._held_until

    @property
    def held_until(self) -> float:
        """The monotonic time this claim is held until, as it stands."""
        return self._held_until

    async def run(self) -> None:
        """Look every `interval` seconds, for the service's lifetime."""
        while True:
            await self.look()
            await asyncio.sleep(self.interval)

    async def look(self) -> None:
        """Renew the claim if held, else take it if it is free or lapsed."""
        try:
            await self._look()
        except Exception as err:  # NATS away, a timeout: holding lapses by itself
            log.warning("claim %s (%s): %r", self.key, self.holder, err)
        self._notice()

    async def release(self) -> None:
        """Give the claim up (a graceful stop): act no more, then delete the key."""
        revision, self._revision = self._revision, 0
        was_held = self.held()
        self._held_until = -math.inf
        self._notice()
        if revision and was_held:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._kv.delete(self.key, last=revision), 2.0)
                log.info("%s gave up claim %s", self.holder, self.key)

    async def _look(self) -> None:
        sent = time.monotonic()
        had = self.held()
        left = self._held_until - sent
        timeout = left if left > 0.05 else self.ttl  # a put that hangs must not outlast the hold
        if self._revision:
            try:
                revision = await asyncio.wait_for(
                    self._kv.update(self.key, self._value(), last=self._revision), timeout
                )
            except KeyWrongLastSequenceError:
                # Written since by someone else (or by us, with an answer that was lost):
                # act no more, and read what is there before concluding.
                self._revision = 0
                self._held_until = -math.inf
            else:
                self._holding(revision, sent)
                return
        try:
            revision = await asyncio.wait_for(self._kv.create(self.key, self._value()), timeout)
        except KeyWrongLastSequenceError:
            pass
        else:
            self._holding(revision, sent)
            return
        try:
            entry = await asyncio.wait_for(self._kv.get(self.key), timeout)
        except KeyNotFoundError:
            self._lost(had, "its key was deleted")
            return  # given up meanwhile: `create` at the next look
        revision = entry.revision or 0
        try:
            current = _decode(entry.value or b"")
        except msgspec.DecodeError:
            current = None
        self.seen_holder = current.holder if current is not None else None
        if current is not None and current.nonce == self._nonce:
            self._holding(revision, sent)  # ours after all (an answer that was lost)
            return
        self._lost(had, f"now held by {self.seen_holder}")
        if self._observed is None or self._observed[0] != revision:
            self._observed = (revision, time.monotonic())  # renewed since the last look
            return
        still = time.monotonic() - self._observed[1]
        # The holder's own ttl when longer than ours: it acts until that runs out.
        held_for = max(self.ttl, current.ttl_s if current is not None else 0.0)
        if still < held_for + self.margin:
            return
        try:
            revision = await asyncio.wait_for(
                self._kv.update(self.key, self._value(), last=revision), timeout
            )
        except KeyWrongLastSequenceError:
            return  # someone was quicker (or the holder renewed at the last moment)
        log.warning(
            "%s took claim %s over from %s (not renewed for %.1fs)",
            self.holder,
            self.key,
            self.seen_holder,
            still,
        )
        self._holding(revision, sent)

    def _value(self) -> bytes:
        return _encode(
            ClaimValue(
                holder=self.holder,
                pid=os.getpid(),
                nonce=self._nonce,
                renewed_at=time.time(),
                ttl_s=self.ttl,
            )
        )

    def _holding(self, revision: int, sent: float) -> None:
        if not self.held():
            self.term += 1
            log.info("%s holds claim %s (term %d)", self.holder, self.key, self.term)
        self._revision = revision
        self._observed = None
        self.seen_holder = self.holder
        self._held_until = max(self._held_until, sent + self.ttl)

    def _lost(self, had: bool, why: str) -> None:
        if had:
            log.warning("%s lost claim %s: %s", self.holder, self.key, why)
        self._revision = 0
        self._held_until = -math.inf

    def _notice(self) -> None:
        held = self.held()
        term = self.term if held else None
        if (held, term) != (self._acting, self._acting_term):
            lapsed = held and self._acting  # held again, in a new term
            self._acting, self._acting_term = held, term
            if self._on_change is not None:
                if lapsed:
                    # The hold ran out between two looks and the next renewal took
                    # it again: whatever was set up for the old term must be set
                    # up anew (the scheduler places only in the term it readied).
                    self._on_change(False)
                self._on_change(held)
