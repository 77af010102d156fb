"""The read model's cache keeps a sandbox compacted (`kept_in_cache`): its ended
commands and the saves nothing names are in their rows, never changed again.
Every row it writes is the row it wrote when it kept every state whole, for
any history cut into any batches; and a state read back from the rows is the
compacted one, so a model reading every batch back writes the rows the
sandbox's fold from zero says (what `replay --verify` checks)."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import tempfile
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st
from sandhold.bus.names import Names
from sandhold.domain.sandbox import Sandbox, evolve
from sandhold.gateway.readmodel import (
    ReadModel,
    changed_commands,
    changed_saves,
    command_row,
    differences,
    expected_rows,
    kept_in_cache,
    named_ids,
    sandbox_row,
    save_row,
    stored_rows,
)

from tests.domain import test_fold_property as fp
from tests.domain.history import SID

MIXES = st.sampled_from([fp.MIX, fp.SAVES_MIX])
CUTS = st.lists(st.integers(1, 12), min_size=1, max_size=40)


def _batches(n: int, cuts: list[int]) -> list[range]:
    """0..n cut into batches of the given lengths, repeated as needed."""
    out, start, i = [], 0, 0
    while start < n:
        end = min(n, start + cuts[i % len(cuts)])
        out.append(range(start, end))
        start, i = end, i + 1
    return out


def _rows(old: Sandbox | None, new: Sandbox, touched: set[str], seq: int) -> tuple:
    """What the read model writes for one batch (`_write_sandbox`)."""
    return (
        sandbox_row(new, seq),
        {c.id: command_row(new, c) for c in changed_commands(old, new, touched)},
        {r.id: save_row(new, r) for r in changed_saves(old, new, touched)},
    )


@fp.SETTINGS
@given(fp.MEMORY_CHOICE, fp.LONG_STEPS, MIXES, CUTS)
def test_a_compacted_cache_writes_the_rows_a_whole_one_wrote(memory_n, steps, mix, cuts) -> None:
    trace = fp.drive(memory_n, steps, mix)
    envelopes = [fp.DECODER.decode(line) for line in trace.log]
    whole: Sandbox | None = None
    kept: Sandbox | None = None
    for batch in _batches(len(envelopes), cuts):
        old_whole, old_kept, touched = whole, kept, set[str]()
        for i in batch:
            whole = evolve(whole, envelopes[i])
            kept = evolve(kept, envelopes[i])
            touched.update(named_ids(envelopes[i].event))
        if whole is None:
            assert kept is None
            continue
        assert kept is not None
        seq = batch[-1] + 1
        assert _rows(old_kept, kept, touched, seq) == _rows(old_whole, whole, touched, seq)
        kept = kept_in_cache(kept)


async def _fed(
    path: Path, triples: list[tuple[int, str, bytes]], cuts: list[int], size: int
) -> dict[str, list[tuple]]:
    """The rows of a model given `triples` in batches (`cuts`), its cache
    `size` states (0: every batch read back from the rows)."""
    model = ReadModel(path, Names("sh"), cache_size=size)
    await model.open()
    try:
        for batch in _batches(len(triples), cuts):
            await model.apply([triples[i] for i in batch])
    finally:
        await model.close()
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
        return stored_rows(db, "sandbox", SID)


@fp.SETTINGS
@given(fp.MEMORY_CHOICE, fp.STEPS, MIXES, CUTS)
def test_a_state_read_back_from_the_rows_writes_what_the_whole_fold_says(
    memory_n, steps, mix, cuts
) -> None:
    """What `replay --verify` checks: every row as the sandbox's fold from zero
    has it, whether each batch found its state in the cache or read it back."""
    trace = fp.drive(memory_n, steps, mix)
    triples = [(n, f"sh.ev.sandbox.{SID}", line) for n, line in enumerate(trace.log, start=1)]

    async def both() -> tuple[dict[str, list[tuple]], dict[str, list[tuple]]]:
        with tempfile.TemporaryDirectory(prefix="sandhold-readmodel-") as tmp:
            roomy = await _fed(Path(tmp) / "roomy.sqlite", triples, [1], 2048)
            read_back = await _fed(Path(tmp) / "read-back.sqlite", triples, cuts, 0)
            return roomy, read_back

    roomy, read_back = asyncio.run(both())
    whole = trace.state
    if whole is None:
        assert roomy == read_back == {"sandboxes": [], "commands": [], "saves": []}
        return
    expected = expected_rows("sandbox", whole, len(trace.log))
    assert differences(expected, read_back) == []
    assert differences(expected, roomy) == []
