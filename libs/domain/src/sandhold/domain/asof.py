"""A point in the log, as `replay --at` and the console's history take it: a
stream sequence or a moment; and the records up to it."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import TypeVar

from sandhold.domain.envelope import Envelope, Recorded
from sandhold.domain.fold import fold

S = TypeVar("S")  # an aggregate's folded state


def parse_point(at: str | None) -> tuple[int | None, float | None]:
    """A stream sequence (digits) or an ISO-8601 time (UTC unless it says
    otherwise), as (seq, None) or (None, unix time); ValueError if neither."""
    if at is None:
        return None, None
    if at.isascii() and at.isdigit() and len(at) <= 19:
        return int(at), None
    try:
        moment = datetime.fromisoformat(at.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"a sequence number or an ISO time, not {at!r}") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return None, moment.timestamp()


def until(records: list[Recorded], seq: int | None, moment: float | None) -> list[Recorded]:
    """The records at or before the point (all of them for no point)."""
    return [
        r
        for r in records
        if (seq is None or r.seq <= seq) and (moment is None or r.envelope.time <= moment)
    ]


def state_at(
    evolve: Callable[[S | None, Envelope], S | None],
    records: list[Recorded],
    seq: int | None,
    moment: float | None,
) -> tuple[S, Recorded] | None:
    """The aggregate folded from its records up to the point, with the record it
    is as of (the last one folded); None if it did not exist yet. What `replay
    --at` prints and the console's history shows: the services' own evolve."""
    kept = until(records, seq, moment)
    state = fold(evolve, (r.envelope for r in kept), None)
    return None if state is None else (state, kept[-1])
