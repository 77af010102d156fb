"""Backoff with caller-drawn jitter, and which error classes earn retries."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st
from sandhold.domain.retry import backoff_delay, retry_budget
from sandhold.domain.task_manifest import RetryPolicy

attempts = st.integers(min_value=1, max_value=5000)
jitters = st.floats(min_value=0, max_value=1, exclude_max=True)
times = st.floats(min_value=0, max_value=1e6, allow_nan=False)


@st.composite
def base_and_cap(draw: st.DrawFn) -> tuple[float, float]:
    a, b = draw(times), draw(times)
    return min(a, b), max(a, b)


@given(attempts, base_and_cap(), jitters)
def test_the_delay_is_never_negative_and_never_past_the_cap(
    attempt: int, bc: tuple[float, float], jitter: float
) -> None:
    base_s, cap_s = bc
    delay = backoff_delay(attempt, base_s=base_s, cap_s=cap_s, jitter=jitter)
    assert 0 <= delay <= cap_s
    assert math.isfinite(delay)


@given(attempts, base_and_cap(), jitters)
def test_the_delay_stays_inside_the_doubling_envelope(
    attempt: int, bc: tuple[float, float], jitter: float
) -> None:
    base_s, cap_s = bc
    # Exact arithmetic: the oracle must not share the implementation's float tricks.
    envelope = float(min(Fraction(cap_s), Fraction(base_s) * 2 ** (attempt - 1)))
    delay = backoff_delay(attempt, base_s=base_s, cap_s=cap_s, jitter=jitter)
    assert envelope / 2 <= delay <= envelope


@given(attempts, base_and_cap(), jitters)
def test_a_later_attempt_never_waits_less_for_the_same_jitter(
    attempt: int, bc: tuple[float, float], jitter: float
) -> None:
    base_s, cap_s = bc
    now = backoff_delay(attempt, base_s=base_s, cap_s=cap_s, jitter=jitter)
    later = backoff_delay(attempt + 1, base_s=base_s, cap_s=cap_s, jitter=jitter)
    assert later >= now


@given(base_and_cap(), jitters)
def test_the_first_retry_waits_at_most_the_base(bc: tuple[float, float], jitter: float) -> None:
    base_s, cap_s = bc
    assert base_s / 2 <= backoff_delay(1, base_s=base_s, cap_s=cap_s, jitter=jitter) <= base_s


def test_the_delay_doubles_until_the_cap() -> None:
    delays = [backoff_delay(n, base_s=1.0, cap_s=5.0, jitter=0.0) for n in range(1, 6)]
    assert delays == [0.5, 1.0, 2.0, 2.5, 2.5]


@pytest.mark.parametrize(
    ("attempt", "base_s", "cap_s", "jitter"),
    [
        (0, 1.0, 2.0, 0.5),
        (1, -1.0, 2.0, 0.5),
        (1, 3.0, 2.0, 0.5),
        (1, 1.0, math.inf, 0.5),
        (1, math.nan, 2.0, 0.5),
        (1, 1.0, 2.0, 1.0),
        (1, 1.0, 2.0, -0.1),
        (1, 1.0, 2.0, math.nan),
    ],
)
def test_nonsense_arguments_are_refused(
    attempt: int, base_s: float, cap_s: float, jitter: float
) -> None:
    with pytest.raises(ValueError):
        backoff_delay(attempt, base_s=base_s, cap_s=cap_s, jitter=jitter)


def test_the_default_budgets_follow_the_seed() -> None:
    assert retry_budget("network") == 3
    assert retry_budget("placement") == 2
    assert retry_budget("permanent") == 0


def test_the_manifest_policy_sets_the_transient_budgets_but_permanent_stays_zero() -> None:
    assert retry_budget("network", RetryPolicy()) == 3
    policy = RetryPolicy(network=5, placement=0)
    assert retry_budget("network", policy) == 5
    assert retry_budget("placement", policy) == 0
    assert retry_budget("permanent", policy) == 0
