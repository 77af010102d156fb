"""The SAVES stream's primitives, with nats-py's errors turned into ours.

Writes are fenced (expected last subject sequence 0); reads are direct gets.
Two requests are made by hand: nats-py's `stream_info()` cannot page through
subjects (the server sends at most 100k per answer) and `purge_stream()`
hides the purged count.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import MaxPayloadError, NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import DeliverPolicy, Header, RawStreamMsg
from nats.js.errors import APIError, NoStreamResponseError, NotFoundError, ServiceUnavailableError
from sandhold.bus.append import wrong_last_sequence
from sandhold.bus.bulk import bulk_get
from sandhold.saves.errors import SaveStoreError

_ATTEMPTS = 3
_API_PREFIX = "$JS.API"  # JetStream's API subjects (no domain: sandhold does not set one)
_TRANSIENT = (NatsTimeoutError, NoStreamResponseError, NoRespondersError, ServiceUnavailableError)


class SavesStream:
    def __init__(self, nc: NATS, stream: str, *, timeout: float, leader_reads: bool = True) -> None:
        self._nc = nc
        self._leader_reads = leader_reads
        self._js = nc.jetstream()
        self._stream = stream
        self._timeout = timeout

    async def put_new(
        self, subject: str, data: bytes, *, msg_id: str, headers: dict[str, str]
    ) -> bool:
        """Publish onto an empty subject; False when the subject already has its message.

        Retried on no answer: the fence refuses a second copy, so a retry of a
        write whose ack was lost answers False (R1) or duplicate (R3).
        """
        last_error: Exception | None = None
        for _ in range(_ATTEMPTS):
            fenced = {**headers, Header.EXPECTED_LAST_SUBJECT_SEQUENCE: "0", Header.MSG_ID: msg_id}
            try:
                ack = await self._js.publish(
                    subject, data, stream=self._stream, headers=fenced, timeout=self._timeout
                )
            except APIError as err:
                if wrong_last_sequence(err):
                    return False
                raise SaveStoreError(f"storing {subject} refused: {err}") from err
            except MaxPayloadError as err:
                raise SaveStoreError(
                    f"storing {subject}: {len(data)} bytes exceed the server's max payload"
                ) from err
            except _TRANSIENT as err:
                last_error = err
                continue
            return not ack.duplicate
        raise SaveStoreError(f"storing {subject}: no answer ({last_error!r})", retryable=True)

    async def get(self, subject: str) -> RawStreamMsg | None:
        """The subject's message by direct get; None when there is none.

        A direct get may be answered by a replica a moment behind (three nodes):
        "none" is asked again of the stream's leader, which knows every write
        acknowledged so far. Every read here is of something expected to exist
        (what a save names, a write just refused as taken), so a miss is rare.
        Not for a reader allowed direct gets only (the scheduler, which may read
        manifests and nothing else of the store: a leader's get names no subject
        a permission could pin)."""
        found = await self._get(subject, direct=True)
        if found is None and self._leader_reads:
            found = await self._get(subject, direct=False)
        return found

    async def get_many(
        self,
        subjects: list[str],
        *,
        take: Callable[[int, bytes], None],
        before: Callable[[int], Awaitable[None]] | None = None,
        in_flight: int = 32,
    ) -> list[int]:
        """Many subjects' messages by direct get on a connection of their own
        (`bulk_get`, decision 101), `take(i, data)` for each as it comes;
        the indexes not handed over (none there, or the read stopped early),
        for the caller to read with `get`."""
        return await bulk_get(
            self._nc, self._js, self._stream, subjects, take=take, before=before,
            in_flight=in_flight,
        )  # fmt: skip

    async def _get(self, subject: str, *, direct: bool) -> RawStreamMsg | None:
        try:
            return await self._js.get_msg(self._stream, subject=subject, direct=direct)
        except NotFoundError:
            return None
        except _TRANSIENT as err:
            raise SaveStoreError(f"reading {subject}: no answer ({err!r})", retryable=True) from err
        except APIError as err:
            raise SaveStoreError(f"reading {subject} refused: {err}") from err

    async def purge(self, subject: str) -> int:
        """Remove the subject's messages; returns how many there were."""
        resp = await self._api(f"STREAM.PURGE.{self._stream}", {"filter": subject})
        return int(resp.get("purged", 0))

    async def has(self, subject: str) -> bool:
        resp = await self._api(f"STREAM.INFO.{self._stream}", {"subjects_filter": subject})
        return bool(resp.get("state", {}).get("subjects"))

    async def subject_count(self) -> int:
        """Distinct subjects in the whole stream."""
        resp = await self._api(f"STREAM.INFO.{self._stream}", {})
        return int(resp.get("state", {}).get("num_subjects", 0))

    async def subjects(self, subject_filter: str) -> set[str]:
        """Every subject matching the filter, page by page."""
        found: set[str] = set()
        while True:
            resp = await self._api(
                f"STREAM.INFO.{self._stream}",
                {"subjects_filter": subject_filter, "offset": len(found)},
            )
            page = resp.get("state", {}).get("subjects") or {}
            before = len(found)
            found.update(page)
            if len(found) == before or len(found) >= int(resp.get("total", 0)):
                return found

    async def stored_times(self, subject_filter: str) -> dict[str, float]:
        """Subject -> unix time stored, for every message matching the filter.

        Headers only, through an ordered consumer, until it has caught up.
        """
        found: dict[str, float] = {}
        caught_up = asyncio.Event()

        async def on_msg(msg: Msg) -> None:
            meta = msg.metadata
            found[msg.subject] = meta.timestamp.timestamp()
            if meta.num_pending == 0:
                caught_up.set()

        sub = await self._js.subscribe(
            subject_filter,
            stream=self._stream,
            cb=on_msg,
            ordered_consumer=True,
            headers_only=True,
            deliver_policy=DeliverPolicy.ALL,
        )
        try:
            info = await sub.consumer_info()
            delivered = info.delivered.consumer_seq if info.delivered else 0
            if info.num_pending == 0 and not delivered:
                return found
            seen = -1
            while not caught_up.is_set():
                if len(found) == seen:
                    raise SaveStoreError(f"reading {subject_filter} stalled", retryable=True)
                seen = len(found)
                try:
                    await asyncio.wait_for(caught_up.wait(), self._timeout)
                except TimeoutError:
                    continue
        finally:
            await sub.unsubscribe()
        return found

    async def _api(self, operation: str, body: dict[str, Any]) -> dict[str, Any]:
        """One JetStream API request, made with the public request/reply call."""
        try:
            msg = await self._nc.request(
                f"{_API_PREFIX}.{operation}", json.dumps(body).encode(), timeout=self._timeout
            )
        except _TRANSIENT as err:
            raise SaveStoreError(f"{operation}: no answer ({err!r})", retryable=True) from err
        answer: dict[str, Any] = json.loads(msg.data)
        if "error" in answer:
            error = answer["error"]
            raise SaveStoreError(
                f"{operation} refused: {error.get('description', error)} "
                f"(code {error.get('err_code', error.get('code'))})"
            )
        return answer
