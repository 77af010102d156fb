"""Properties over random histories made by the real deciders.

`drive` plays the live loop: random client requests, host reports and plan
steps, each decided against the current state; accepted events are wrapped,
appended to a log as JSON (as JetStream holds them) and applied with `evolve`.
The properties then hold that log against what the live loop saw.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeVar, cast

import msgspec
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from sandhold.domain import events as ev
from sandhold.domain import requests as rq
from sandhold.domain import saver as policy
from sandhold.domain import saves as sv
from sandhold.domain.commands import END_STATES
from sandhold.domain.envelope import Envelope, wrap
from sandhold.domain.errors import Rejected
from sandhold.domain.fold import fold
from sandhold.domain.reconcile import ChooseHost, plan
from sandhold.domain.reports import HostReport, decide_report
from sandhold.domain.sandbox import Sandbox, decide, evolve

from .history import CREATE_KEY, HOST_A, HOST_B, SID, T0, apply, cmd

SETTINGS = settings(
    max_examples=200,
    deadline=None,
    database=None,  # no example database: every run explores afresh, nothing is saved
    suppress_health_check=[HealthCheck.too_slow],
)
HOSTS = (HOST_A, HOST_B)
# Fourteen fresh keys and two reused ones, so retries and conflicts happen too.
KEYS = (*(f"k{i}" for i in range(14)), "k0", CREATE_KEY)
ARGVS = (["true"], ["echo", "hi"])
MEMORY = (None, 64 * 1024 * 1024)
# Sixteen entries each, one per choice, weighted towards the common cases. A
# delete ends a history, so it is rarer still (see `read_request`), and a host
# rarely reports a deletion nobody asked for.
REQUEST_KINDS = (
    ("run",) * 5 + ("cancel",) * 2 + ("start",) * 3 + ("stop",) * 3 + ("create",) + ("delete",) * 2
)
REPORT_KINDS = (
    *(("starting",) * 2 + ("started",) * 3 + ("start_failed",) + ("stopped",) * 2 + ("deleted",)),
    *(("cmd_started",) * 3 + ("cmd_ended",) * 4),
)
assert len(REQUEST_KINDS) == len(REPORT_KINDS) == 16
END_STATE_LIST = sorted(END_STATES)
T = TypeVar("T")
ENCODER = msgspec.json.Encoder()
DECODER = msgspec.json.Decoder(Envelope)


@dataclass
class Trace:
    log: list[bytes] = field(default_factory=list)  # every appended envelope, as JSON
    # states[n] is the live state once the first n envelopes were applied
    states: list[Sandbox | None] = field(default_factory=lambda: [None])

    @property
    def state(self) -> Sandbox | None:
        return self.states[-1]

    def append(self, events: list[ev.AnyEvent], step: int, actor: str, cause: str) -> None:
        envelopes = wrap(
            events,
            aggregate_id=SID,
            id_base=f"step-{step}",
            actor=actor,
            causation_id=cause,
            correlation_id=cause,
            time=T0 + step / 7,  # times that are not round numbers
            trace_id=None if step % 2 else f"trace-{step}",
        )
        for envelope in envelopes:
            self.log.append(ENCODER.encode(envelope))
            self.states.append(evolve(self.state, envelope))


# A history is drawn as bytes, six a step, each read as a choice in 0..15: one
# cheap draw per example keeps hypothesis fast, and shrinking the bytes towards
# zero shrinks a failing history towards healthy progress (choice 0).
Choice = tuple[int, int, int, int, int, int]


def choices_of(raw: bytes) -> list[Choice]:
    return [cast(Choice, tuple(b % 16 for b in raw[i : i + 6])) for i in range(0, len(raw) - 5, 6)]


STEPS = st.binary(min_size=6 * 20, max_size=6 * 60).map(choices_of)
# Longer, for histories whose saves run their course (`SAVES_MIX`): a save takes
# four steps to complete, and retention needs several completed.
LONG_STEPS = st.binary(min_size=6 * 60, max_size=6 * 150).map(choices_of)
CHOICE = st.binary(min_size=6, max_size=6).map(lambda raw: choices_of(raw)[0])
MEMORY_CHOICE = st.integers(0, 1)


def pick(options: Sequence[T], n: int) -> T:
    return options[n % len(options)]


def read_request(state: Sandbox, choice: Choice) -> rq.AnyRequest:
    _, kind, key_n, tenant_n, detail, _ = choice
    key = pick(KEYS, key_n)
    tenant = "intruder" if tenant_n == 15 else "default"  # now and then, another tenant
    match pick(REQUEST_KINDS, kind):
        case "create":
            return rq.CreateSandbox(key=CREATE_KEY, memory_limit_bytes=pick(MEMORY, detail))
        case "start":
            if detail >= 12 and len(state.requests) > 1:
                # A late start superseded by an early request (decision 082): a key
                # of its own, and one of the oldest the sandbox was sent (the first
                # moved to fingerprints, decision 085).
                early = list(state.requests)[1 + detail % 2 if len(state.requests) > 2 else 1]
                return rq.StartSandbox(
                    key=f"late-{key}", tenant=tenant, sandbox_id=SID, superseded_by=(early,)
                )
            return rq.StartSandbox(key=key, tenant=tenant, sandbox_id=SID)
        case "stop":
            return rq.StopSandbox(key=key, tenant=tenant, sandbox_id=SID)
        case "delete" if detail < 4:  # otherwise it reads as a run
            return rq.DeleteSandbox(key=key, tenant=tenant, sandbox_id=SID)
        case "run" | "delete":
            return rq.RunCommand(key=key, tenant=tenant, sandbox_id=SID, argv=pick(ARGVS, detail))
        case _:
            command_id = pick([*state.commands, cmd("never-run")], detail)
            return rq.CancelCommand(key=key, tenant=tenant, sandbox_id=SID, command_id=command_id)


def natural_report(state: Sandbox) -> tuple[str, str] | None:
    """The report a healthy host would send next, and the command it is about."""
    for command in state.commands.values():
        if command.state == "dispatched":
            return "cmd_started", command.id
        if command.state == "running":
            return "cmd_ended", command.id
    phase_report = {"placed": "starting", "starting": "started", "stopping": "stopped"}
    if state.phase in phase_report:
        return phase_report[state.phase], ""
    if state.delete_requested and state.phase in ("stopped", "failed"):
        return "deleted", ""
    return None


def read_report(state: Sandbox, choice: Choice, *, host: str | None, generation: int) -> HostReport:
    """A report of any kind; `host` None is only used where the event allows it.

    Most kinds read as the report a healthy host would send next, so that
    histories get deep (commands that run and end, restarts) rather than stall.
    """
    _, kind_n, _, _, command_n, detail = choice
    kind = pick(REPORT_KINDS, kind_n)
    command_id = pick([*state.commands, cmd("never-run")], command_n)
    natural = natural_report(state)
    if natural is not None and kind_n < 12:
        kind, command_id = natural[0], natural[1] or command_id
    str_host = host if host is not None else HOST_A
    match kind:
        case "starting":
            return ev.SandboxStarting(host=str_host, generation=generation)
        case "started":
            return ev.SandboxStarted(host=str_host, generation=generation, capabilities={"a": "1"})
        case "start_failed":
            return ev.SandboxStartFailed(host=str_host, generation=generation, reason="no image")
        case "stopped":
            return ev.SandboxStopped(host=host, generation=generation)
        case "deleted":
            return ev.SandboxDeleted(host=host, generation=generation)
        case "cmd_started":
            return ev.CommandStarted(
                command_id=command_id, host=str_host, generation=generation, pid=1000 + detail
            )
        case _:
            # Now and then its host found the files as the last completed save
            # holds them (decision 078), at the current count or a stale one.
            latest = state.last_completed_save
            held = latest is not None and detail % 3 == 0
            return ev.CommandEnded(
                files_of=latest.id if held and latest is not None else None,
                files_at=state.activity - detail % 2 if held else -1,
                command_id=command_id,
                state=pick(END_STATE_LIST, detail),
                exit_code=pick([None, 0, 1, 137], detail // 2),
                reason=pick(["", "done", "ünïcödé"], detail),
                host=host,
                generation=generation,
                output_kept=pick([{}, {"stdout": 10, "stderr": 0}], detail // 3),
                output_complete=detail % 2 == 0,
            )


SAVE_STEPS = (
    *("due", "due", "due", "snapshot"),  # the saver's schedule, a client's Snapshot
    *("captured", "captured", "uploaded", "uploaded", "unchanged"),  # the host
    *("verified", "verified", "verified"),  # the saver
    *("failed", "timed_out", "expired", "delete_snapshot"),  # the host or verifying; retention
)
assert len(SAVE_STEPS) == 16


def save_step(state: Sandbox, choice: Choice, step: int) -> tuple[list[ev.AnyEvent], str]:
    """A step of a save's life, decided as the saver, a client or the host
    decides it: requested (on schedule or as a Snapshot), captured, uploaded,
    found unchanged or failed on the host, verified or failed by the saver,
    timed out, expired by retention. Refusals leave nothing, as live."""
    _, kind_n, save_n, key_n, detail, _ = choice
    kind = pick(SAVE_STEPS, kind_n)
    now = T0 + step / 7
    under_way = state.saves_under_way()
    save = pick(under_way, save_n) if under_way else None
    if save is not None and kind in ("captured", "uploaded", "verified"):
        # Mostly the step that moves the save on, so that saves complete (and
        # then expire, or are confirmed by a capture that finds nothing changed).
        kind = {"requested": pick(["captured", "unchanged"], detail), "captured": "uploaded"}.get(
            save.state, "verified"
        )
    try:
        match kind:
            case "due":
                return policy.due_save(state, now=now + 10_000, cause=f"tick-{step}"), "saver"
            case "snapshot":
                name = f"snap-{key_n % 4}"
                request = rq.SnapshotSandbox(
                    key=f"s{step}", tenant="default", sandbox_id=SID, name=name
                )
                return decide(state, request), "client"
            case "verified" if save is not None:
                return policy.verified(state, save.id, [], total_bytes=10, files=1), "saver"
            case "failed" if save is not None and save.state == "uploaded" and detail % 2:
                problems = ["a chunk is missing"]
                return policy.verified(state, save.id, problems, total_bytes=10, files=1), "saver"
            case "delete_snapshot":  # a client's, of one of its Snapshots (or of any save)
                save_id = pick([*state.snapshot_ids, *state.saves, "sv-0000000000000000"], key_n)
                request = rq.DeleteSnapshot(
                    key=f"d{step}", tenant="default", sandbox_id=SID, save_id=save_id
                )
                return decide(state, request), "client"
            case "timed_out":
                return policy.timed_out(state, now=now, timeout_s=1 + detail), "saver"
            case "expired":
                return policy.expired(state, keep_last=1 + detail % 2), "saver"
            case _ if save is not None and save.host is not None:
                report = save_report(kind, save, quiet=detail % 4 == 0)
                return decide_report(state, report), "host-agent"
            case _:
                return [], "saver"
    except Rejected:
        return [], "saver"


def save_report(kind: str, save: sv.SaveRecord, *, quiet: bool) -> HostReport:
    captured, uploaded, unchanged, failed = save_reports_of(
        save.id, host=save.host or HOST_A, generation=save.generation, quiet=quiet
    )
    return {"captured": captured, "uploaded": uploaded, "unchanged": unchanged}.get(kind, failed)


def save_reports_of(
    save_id: str, *, host: str, generation: int, quiet: bool = False
) -> tuple[ev.SaveCaptured, ev.SaveUploaded, ev.SaveUnchanged, ev.SaveFailed]:
    """A host's reports of a save: captured, uploaded, found unchanged, failed."""
    return (
        ev.SaveCaptured(
            save_id=save_id, host=host, generation=generation, freeze_ms=1.0,
            freeze_method="cgroup", quiet=quiet,
        ),
        ev.SaveUploaded(
            save_id=save_id, host=host, generation=generation, total_bytes=10, files=1,
            uploaded_bytes=10, uploaded_chunks=1, manifest_bytes=100, duration_ms=1.0,
            manifest_digest="d" * 64,
        ),
        ev.SaveUnchanged(
            save_id=save_id, host=host, generation=generation, freeze_ms=1.0,
            freeze_method="cgroup", quiet=quiet,
        ),
        ev.SaveFailed(
            save_id=save_id, stage="upload", reason="the store refused", host=host,
            generation=generation,
        ),
    )  # fmt: skip


