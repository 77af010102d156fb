"""Retries: which errors deserve another attempt, and how long to wait first.

Pure on purpose: the caller draws the jitter (``random.random()``) and passes it
in, so the delay actually chosen can be recorded in the attempt's event and a
replay never needs a random number generator.
"""

from __future__ import annotations

import math
from typing import Literal, Protocol, assert_never

ErrorClass = Literal["network", "placement", "permanent"]
"""network: the remote was unreachable or hung up (transient).
placement: a race for a host or a slot (transient, fewer tries).
permanent: trying again cannot help (bad ref, missing program, bad manifest)."""


class RetryBudgets(Protocol):
    """Retries per transient class; the task manifest's `RetryPolicy` is one.

    Permanent errors have no field: they are never retried, whatever a manifest says.
    """

    @property
    def network(self) -> int: ...

    @property
    def placement(self) -> int: ...


DEFAULT_NETWORK_RETRIES = 3
DEFAULT_PLACEMENT_RETRIES = 2


def retry_budget(cls: ErrorClass, policy: RetryBudgets | None = None) -> int:
    """How many retries (after the first attempt) an error of class `cls` earns.

    Without a `policy`, the defaults: network 3, placement 2.
    """
    match cls:
        case "network":
            return DEFAULT_NETWORK_RETRIES if policy is None else policy.network
        case "placement":
            return DEFAULT_PLACEMENT_RETRIES if policy is None else policy.placement
        case "permanent":
            return 0
        case _:
            assert_never(cls)


def backoff_delay(attempt: int, *, base_s: float, cap_s: float, jitter: float) -> float:
    """Seconds to wait before retrying after failed attempt number `attempt` (1-based).

    The envelope doubles per attempt from `base_s` up to `cap_s`; the delay is
    "equal jitter" within it: somewhere in ``[envelope / 2, envelope]``. Half
    the envelope is kept as a floor so a retry always actually backs off, while
    the other half spreads retries that failed together (e.g. one git server
    going down under many tasks).

    Args:
        attempt: the attempt that just failed, counting from 1.
        base_s: the envelope after the first failure.
        cap_s: the envelope never grows past this.
        jitter: a number in [0, 1) drawn by the caller.

    Raises:
        ValueError: for an attempt below 1, negative times, a cap below the
            base, an infinite cap, or a jitter outside [0, 1).
    """
    if attempt < 1:
        raise ValueError(f"attempt counts from 1, got {attempt}")
    if not (0 <= base_s <= cap_s and math.isfinite(cap_s)):
        raise ValueError(f"need 0 <= base_s <= cap_s, got base_s={base_s} cap_s={cap_s}")
    if not 0 <= jitter < 1:
        raise ValueError(f"jitter must be in [0, 1), got {jitter}")
    try:
        envelope = min(cap_s, math.ldexp(base_s, attempt - 1))  # base_s * 2 ** (attempt - 1)
    except OverflowError:  # far past any cap
        envelope = cap_s
    return envelope * (1 + jitter) / 2
