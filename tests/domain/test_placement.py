"""`choose_host`: capacity, memory, liveness and the pull of the previous host."""

from __future__ import annotations

import itertools

import pytest
from sandhold.domain import events as ev
from sandhold.domain.envelope import wrap
from sandhold.domain.host import Host, decide_register
from sandhold.domain.host import evolve as evolve_host
from sandhold.domain.placement import HostInfo, choose_host

GiB = 1024**3


def host(name: str, slots: int = 4, memory: int = 8 * GiB, *, live: bool = True) -> HostInfo:
    return HostInfo(host=name, capacity_sandboxes=slots, memory_bytes=memory, live=live)


def test_the_host_with_the_most_free_slots_wins() -> None:
    hosts = [host("a", slots=4), host("b", slots=8), host("c", slots=6)]
    assert choose_host(hosts, {"a": 0, "b": 7, "c": 3}, memory_limit_bytes=None) == "a"


def test_a_host_missing_from_the_load_counts_as_empty() -> None:
    hosts = [host("a", slots=4), host("b", slots=4)]
    assert choose_host(hosts, {"a": 1}, memory_limit_bytes=None) == "b"


def test_a_full_host_is_skipped() -> None:
    hosts = [host("a", slots=2), host("b", slots=10)]
    assert choose_host(hosts, {"a": 0, "b": 10}, memory_limit_bytes=None) == "a"


def test_an_overfull_host_is_skipped() -> None:
    # After a host re-registers with fewer slots its load can exceed its capacity.
    assert choose_host([host("a", slots=2)], {"a": 3}, memory_limit_bytes=None) is None


def test_a_host_with_no_slots_takes_nothing() -> None:
    assert choose_host([host("a", slots=0)], {}, memory_limit_bytes=None) is None


def test_a_sandbox_goes_only_where_its_memory_fits() -> None:
    hosts = [host("small", slots=10, memory=1 * GiB), host("big", slots=2, memory=16 * GiB)]
    assert choose_host(hosts, {}, memory_limit_bytes=2 * GiB) == "big"
    assert choose_host(hosts, {}, memory_limit_bytes=1 * GiB) == "small"  # exactly fits
    assert choose_host(hosts, {}, memory_limit_bytes=None) == "small"  # no limit fits anywhere
    assert choose_host(hosts, {}, memory_limit_bytes=32 * GiB) is None


def test_a_host_that_is_not_live_is_skipped() -> None:
    hosts = [host("dead", slots=100, live=False), host("alive", slots=1)]
    assert choose_host(hosts, {}, memory_limit_bytes=None) == "alive"
    assert choose_host([host("dead", live=False)], {}, memory_limit_bytes=None) is None


def test_no_hosts_no_placement() -> None:
    assert choose_host([], {}, memory_limit_bytes=None) is None


def test_the_previous_host_wins_when_it_has_room() -> None:
    hosts = [host("old", slots=4), host("roomy", slots=100)]
    load = {"old": 3}
    assert choose_host(hosts, load, memory_limit_bytes=None) == "roomy"
    assert choose_host(hosts, load, memory_limit_bytes=None, prefer="old") == "old"


@pytest.mark.parametrize(
    ("old", "load", "memory_limit"),
    [
        (host("old", slots=4), {"old": 4}, None),
        (host("old", live=False), {}, None),
        (host("old", memory=1 * GiB), {}, 2 * GiB),
    ],
    ids=["full", "not-live", "too-small"],
)
def test_the_previous_host_is_passed_over_when_it_cannot_take_the_sandbox(
    old: HostInfo, load: dict[str, int], memory_limit: int | None
) -> None:
    hosts = [old, host("other")]
    assert choose_host(hosts, load, memory_limit_bytes=memory_limit, prefer="old") == "other"


def test_a_preferred_host_that_is_unknown_is_ignored() -> None:
    hosts = [host("a", slots=1), host("b", slots=5)]
    assert choose_host(hosts, {}, memory_limit_bytes=None, prefer="gone") == "b"


def test_the_choice_does_not_depend_on_the_order_hosts_are_listed() -> None:
    # Two schedulers that list hosts differently must still agree.
    hosts = [host("a", slots=4), host("b", slots=4), host("c", slots=3), host("d", slots=4)]
    load = {"a": 1, "b": 1, "c": 0, "d": 2}
    choices = {
        choose_host(list(order), load, memory_limit_bytes=None)
        for order in itertools.permutations(hosts)
    }
    assert len(choices) == 1
    assert choices <= {"a", "b", "c"}  # a tie on free slots, broken the same way every time


# --- host registration ------------------------------------------------------------------


def _registered(epoch: int, slots: int = 4) -> ev.HostRegistered:
    return ev.HostRegistered(host="a", epoch=epoch, capacity_sandboxes=slots, memory_bytes=GiB)


def _apply(state: Host | None, event: ev.HostRegistered, time: float) -> Host | None:
    [envelope] = wrap(
        [event],
        aggregate_id="a",
        id_base=str(event.epoch),
        actor="host-agent",
        causation_id="register",
        correlation_id="register",
        time=time,
    )
    return evolve_host(state, envelope)


def test_a_new_host_registers() -> None:
    registration = _registered(epoch=1)
    assert decide_register(None, registration) == [registration]
    state = _apply(None, registration, time=10.0)
    assert state == Host(
        host="a", epoch=1, capacity_sandboxes=4, memory_bytes=GiB, registered_at=10.0
    )


def test_a_restarted_agent_registers_again_with_a_new_epoch() -> None:
    state = _apply(None, _registered(epoch=1), time=10.0)
    newer = _registered(epoch=2, slots=8)
    assert decide_register(state, newer) == [newer]
    after = _apply(state, newer, time=20.0)
    assert after is not None
    assert (after.epoch, after.capacity_sandboxes, after.registered_at) == (2, 8, 20.0)


@pytest.mark.parametrize("epoch", [1, 0], ids=["same-epoch", "older-epoch"])
def test_a_registration_that_is_not_newer_is_nothing_new(epoch: int) -> None:
    state = _apply(None, _registered(epoch=1), time=10.0)
    assert decide_register(state, _registered(epoch=epoch)) == []


def test_a_sandbox_with_a_disk_quota_goes_only_to_a_host_that_enforces_one() -> None:
    hosts = [host("roomy", slots=8), HostInfo(host="quota", capacity_sandboxes=2,
             memory_bytes=8 * GiB, disk_quota=True)]  # fmt: skip
    assert choose_host(hosts, {}, memory_limit_bytes=None) == "roomy"
    assert choose_host(hosts, {}, memory_limit_bytes=None, disk_limit_bytes=GiB) == "quota"
    assert choose_host(hosts[:1], {}, memory_limit_bytes=None, disk_limit_bytes=GiB) is None


@pytest.mark.parametrize(
    ("status", "age", "expected"),
    [("registered", 0.5, "live"), ("registered", 2.5, "suspect"), ("registered", 6.0, "down"),
     ("registered", None, "down"), ("lost", 0.5, "lost"), ("fenced", None, "fenced")],
)  # fmt: skip
def test_a_hosts_liveness_is_recoverys_verdict_else_its_leases_age(status, age, expected):
    from sandhold.domain.host import Host, liveness

    host = Host(host="a", epoch=1, capacity_sandboxes=4, memory_bytes=GiB, registered_at=0.0,
                status=status)  # fmt: skip
    assert liveness(host, lease_age_s=age, ttl_s=5.0, interval_s=1.0) == expected