# Who acts at each step (by the step's first choice).
MIX = ("plan", "report", "request", "saves", "report", "request", "saves")
# Histories of a sandbox whose saves run their course (they need it running
# for a while): mostly the saves' steps.
SAVES_MIX = ("saves", "saves", "report", "saves", "saves", "request", "saves", "plan")


def drive(memory_n: int, steps: Sequence[Choice], mix: Sequence[str] = MIX) -> Trace:
    """Play the live loop over a drawn history; refusals leave no trace, as live."""
    trace = Trace()
    create = rq.CreateSandbox(key=CREATE_KEY, memory_limit_bytes=pick(MEMORY, memory_n))
    trace.append(decide(None, create), 0, "client", create.key)
    if mix == SAVES_MIX:  # from running on host-a
        assert trace.state is not None
        trace.append(plan(trace.state, choose(HOST_A)).events, 0, "scheduler", "plan")
        for report in (ev.SandboxStarting, ev.SandboxStarted):
            trace.append([report(host=HOST_A, generation=1)], 0, "host-agent", "report")
    for step, choice in enumerate(steps, start=1):
        state = trace.state
        assert state is not None  # created at step 0, never un-created
        match pick(mix, choice[0]):
            case "saves":
                events, actor = save_step(state, choice, step)
                trace.append(events, step, actor, "saves")
            case "request":
                request = read_request(state, choice)
                with contextlib.suppress(Rejected):
                    trace.append(decide(state, request), step, "client", request.key)
            case "plan":
                chosen = pick([None, *HOSTS], choice[1])
                trace.append(plan(state, choose(chosen)).events, step, "scheduler", "plan")
            case _:
                # Mostly from the current placement; sometimes from a stale or unknown one.
                # A host-agent always names itself, so a never-placed sandbox hears only stale ones.
                current = state.host or HOST_A
                host = pick([current, current, current, *HOSTS], choice[2])
                offset = pick([0, 0, 0, -1, 1], choice[3])
                report = read_report(state, choice, host=host, generation=state.generation + offset)
                with contextlib.suppress(Rejected):
                    trace.append(decide_report(state, report), step, "host-agent", "report")
    return trace


