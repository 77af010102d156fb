"""A sandbox that ran many commands costs no more per event than a new one:
`evolve` keeps the unended commands and the ended counts as indexes, and the
scheduler's `plan`, recovery's `after_loss` and the views read those instead of
going through every command (issue 15 item 2)."""

from __future__ import annotations

from collections import Counter
from typing import TypeVar

import msgspec
from sandhold.domain import events as ev
from sandhold.domain.pmap import PMap
from sandhold.domain.reconcile import plan
from sandhold.domain.recovery import after_loss
from sandhold.domain.sandbox import LostInfo, Sandbox
from sandhold.domain.views import sandbox_view

from .history import (
    HOST_A,
    RUNNING,
    T0,
    Step,
    apply,
    cancel,
    cmd,
    command_ended,
    command_started,
    dispatched,
    envelopes_for,
    evolve,
    given_sandbox,
    queued,
    run,
    stop,
    stopped,
)

V = TypeVar("V")


def _host(_: Sandbox) -> str | None:
    return HOST_A


def _ran(n: int, *, first: int = 0) -> list[Step]:
    """`n` commands that each ran to an end, with varied end states."""
    ends = ["exited", "interrupted", "timed_out", "exited"]
    steps: list[Step] = []
    for i in range(first, first + n):
        key = f"run-{i}"
        steps += [
            run(key),
            dispatched(key),
            command_started(key),
            command_ended(key, state=ends[i % len(ends)]),
        ]
    return steps


class _NotGoneThrough(PMap[str, V]):
    """A map (its commands, its saves) that fails the test if anything goes
    through all of it."""

    def values(self):  # type: ignore[override]
        raise AssertionError("went through every entry")

    def items(self):  # type: ignore[override]
        raise AssertionError("went through every entry")

    def __iter__(self):  # type: ignore[override]
        raise AssertionError("went through every entry")


def _guarded(state: Sandbox) -> Sandbox:
    """`state` with commands and saves that may be looked up, never gone through."""
    return msgspec.structs.replace(
        state,
        commands=_NotGoneThrough(state.commands.items()),
        saves=_NotGoneThrough(state.saves.items()),
    )


def test_the_indexes_agree_with_the_commands_after_every_event():
    steps: list[Step] = [
        *RUNNING,
        *_ran(6),
        run("queued-then-cancelled"),
        run("left-running"),
        dispatched("left-running"),
        command_started("left-running"),
        run("left-dispatched"),
        dispatched("left-dispatched"),
        cancel(cmd("queued-then-cancelled")),
        command_ended("queued-then-cancelled", state="not_launched", exit_code=None),
        queued("left-queued"),
        stop(),
        stopped(),
    ]
    state = None
    for envelope in envelopes_for(steps):
        state = evolve(state, envelope)
        assert state is not None
        commands = list(state.commands.values())
        assert state.unended_ids == tuple(c.id for c in commands if not c.ended)
        assert state.unended == sum(not c.ended for c in commands)
        assert state.command_counts() == Counter(c.state for c in commands)
    assert state is not None
    assert state.command_counts() == {
        "exited": 3,
        "interrupted": 2,
        "timed_out": 1,
        "not_launched": 1,
        "running": 1,
        "dispatched": 1,
        "queued": 1,
    }


def test_an_ended_command_does_not_change_again():
    state = given_sandbox(*RUNNING, *_ran(1))
    ended = state.commands[cmd("run-0")]
    late = command_ended("run-0", state="unknown", exit_code=None)
    again = given_sandbox(*RUNNING, *_ran(1), late, command_started("run-0"))
    assert again.commands[cmd("run-0")].state == ended.state == "exited"
    assert again.command_counts() == {"exited": 1}
    assert again.unended_ids == ()


def test_planning_a_sandbox_that_ran_many_commands_looks_only_at_the_unended_ones():
    state = given_sandbox(*RUNNING, *_ran(200), run("next"), dispatched("next"))
    planned = plan(_guarded(state), _host)
    assert [w.command_id for _, w in planned.work if hasattr(w, "command_id")] == [cmd("next")]


def test_a_loss_ends_only_the_unended_commands_without_going_through_the_rest():
    steps = [*RUNNING, *_ran(200), run("last"), dispatched("last"), command_started("last")]
    state = given_sandbox(*steps)
    lost = msgspec.structs.replace(
        state,
        phase="lost",
        lost=LostInfo(host=HOST_A, generation=1, last_renewal_at=T0, fence_at=T0),
    )
    ends = after_loss(_guarded(lost))
    assert [(e.command_id, e.state) for e in ends if isinstance(e, ev.CommandEnded)] == [
        (cmd("last"), "infrastructure_lost")
    ]


def test_the_view_counts_commands_without_going_through_them():
    state = given_sandbox(*RUNNING, *_ran(200), queued("next"))
    view = sandbox_view(_guarded(state), now=T0 + 10_000)
    assert view.commands == {"exited": 100, "interrupted": 50, "timed_out": 50, "queued": 1}


def test_a_stopped_sandbox_ends_its_unreported_commands_without_going_through_the_rest():
    steps = [*RUNNING, *_ran(200), run("last"), dispatched("last"), stop(), stopped()]
    planned = plan(_guarded(given_sandbox(*steps)), _host)
    ends = [(e.command_id, e.state) for e in planned.events if isinstance(e, ev.CommandEnded)]
    assert ends == [(cmd("last"), "unknown")]


def test_a_command_queued_again_under_an_ended_ones_id_moves_its_count():
    """Not something `decide` does (a key seen before is answered as before),
    but `evolve` takes any log: the counts then still match the commands."""
    state = given_sandbox(*RUNNING, *_ran(1))
    queued_again = next(
        e.event
        for e in envelopes_for([*RUNNING, *_ran(1)])
        if isinstance(e.event, ev.CommandQueued)
    )
    again = apply(state, [queued_again])
    assert again.command_counts() == {"dispatched": 1}  # (queued on a running sandbox: 098)
    assert again.ended_counts == {}
    assert again.unended_ids == (cmd("run-0"),)
