"""The ports services are written against: what they need of the event log, the
output log and the clock, as protocols. The NATS implementations are
`AggregateStore` (store.py) and `OutputLog` (output.py); a test or a new
backend provides its own without touching the code that uses them. (The
host's driver port is `hostagent.driver.port.SandboxDriver`.)"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol, TypeVar

from sandhold.bus.store import Decide, Executed

S = TypeVar("S")


class Aggregates(Protocol[S]):
    """Folded aggregates of one kind, and deciding on them behind the fence."""

    def get(self, aggregate_id: str) -> tuple[S | None, int]: ...

    def ids(self) -> list[str]: ...

    def listen(self, callback: Callable[[str], None]) -> None: ...

    def trace_of(self, aggregate_id: str) -> str | None: ...

    async def sync(self, aggregate_id: str) -> tuple[S | None, int]: ...

    async def read_whole(self, aggregate_id: str) -> tuple[S | None, int]: ...

    async def follow_up(self, aggregate_id: str, decide: Decide[S], *, why: str) -> Executed[S]: ...

    async def execute(
        self,
        aggregate_id: str,
        decide: Decide[S],
        *,
        id_base: str,
        causation_id: str,
        correlation_id: str,
        trace_id: str | None = None,
        attempts: int = 20,
    ) -> Executed[S]: ...


class OutputReader(Protocol):
    """A command's kept output."""

    async def tail(
        self, sandbox_id: str, command_id: str, *, limit: int, stream: str = "stdout"
    ) -> bytes: ...

    async def last_written_at(self, sandbox_id: str, command_id: str) -> float | None: ...


class Clock(Protocol):
    def now(self) -> float:
        """Seconds since the epoch."""
        ...


class SystemClock:
    def now(self) -> float:
        return time.time()


SYSTEM_CLOCK = SystemClock()
