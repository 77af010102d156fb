"""The read model rewrites only the command and save rows an event changed,
found from the unended commands and the saves under way or kept before and
after it and from what the events named, not by going through all of them."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from sandhold.bus.codec import encode_envelope
from sandhold.bus.names import Names
from sandhold.domain.fold import fold
from sandhold.domain.sandbox import compact
from sandhold.domain.views import sandbox_view
from sandhold.gateway.readmodel import ReadModel, changed_commands, changed_saves
from sandhold.gateway.routes_sandboxes import decode_sandbox

from tests.domain.history import (
    RUNNING,
    SID,
    Step,
    cmd,
    command_ended,
    command_started,
    dispatched,
    envelopes_for,
    evolve,
    run,
)
from tests.domain.test_long_lived import _guarded, _ran
from tests.domain.test_long_lived_saves import _save, _saved, requested
from tests.domain.test_saves import captured, completed, uploaded


@contextlib.asynccontextmanager
async def _fed_both_ways(
    tmp_path: Path, steps: list[Step]
) -> AsyncIterator[tuple[ReadModel, ReadModel]]:
    """Two read models of the history: one given everything after `RUNNING` as
    one batch, against the state before it, the other one event at a time."""
    triples = [
        (seq, f"sh.ev.sandbox.{SID}", encode_envelope(envelope))
        for seq, envelope in enumerate(envelopes_for(steps), start=1)
    ]
    whole = ReadModel(tmp_path / "whole.sqlite", Names("sh"))
    await whole.open()
    one_by_one = ReadModel(tmp_path / "one.sqlite", Names("sh"))
    await one_by_one.open()
    try:
        first = len(RUNNING)  # the sandbox as it was before the batch
        assert await whole.apply(triples[:first]) == first
        assert await whole.apply(triples[first:]) == len(triples) - first
        for triple in triples:
            assert await one_by_one.apply([triple]) == 1
        yield whole, one_by_one
    finally:
        await whole.close()
        await one_by_one.close()


def test_only_the_command_an_event_changed_is_written_again():
    envelopes = envelopes_for(
        [*RUNNING, *_ran(100), run("a"), dispatched("a"), run("b"), command_started("a")]
    )
    states = [fold(evolve, envelopes[:-3], None)]
    for envelope in envelopes[-3:]:
        states.append(evolve(states[-1], envelope))
    _, before_b, after_b, after_start = states
    before_start = after_b
    assert before_b is not None and after_b is not None
    assert [c.id for c in changed_commands(_guarded(before_b), after_b)] == [cmd("b")]
    assert before_start is not None and after_start is not None
    changed = changed_commands(_guarded(before_start), after_start)
    assert [(c.id, c.state) for c in changed] == [(cmd("a"), "running")]


def test_an_ending_is_written_and_a_new_sandbox_writes_every_command():
    steps = [*RUNNING, *_ran(3), run("a"), dispatched("a")]
    envelopes = envelopes_for([*steps, command_ended("a")])
    before = fold(evolve, envelopes[:-1], None)
    after = evolve(before, envelopes[-1])
    assert before is not None and after is not None
    assert [(c.id, c.state) for c in changed_commands(before, after)] == [(cmd("a"), "exited")]
    assert len(changed_commands(None, after)) == 4


async def test_a_command_queued_and_ended_within_one_batch_gets_its_row(tmp_path: Path):
    """A batch (up to hundreds of events as the model follows or rebuilds) is
    written once, against the state before it: a command that came and went
    inside it is found by the events that named it."""
    steps = [*RUNNING, *_ran(3), run("a"), dispatched("a"), command_started("a")]
    async with _fed_both_ways(tmp_path, steps) as (whole, one_by_one):
        rows = "SELECT id, state FROM commands ORDER BY queued_at"
        expected = [
            (cmd("run-0"), "exited"),
            (cmd("run-1"), "interrupted"),
            (cmd("run-2"), "timed_out"),
            (cmd("a"), "running"),
        ]
        assert await whole.query(rows) == expected
        assert await one_by_one.query(rows) == expected


def test_only_the_saves_an_event_changed_are_written_again():
    steps = [*RUNNING, *_saved(100), requested(500), captured(_save(500))]
    envelopes = envelopes_for([*steps, run("a"), uploaded(_save(500)), completed(_save(500))])
    at = len(envelopes) - 3
    states = [fold(evolve, envelopes[:at], None)]
    for envelope in envelopes[at:]:
        states.append(evolve(states[-1], envelope))
    before, after_run, after_upload, after_completed = states
    assert before is not None and after_run is not None
    # Not a save event, and its save under way was captured busy: never stamped.
    assert changed_saves(_guarded(before), after_run) == []
    assert after_upload is not None and after_completed is not None
    changed = changed_saves(_guarded(after_run), after_upload)
    assert [(r.id, r.state) for r in changed] == [(_save(500), "uploaded")]
    changed = changed_saves(_guarded(after_upload), after_completed)
    assert [(r.id, r.state) for r in changed] == [(_save(500), "completed")]
    assert len(changed_saves(None, after_completed)) == 101


async def test_saves_requested_and_expired_within_one_batch_get_their_rows(tmp_path: Path):
    """As for commands: a save that came and went inside one batch (requested,
    completed, expired) is found by the events that named it, and a state read
    back from the rows holds the saves something names and the indexes (the
    others are in their rows only: decision 072)."""
    steps = [*RUNNING, *_saved(12)]
    async with _fed_both_ways(tmp_path, steps) as (whole, one_by_one):
        rows = "SELECT id, state FROM saves ORDER BY requested_at"
        expected = [(_save(n), "expired" if n < 7 else "completed") for n in range(12)]
        assert await whole.query(rows) == expected
        assert await one_by_one.query(rows) == expected
        folded = fold(evolve, envelopes_for(steps), None)
        assert folded is not None
        whole._cache.clear()  # read back from the rows, as after a restart
        state, _ = await whole._load(("sandbox", SID))
        # As the cache keeps it (compacted): the saves something names and
        # their indexes; the expired ones are in their rows only.
        kept = compact(folded)
        assert state.saves == kept.saves and len(kept.saves) < len(folded.saves)
        assert state.saves_completed == folded.saves_completed
        # The sandbox's own row holds only the saves its view reads, and lists
        # render the same view from it as from the whole fold.
        ((row,),) = await whole.query("SELECT state FROM sandboxes")
        listed = decode_sandbox(row)
        assert set(listed.saves) == {_save(n) for n in range(7, 12)}
        now = folded.created_at + 10_000
        assert sandbox_view(listed, now=now) == sandbox_view(folded, now=now)
