"""A compacted sandbox keeps its newest request keys exactly and older ones as
8-byte fingerprints (decision 085): its memory no longer grows by a string per
command it ever ran, and a retry is still known as one, however late."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
from hypothesis import given
from sandhold.domain import events as ev
from sandhold.domain import fingerprints
from sandhold.domain import requests as rq
from sandhold.domain.sandbox import (
    Sandbox,
    compact,
    ended_away,
    evolve,
    queued_by,
    remembers,
    whole_needed,
)

from . import test_fold_property as fp
from .history import (
    RUNNING,
    SID,
    TENANT,
    cmd,
    command_ended,
    delete,
    deleted,
    dispatched,
    envelopes_for,
    given_sandbox,
    run,
    stop,
    stopped,
)
from .test_compaction import (
    as_a_store_decides,
    as_the_whole_decides,
    assert_compacted_as_the_whole_fold,
    assert_decided_as_on_the_whole,
)


@contextlib.contextmanager
def blocks_of(n: int) -> Iterator[None]:
    """Blocks of `n` keys, so that the random histories (15 keys at most) move some."""
    kept, fingerprints.BLOCK = fingerprints.BLOCK, n
    try:
        yield
    finally:
        fingerprints.BLOCK = kept


# --- the fingerprints --------------------------------------------------------------


def test_runs_hold_every_key_moved_into_them_and_no_other() -> None:
    runs: tuple[bytes, ...] = ()
    for block in range(5):
        runs = fingerprints.with_block(runs, (f"key-{block}-{i}" for i in range(100)))
    assert fingerprints.count(runs) == 500 and sum(map(len, runs)) == 500 * 8, "8 B a key"
    assert [len(r) // 8 for r in runs] == [400, 100], "merged as a binary counter: 4 + 1 blocks"
    assert all(fingerprints.may_hold(runs, f"key-{b}-{i}") for b in range(5) for i in range(100))
    assert not any(fingerprints.may_hold(runs, f"other-{i}") for i in range(10_000))
    assert not fingerprints.may_hold((), "key-0-0")


def test_what_is_kept_is_the_same_however_often_it_was_compacted() -> None:
    """After every event, now and then, or once at the end: the same exact keys
    and the same runs (checkpoints are audited against a fold compacted once)."""
    touches = [rq.TouchSandbox(key=f"touch-{i}", tenant=TENANT, sandbox_id=SID) for i in range(40)]
    envelopes = envelopes_for([*RUNNING, *touches])
    with blocks_of(3):
        kept = []
        for every in (1, 7, 13, len(envelopes)):
            state = None
            for n, envelope in enumerate(envelopes, 1):
                state = evolve(state, envelope)
                if n % every == 0 or n == len(envelopes):
                    state = compact(state)
            kept.append(state)
    assert kept[0] is not None and len(kept[0].forgotten_keys) >= 2, "merged runs"
    assert all(state == kept[0] for state in kept[1:])


# --- compaction --------------------------------------------------------------------


def _runs(n: int) -> list:
    """`n` commands run one after the other, each to its end."""
    return [
        s for i in range(n) for s in (run(f"r{i}"), dispatched(f"r{i}"), command_ended(f"r{i}"))
    ]


def _ran(n: int) -> Sandbox:
    """A running sandbox that ran `n` commands, each ended."""
    return given_sandbox(*RUNNING, *_runs(n))


def test_the_oldest_keys_go_to_fingerprints_a_block_at_a_time_and_the_newest_stay() -> None:
    with blocks_of(4):
        whole = _ran(13)  # 14 keys: the create's and 13 runs'
        kept = compact(whole)
    keys = list(whole.requests)
    assert len(keys) == 14
    # 14 = 4 + 4 + 6: two blocks moved, while two blocks' worth (8) were held
    assert fingerprints.count(kept.forgotten_keys) == 8
    assert list(kept.requests) == keys[8:], "the newest, exactly, in order"
    assert all(fingerprints.may_hold(kept.forgotten_keys, key) for key in keys[:8])
    assert all(remembers(kept, key) is True for key in keys[8:])


def test_a_key_kept_as_a_fingerprint_is_decided_on_the_whole_state_a_new_one_is_not() -> None:
    with blocks_of(4):
        whole = _ran(13)
        kept = compact(whole)
        old, new = run("r0"), run("never-sent")
        assert remembers(kept, old.key) is None and queued_by(kept, old.key) is None
        assert whole_needed(kept, old), "only the log can say: read it back"
        assert remembers(kept, new.key) is False and not whole_needed(kept, new)
        # Decided as on the whole state: the retry is known, the new run is new.
        for request in (old, new):
            assert as_a_store_decides(kept, whole, request) == as_the_whole_decides(whole, request)
        assert ended_away(kept, cmd("r0"), old.key), "its end record is in the log"


def test_a_late_start_superseded_by_a_stop_kept_as_a_fingerprint_starts_nothing() -> None:
    """A task's provisioning start that comes after its stop (decision 082) names
    the stop's key; that key, moved to a fingerprint, still makes the start a
    no-op: decided on the whole state."""
    touches = [rq.TouchSandbox(key=f"touch-{i}", tenant=TENANT, sandbox_id=SID) for i in range(4)]
    with blocks_of(2):
        whole = given_sandbox(*RUNNING, stop("task:stop"), stopped(), *touches)
        kept = compact(whole)
        late = rq.StartSandbox(
            key="task:start-2", tenant=TENANT, sandbox_id=SID, superseded_by=("task:stop",)
        )
        assert remembers(kept, "task:stop") is None
        assert whole_needed(kept, late)
        decided = as_a_store_decides(kept, whole, late)
    assert decided == as_the_whole_decides(whole, late)
    assert decided[0] == "decided" and [type(e) for e in decided[1][0]] == [ev.RequestNoted]


def test_a_deleted_sandbox_keeps_no_fingerprints() -> None:
    with blocks_of(2):
        assert compact(_ran(6)).forgotten_keys
        gone = compact(given_sandbox(*RUNNING, *_runs(6), stop(), stopped(), delete(), deleted()))
    assert not gone.forgotten_keys and not gone.requests


def test_what_is_kept_of_a_sandbox_that_ran_ten_thousand_commands_is_bounded() -> None:
    """Keys held exactly stay under two blocks; the rest costs 8 B a key."""
    state = None
    for envelope in envelopes_for([*RUNNING, *_runs(10_000)]):
        state = compact(evolve(state, envelope))
    assert state is not None
    assert fingerprints.BLOCK <= len(state.requests) < 2 * fingerprints.BLOCK
    assert fingerprints.count(state.forgotten_keys) + len(state.requests) == 10_001
    assert sum(map(len, state.forgotten_keys)) == 8 * fingerprints.count(state.forgotten_keys)
    assert remembers(state, "r0") is None and remembers(state, "r9999") is True


# --- over random histories, with blocks of a few keys --------------------------------


@pytest.mark.parametrize("block", [2, 3])
@fp.SETTINGS
@given(fp.MEMORY_CHOICE, fp.STEPS)
def test_with_fingerprints_compacting_after_every_event_is_compacting_the_whole_fold(
    block: int, memory_n: int, steps: list[fp.Choice]
) -> None:
    with blocks_of(block):
        assert_compacted_as_the_whole_fold(fp.drive(memory_n, steps))


@pytest.mark.parametrize("block", [2, 3])
@fp.SETTINGS
@given(fp.MEMORY_CHOICE, fp.STEPS, fp.CHOICE)
def test_with_fingerprints_any_request_is_decided_as_on_the_whole(
    block: int, memory_n: int, steps: list[fp.Choice], request_choice: fp.Choice
) -> None:
    with blocks_of(block):
        assert_decided_as_on_the_whole(fp.drive(memory_n, steps), request_choice)
