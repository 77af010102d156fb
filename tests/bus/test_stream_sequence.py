"""The cheap stream-sequence parse agrees with nats-py's metadata on a real server."""

from __future__ import annotations

import asyncio

from sandhold.bus.names import Names
from sandhold.bus.store import stream_sequence


async def test_stream_sequence_matches_the_metadata(nc, names: Names):
    js = nc.jetstream()
    for i in range(5):
        await js.publish(names.events("sandbox", f"sb-{i:016x}"), b"{}")
    seen: list[tuple[int, int]] = []
    done = asyncio.Event()

    async def on_msg(msg) -> None:
        seen.append((stream_sequence(msg), msg.metadata.sequence.stream))
        if len(seen) == 5:
            done.set()

    sub = await js.subscribe(names.events("sandbox", ">"), ordered_consumer=True, cb=on_msg)
    await asyncio.wait_for(done.wait(), 10)
    await sub.unsubscribe()
    assert [a for a, _ in seen] == [b for _, b in seen] == [1, 2, 3, 4, 5]
