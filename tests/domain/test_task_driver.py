"""Who drives a task: claims fold into a driver and an epoch, a claim stands
while its driver's lease is live, and a runner of a superseded epoch is
refused (`task_driver`), given/when/then."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from sandhold.domain import events as ev
from sandhold.domain import task as tk
from sandhold.domain.errors import Rejected
from sandhold.domain.task_driver import SUPERSEDED, check_driver, claim_driver

from tests.domain.test_task import fold, submitted, through_running

ONE, TWO = "orchestrator-1", "orchestrator-2"


def nobody_live(instance: str) -> bool:
    return False


def everybody_live(instance: str) -> bool:
    return True


def claimed_by(*claims: tuple[str, int]) -> list[ev.AnyEvent]:
    return [*through_running(), *(ev.TaskDriverClaimed(driver=d, epoch=e) for d, e in claims)]


def test_a_new_task_has_no_driver_and_its_first_claim_opens_epoch_one():
    state = fold(submitted())
    assert (state.driver, state.driver_epoch) == (None, 0)
    [claim] = claim_driver(state, ONE, holding=None, live=everybody_live)
    assert claim == ev.TaskDriverClaimed(driver=ONE, epoch=1)
    state = fold([*submitted(), claim])
    assert (state.driver, state.driver_epoch) == (ONE, 1)
    assert state.state == "pending"  # a claim is no transition


def test_a_task_driven_by_a_live_twin_is_not_claimed():
    state = fold(claimed_by((ONE, 1)))
    with pytest.raises(Rejected) as caught:
        claim_driver(state, TWO, holding=None, live=lambda i: i == ONE)
    assert caught.value.code == "driven_elsewhere"
    assert ONE in caught.value.message


def test_a_task_whose_driver_stopped_renewing_is_taken_over_in_the_next_epoch():
    state = fold(claimed_by((ONE, 1)))
    [claim] = claim_driver(state, TWO, holding=None, live=nobody_live)
    assert claim == ev.TaskDriverClaimed(driver=TWO, epoch=2)
    state = fold(claimed_by((ONE, 1), (TWO, 2)))
    assert (state.driver, state.driver_epoch) == (TWO, 2)


def test_the_claim_this_process_holds_is_not_made_again():
    state = fold(claimed_by((ONE, 1), (TWO, 2)))
    assert claim_driver(state, TWO, holding=2, live=everybody_live) == []


def test_its_own_name_from_an_earlier_process_or_lease_term_is_taken_over():
    """Live or not by the lease (the name is this process's own, renewed by it):
    whatever an earlier process under the name still runs must be refused. (The
    orchestrator holds nothing from an earlier lease term: `holding=None` too.)"""
    state = fold(claimed_by((ONE, 1)))
    [claim] = claim_driver(state, ONE, holding=None, live=everybody_live)
    assert claim == ev.TaskDriverClaimed(driver=ONE, epoch=2)


def test_an_ended_or_unknown_task_is_not_claimed():
    with pytest.raises(Rejected) as missing:
        claim_driver(None, ONE, holding=None, live=nobody_live)
    assert missing.value.code == "task_not_found"
    ended = fold([*claimed_by((ONE, 1)), ev.TaskCompleted()])
    with pytest.raises(Rejected) as finished:
        claim_driver(ended, TWO, holding=None, live=nobody_live)
    assert finished.value.code == "task_finished"


def test_a_claim_written_after_the_end_changes_nothing():
    state = fold(
        [*claimed_by((ONE, 1)), ev.TaskCancelled(), ev.TaskDriverClaimed(driver=TWO, epoch=2)]
    )
    assert (state.state, state.driver, state.driver_epoch) == ("cancelled", ONE, 1)


def test_a_decision_of_the_current_epoch_stands():
    check_driver(fold(claimed_by((ONE, 1), (TWO, 2))), 2)


def test_a_decision_of_a_superseded_epoch_is_rejected():
    """The runner of epoch 1 woke up after its twin took over: its next append is
    decided on the re-read state, and refused."""
    state = fold(claimed_by((ONE, 1), (TWO, 2)))
    with pytest.raises(Rejected) as caught:
        check_driver(state, 1)
    assert caught.value.code == SUPERSEDED
    assert TWO in caught.value.message and "epoch 2" in caught.value.message


def test_a_runner_of_a_later_process_under_the_same_name_supersedes_the_earlier():
    state = fold(claimed_by((ONE, 1), (ONE, 2)))
    with pytest.raises(Rejected):
        check_driver(state, 1)
    check_driver(state, 2)


@given(
    st.lists(
        st.tuples(st.sampled_from([ONE, TWO, "orchestrator-3"]), st.booleans(), st.booleans()),
        max_size=12,
    )
)
def test_only_the_latest_claim_may_decide_however_claims_race(attempts):
    """Any run of claims (each instance holding what it claimed, its twins live
    or not): epochs count up by one, and of every epoch ever granted only the
    latest passes the guard."""
    events: list[ev.AnyEvent] = list(through_running())
    held: dict[str, int] = {}
    granted: list[int] = []
    for instance, twins_live, forgot in attempts:
        state = fold(events)
        holding = None if forgot else held.get(instance)
        try:
            claims = claim_driver(
                state, instance, holding=holding, live=everybody_live if twins_live else nobody_live
            )
        except Rejected as refused:
            assert refused.code == "driven_elsewhere" and twins_live
            continue
        for claim in claims:
            assert isinstance(claim, ev.TaskDriverClaimed)
            assert claim.epoch == state.driver_epoch + 1
            granted.append(claim.epoch)
        events += claims
        held[instance] = fold(events).driver_epoch
    state = fold(events)
    assert granted == list(range(1, len(granted) + 1))
    for epoch in granted:
        if epoch == state.driver_epoch:
            check_driver(state, epoch)
        else:
            with pytest.raises(Rejected):
                check_driver(state, epoch)
    assert isinstance(state, tk.Task)