def choose(host: str | None) -> ChooseHost:
    return lambda _: host


@SETTINGS
@given(MEMORY_CHOICE, STEPS)
def test_replaying_any_prefix_of_the_log_gives_the_live_state(
    memory_n: int, steps: list[Choice]
) -> None:
    trace = drive(memory_n, steps)
    replayed = [DECODER.decode(line) for line in trace.log]
    for n, live in enumerate(trace.states):
        assert fold(evolve, replayed[:n], None) == live, f"replay of the first {n} envelopes"


@SETTINGS
@given(MEMORY_CHOICE, STEPS, CHOICE, st.integers(-2, 40))
def test_a_report_from_any_other_generation_is_always_rejected(
    memory_n: int, steps: list[Choice], report_choice: Choice, generation: int
) -> None:
    state = drive(memory_n, steps).state
    assert state is not None
    assume(generation != state.generation)
    host = pick([state.host, *HOSTS], report_choice[2])
    report = read_report(state, report_choice, host=host, generation=generation)
    with pytest.raises(Rejected) as refusal:
        decide_report(state, report)
    assert refusal.value.code == "stale_generation"


@SETTINGS
@given(MEMORY_CHOICE, STEPS, CHOICE)
def test_a_report_from_another_host_is_always_rejected(
    memory_n: int, steps: list[Choice], report_choice: Choice
) -> None:
    state = drive(memory_n, steps).state
    assert state is not None
    host = pick([h for h in (*HOSTS, "host-z") if h != state.host], report_choice[2])
    report = read_report(state, report_choice, host=host, generation=state.generation)
    with pytest.raises(Rejected) as refusal:
        decide_report(state, report)
    assert refusal.value.code == "stale_generation"


@SETTINGS
@given(MEMORY_CHOICE, STEPS)
def test_every_live_state_keeps_the_invariants(memory_n: int, steps: list[Choice]) -> None:
    trace = drive(memory_n, steps)
    for before, after in itertools.pairwise(trace.states[1:]):
        assert before is not None and after is not None
        assert after.generation >= before.generation, "a generation never goes back"
        assert before.requests.items() <= after.requests.items(), "a key is never forgotten"
        for command_id, command in before.commands.items():
            assert command_id in after.commands, "a command record survives"
            if command.ended:
                assert after.commands[command_id] == command, "an end is final"
        if before.phase == "deleted":
            assert after.phase == "deleted", "deleted is final"
    for state in trace.states[1:]:
        assert state is not None
        queued = tuple(c.id for c in state.commands.values() if c.state == "queued")
        assert state.queued == queued, "the queued ids are the queued commands, in order"
        first = plan(state, choose(HOST_A))
        assert plan(apply(state, first.events), choose(HOST_A)).events == [], "plan settles"
