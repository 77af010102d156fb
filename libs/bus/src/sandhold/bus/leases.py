"""Host leases in a KV bucket: a host-agent renews its key, others watch it.

`RenewalWatcher` is the watching, for any lease bucket: service instances'
leases (`instances.py`) are watched the same way."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Generic, TypeVar

import msgspec
from nats.js import JetStreamContext
from nats.js.kv import KeyValue
from sandhold.bus.names import Names
from sandhold.domain.host import ChunkCacheStats


class Lease(msgspec.Struct, frozen=True, kw_only=True):
    host: str
    epoch: int
    renewed_at: float  # the host's wall clock, for people reading the bucket
    interval_s: float = 1.0  # how often the host renews (published with `host ls`)
    chunk_cache: ChunkCacheStats | None = None  # None: the host keeps no cache


class RecoverySettings(msgspec.Struct, frozen=True, kw_only=True):
    """Published by the recovery service in the lease bucket (key `_recovery`)."""

    lease_ttl_s: float
    fence_margin_s: float


SETTINGS_KEY = "_recovery"


_decode = msgspec.json.Decoder(Lease).decode
_encode = msgspec.json.Encoder().encode


async def lease_bucket(js: JetStreamContext, names: Names) -> KeyValue:
    return await js.key_value(names.lease_bucket)


async def renew(kv: KeyValue, lease: Lease) -> None:
    await kv.put(lease.host, _encode(lease))


L = TypeVar("L")


class RenewalWatcher(Generic[L]):
    """Follows the keys of a lease bucket (those under `keys`) and says which were
    renewed within `ttl` seconds, by this process's own monotonic clock: a key
    counts from when a renewal of it arrived here, less the age it had on arrival.

    A writer may write its own key only (permissions.py), so a value speaks for
    its own key alone: one whose `key_of` is not the key it was written under is
    refused.
    """

    def __init__(
        self,
        kv: KeyValue,
        *,
        ttl: float,
        decode: Callable[[bytes], L],
        key_of: Callable[[L], str],
        keys: str = ">",
    ) -> None:
        self._kv = kv
        self._ttl = ttl
        self._decode = decode
        self._key_of = key_of
        self._keys = keys
        self._seen: dict[str, tuple[float, L]] = {}  # key -> (monotonic time, value)
        self._task: asyncio.Task[None] | None = None
        self._on_renewal: list[Callable[[str, bool], None]] = []
        # The bucket's stream sequence of the last entry delivered here: everything
        # stored before it has been seen.
        self.revision = 0

    def on_renewal(self, callback: Callable[[str, bool], None]) -> None:
        """`callback(key, was_live)` on every renewal seen."""
        self._on_renewal.append(callback)

    async def start(self) -> None:
        watcher = await self._kv.watch(self._keys)
        self._task = asyncio.create_task(self._follow(watcher))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _follow(self, watcher: KeyValue.KeyWatcher) -> None:
        async for entry in watcher:
            if entry is None:
                continue
            self.revision = max(self.revision, entry.revision or 0)
            if entry.value is None or entry.operation is not None:
                continue
            try:
                value = self._decode(entry.value)
            except msgspec.DecodeError:
                continue
            if self._key_of(value) != entry.key:
                continue
            age = 0.0
            if entry.created is not None:
                created = (
                    entry.created if entry.created.tzinfo else entry.created.replace(tzinfo=UTC)
                )
                age = max(0.0, (datetime.now(UTC) - created).total_seconds())
            was_live = self.is_live(entry.key)
            self._seen[entry.key] = (time.monotonic() - age, value)
            for callback in self._on_renewal:
                callback(entry.key, was_live)

    def is_live(self, key: str) -> bool:
        seen = self._seen.get(key)
        return seen is not None and time.monotonic() - seen[0] < self._ttl

    def seen(self, key: str) -> tuple[float, L] | None:
        """(monotonic time of the key's last renewal seen here, its value)."""
        return self._seen.get(key)


class LeaseWatcher(RenewalWatcher[Lease]):
    """Follows every host's lease and says which hosts renewed within `ttl` seconds."""

    def __init__(self, kv: KeyValue, *, ttl: float) -> None:
        super().__init__(kv, ttl=ttl, decode=_decode, key_of=lambda lease: lease.host)

    def last_renewal(self, host: str, *, epoch: int | None = None) -> float | None:
        """The wall time of the host's last renewal seen (of `epoch`, if given)."""
        seen = self.seen(host)
        if seen is None or (epoch is not None and seen[1].epoch != epoch):
            return None
        return time.time() - (time.monotonic() - seen[0])

    def lease(self, host: str) -> Lease | None:
        seen = self.seen(host)
        return seen[1] if seen is not None else None


async def published_settings(kv: KeyValue) -> dict[str, float]:
    """What the recovery service published (`lease_ttl_s`, `fence_margin_s`), with
    the defaults where it has not (yet)."""
    settings = {"lease_ttl_s": 5.0, "fence_margin_s": 2.0}
    with contextlib.suppress(Exception):
        entry = await kv.get(SETTINGS_KEY)
        settings.update(msgspec.json.decode(entry.value or b"{}"))
    return settings


async def read_lease(kv: KeyValue, host_id: str) -> Lease | None:
    """The host's lease as it last wrote it; None without one (or unreadable)."""
    try:
        entry = await kv.get(host_id)
        return _decode(entry.value or b"")
    except Exception:  # no lease (yet), or one not readable
        return None


async def lease_age(kv: KeyValue, host_id: str, *, now: float) -> tuple[float | None, float]:
    """(seconds since the host last renewed, by its own clock — None without a
    lease; how often it renews)."""
    lease = await read_lease(kv, host_id)
    if lease is None:
        return None, 1.0
    return max(0.0, now - lease.renewed_at), lease.interval_s
