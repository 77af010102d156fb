"""A compacted sandbox keeps its newest request keys exactly and older ones as
Bloom filters (decision 085): its memory no longer grows by a string per
command it ever ran, and a retry is still known as one, however late."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
from hypothesis import given
from sandhold.domain import keyfilter as kf
from sandhold.domain.reconcile import plan
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
    HOST_A,
    RUNNING,
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
    compacted_fold,
)


@contextlib.contextmanager
def blocks_of(n: int) -> Iterator[None]:
    """Filters of `n` keys, so that the random histories (15 keys at most) make some."""
    kept, kf.BLOCK = kf.BLOCK, n
    try:
        yield
    finally:
        kf.BLOCK = kept


# --- the filter ------------------------------------------------------------------


def test_a_filter_holds_every_key_put_in_it() -> None:
    keys = [f"key-{i}" for i in range(kf.BLOCK)]
    block = kf.block_of(keys)
    assert len(block) * 8 == kf.BLOCK * kf.BITS_PER_KEY, "20 bits a key"
    assert all(kf.may_hold((block,), key) for key in keys)
    assert not kf.may_hold((), "key-0"), "no filter holds nothing"


def test_a_filter_mistakes_few_keys_for_its_own() -> None:
    """Designed 0.007%; measured on 100,000 keys never put in (the hash is fixed,
    so this count is too)."""
    block = kf.block_of(f"key-{i}" for i in range(kf.BLOCK))
    mistaken = sum(kf.may_hold((block,), f"other-{i}") for i in range(100_000))
    assert mistaken <= 50, f"{mistaken} of 100,000 (0.05% at most)"


# --- compaction --------------------------------------------------------------------


def _runs(n: int) -> list:
    """`n` commands run one after the other, each to its end."""
    return [
        s for i in range(n) for s in (run(f"r{i}"), dispatched(f"r{i}"), command_ended(f"r{i}"))
    ]


def _ran(n: int) -> Sandbox:
    """A running sandbox that ran `n` commands, each ended."""
    return given_sandbox(*RUNNING, *_runs(n))


def test_the_oldest_keys_go_into_filters_a_block_at_a_time_and_the_newest_stay() -> None:
    with blocks_of(4):
        whole = _ran(13)  # 14 keys: the create's and 13 runs'
        kept = compact(whole)
    keys = list(whole.requests)
    assert len(keys) == 14
    # 14 = 4 + 4 + 6: two blocks, while two blocks' worth (8) were held
    assert len(kept.forgotten_keys) == 2
    assert list(kept.requests) == keys[8:], "the newest, exactly, in order"
    assert all(kf.may_hold(kept.forgotten_keys, key) for key in keys[:8])
    assert all(remembers(kept, key) is True for key in keys[8:])


def test_a_key_in_a_filter_is_decided_on_the_whole_state_and_a_new_one_is_not() -> None:
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


def test_a_deleted_sandbox_keeps_no_filter() -> None:
    with blocks_of(2):
        assert compact(_ran(6)).forgotten_keys
        gone = compact(given_sandbox(*RUNNING, *_runs(6), stop(), stopped(), delete(), deleted()))
    assert not gone.forgotten_keys and not gone.requests


def test_what_is_kept_of_a_sandbox_that_ran_ten_thousand_commands_is_bounded() -> None:
    """Keys held exactly stay under two blocks; the rest costs 2.5 B a key."""
    state = None
    for envelope in envelopes_for([*RUNNING, *_runs(10_000)]):
        state = compact(evolve(state, envelope))
    assert state is not None
    assert kf.BLOCK <= len(state.requests) < 2 * kf.BLOCK
    assert len(state.forgotten_keys) == (10_001 - len(state.requests)) // kf.BLOCK
    assert sum(map(len, state.forgotten_keys)) < 2.6 * 10_001
    assert remembers(state, "r0") is None and remembers(state, "r9999") is True


# --- over random histories, with filters of a few keys ------------------------------


@pytest.mark.parametrize("block", [2, 3])
@fp.SETTINGS
@given(fp.MEMORY_CHOICE, fp.STEPS)
def test_with_filters_compacting_after_every_event_is_compacting_the_whole_fold(
    block: int, memory_n: int, steps: list[fp.Choice]
) -> None:
    with blocks_of(block):
        assert_compacted_as_the_whole_fold(fp.drive(memory_n, steps))


@pytest.mark.parametrize("block", [2, 3])
@fp.SETTINGS
@given(fp.MEMORY_CHOICE, fp.STEPS, fp.CHOICE)
def test_with_filters_any_request_is_decided_as_on_the_whole(
    block: int, memory_n: int, steps: list[fp.Choice], request_choice: fp.Choice
) -> None:
    with blocks_of(block):
        trace = fp.drive(memory_n, steps)
        whole = trace.state
        kept = compacted_fold(trace)[-1]
        assert whole is not None and kept is not None
        request = fp.read_request(whole, request_choice)
        assert as_a_store_decides(kept, whole, request) == as_the_whole_decides(whole, request)


@pytest.mark.parametrize("block", [2])
@fp.SETTINGS
@given(fp.MEMORY_CHOICE, fp.STEPS)
def test_with_filters_the_scheduler_plans_the_same(
    block: int, memory_n: int, steps: list[fp.Choice]
) -> None:
    with blocks_of(block):
        trace = fp.drive(memory_n, steps)
        for kept, whole in zip(compacted_fold(trace)[1:], trace.states[1:], strict=True):
            assert kept is not None and whole is not None
            assert plan(kept, fp.choose(HOST_A)) == plan(whole, fp.choose(HOST_A))
