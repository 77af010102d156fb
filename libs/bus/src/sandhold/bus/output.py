"""Reading a command's output back from the OUTPUT stream (no ownership checks:
callers that serve tenants check `ownership` first)."""

from __future__ import annotations

from nats.js import JetStreamContext
from nats.js.api import RawStreamMsg
from nats.js.errors import NotFoundError
from sandhold.bus.codec import OFFSET_HEADER
from sandhold.bus.names import Names
from sandhold.bus.read import read_subjects


class OutputLog:
    def __init__(self, js: JetStreamContext, names: Names) -> None:
        self._js = js
        self._names = names

    async def tail(
        self, sandbox_id: str, command_id: str, *, limit: int, stream: str = "stdout"
    ) -> bytes:
        """The last `limit` bytes the command wrote to `stream` that OUTPUT still
        holds, without reading the rest: a long output is never loaded whole, and
        one whose first chunks the stream's limits dropped still has its tail.

        A stream's chunks are ordered by offset like their sequences, so the first
        chunk needed is found by bisecting sequences (a few direct gets)."""
        js, name = self._js, self._names.output_stream
        subject = f"{self._names.output(sandbox_id, command_id)}.{stream}"
        try:
            last = await js.get_last_msg(name, subject, direct=True)
        except NotFoundError:
            return b""
        want = chunk_end(last) - limit  # the first byte wanted
        lo, hi = 1, last.seq or 1
        while lo < hi:  # the lowest sequence whose next chunk ends after `want`
            mid = (lo + hi) // 2
            probe = await js.get_msg(name, seq=mid, subject=subject, next=True, direct=True)
            if chunk_end(probe) > want:
                hi = mid
            else:
                lo = (probe.seq or mid) + 1
        tail = bytearray()
        start: int | None = None
        for msg in await read_subjects(js, name, subject, raw=True, start_seq=lo):
            offset = int((msg.headers or {})[OFFSET_HEADER])  # every chunk has it
            if start is None:
                start = offset
            end = start + len(tail)
            if offset <= end < offset + len(msg.data):
                tail += msg.data[end - offset :]
        return bytes(tail[-limit:]) if limit > 0 else b""

    async def last_written_at(self, sandbox_id: str, command_id: str) -> float | None:
        """When the command last wrote anything (either stream), or None."""
        subject = self._names.output(sandbox_id, command_id) + ".*"
        try:
            raw = await self._js.get_last_msg(self._names.output_stream, subject)
        except NotFoundError:
            return None
        return raw.time.timestamp() if raw.time is not None else None


def chunk_end(msg: RawStreamMsg) -> int:
    """Where an OUTPUT chunk ends in its stream of bytes."""
    return int((msg.headers or {})[OFFSET_HEADER]) + len(msg.data or b"")
