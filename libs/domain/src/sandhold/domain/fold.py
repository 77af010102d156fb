"""The one fold: every live path and the replay tool rebuild state with it."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

from sandhold.domain.envelope import Envelope

S = TypeVar("S")


def fold(evolve: Callable[[S, Envelope], S], envelopes: Iterable[Envelope], initial: S) -> S:
    state = initial
    for envelope in envelopes:
        state = evolve(state, envelope)
    return state
