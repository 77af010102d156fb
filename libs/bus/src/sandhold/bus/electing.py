"""Asking a cluster that is electing a leader: again, until it answers.

When the node leading a stream dies (`kill -9`, a machine lost), its followers
wait 4 to 9 s without a heartbeat before one campaigns (nats-server's raft
election timeout, not configurable), and until then the stream's requests
time out or are answered "unavailable" / "no responders". Whatever must get
through an election asks again, briefly, until `ELECTION_WAIT_S` has passed:
one full timeout, a second round, and the time to answer. Each attempt is
short, so the answer comes within a moment of the new leader, not at the next
multiple of a five-second client timeout.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

import nats.errors
from nats.js.errors import NoStreamResponseError, ServiceUnavailableError

T = TypeVar("T")

# How long a request is offered to a stream that has no leader.
ELECTION_WAIT_S = 30.0
# nats-py's own timeout for a JetStream request: no attempt is cut shorter in the end.
NATS_TIMEOUT_S = 5.0
# What a stream (or the JetStream API) answers while it has no leader.
ELECTING: tuple[type[Exception], ...] = (
    TimeoutError,  # nats-py's, and an attempt's own (`attempt_s`)
    nats.errors.NoRespondersError,
    NoStreamResponseError,
    ServiceUnavailableError,
)


def attempt_timeouts(first_s: float) -> Iterator[float]:
    """`first_s`, then each a quarter longer, up to nats-py's own five seconds."""
    timeout = first_s
    while True:
        yield timeout
        timeout = min(NATS_TIMEOUT_S, timeout * 1.25)


async def patiently(
    call: Callable[[], Awaitable[T]],
    *,
    wait_s: float | None = ELECTION_WAIT_S,
    pause_s: float = 0.1,
    attempt_s: float | None = None,
    on_first_wait: Callable[[Exception], None] | None = None,
    also: Callable[[Exception], bool] | None = None,
) -> T:
    """`await call()`, asked again after `pause_s` while it fails as an election
    does, for up to `wait_s` seconds (None: for as long as it takes); then the
    last error is raised. `on_first_wait` hears the first such failure (to say
    what is being waited for, once). `also` names other failures that pass
    the same way (a cluster still forming: a peer not yet joined).

    `attempt_s` cuts the first attempt short (nats-py's own timeout is five
    seconds), each next one a quarter longer up to those five: a request lost
    on a connection that was just moving to another node, or made while the
    stream had no leader, is asked again within a moment of the new leader,
    and one that is merely slow (a loaded machine) still gets its five seconds.
    Only for a call that may be made twice: a read, a publish with a message
    id, a consumer of one's own that nothing listens to if made twice. (A call
    that takes a timeout of its own is cheaper given `attempt_timeouts`: no
    task is made per attempt, which counts on the append path.)"""
    loop = asyncio.get_running_loop()
    deadline = None if wait_s is None else loop.time() + wait_s
    timeouts = attempt_timeouts(attempt_s) if attempt_s is not None else None
    while True:
        try:
            if timeouts is None:
                return await call()
            # (Not `wait_for`: on 3.11 it swallows a cancellation that comes
            # with the answer, decision 080; `timeout` never does.)
            async with asyncio.timeout(next(timeouts)):
                return await call()
        except Exception as err:
            if not isinstance(err, ELECTING) and not (also is not None and also(err)):
                raise
            if deadline is not None and loop.time() > deadline:
                raise
            if on_first_wait is not None:
                on_first_wait(err)
                on_first_wait = None
            await asyncio.sleep(pause_s)
