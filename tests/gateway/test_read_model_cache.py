"""The read model keeps only a few folded states in memory, and the rows do not
depend on how many."""

from __future__ import annotations

from pathlib import Path

from sandhold.bus.names import Names
from sandhold.bus.read import read_subjects
from sandhold.gateway.readmodel import ReadModel

from tests.gateway.conftest import Gw, nats_client, running_sandbox
from tests.gateway.test_read_model import dump


async def test_a_small_cache_gives_the_same_rows_and_stays_small(gw: Gw, tmp_path: Path):
    async with gw.http("default") as http:
        for _ in range(3):
            sandbox_id = await running_sandbox(http)
            for i in range(2):
                await http.post(
                    f"/api/v1/sandboxes/{sandbox_id}/commands", json={"argv": ["echo", str(i)]}
                )
    async with nats_client(gw, "default") as client:
        raw = await read_subjects(client.js, client.names.events_stream, "sh.ev.>", raw=True)
    triples = [(m.metadata.sequence.stream, m.subject, m.data) for m in raw]

    roomy = ReadModel(tmp_path / "roomy.sqlite", Names("sh"))
    await roomy.open()
    await roomy.apply(triples)
    await roomy.close()

    small = ReadModel(tmp_path / "small.sqlite", Names("sh"), cache_size=1)
    await small.open()
    for start in range(0, len(triples), 5):  # batches interleaving several aggregates
        await small.apply(triples[start : start + 5])
        assert len(small._cache) <= 1  # noqa: SLF001
    await small.close()
    assert dump(tmp_path / "small.sqlite") == dump(tmp_path / "roomy.sqlite")
