"""The sandbox actor: its state, `evolve`, and `decide` for client requests.

A sandbox and its commands are one aggregate (subject `<prefix>.ev.sandbox.<id>`),
so one expected-sequence check fences every change to either. Everything
here is pure: time comes in as an argument and nothing does I/O.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable
from itertools import islice
from typing import Literal, assert_never

import msgspec
from sandhold.domain import events as ev
from sandhold.domain import fingerprints
from sandhold.domain import requests as rq
from sandhold.domain import saves as sv
from sandhold.domain.commands import END_STATES, CommandState
from sandhold.domain.envelope import Envelope
from sandhold.domain.errors import Rejected
from sandhold.domain.idempotency import seen_before
from sandhold.domain.pmap import EMPTY, PMap

Phase = Literal[
    "pending",  # created (or asked to start again), waiting for a host
    "placed",  # a host was chosen and told
    "starting",  # the host is preparing it
    "running",
    "stopping",
    "stopped",
    "failed",  # the host could not start it
    "deleted",
    "lost",  # its host failed; files are as of the last completed save
    "recovering",  # asked to come back: waits for the fence, then a new placement
]

# Phases in which a command is accepted (it waits in the queue until the sandbox runs).
LAUNCHABLE_PHASES: frozenset[str] = frozenset(
    {"pending", "placed", "starting", "running", "lost", "recovering"}
)

# Phases in which the sandbox holds a place on a host.
ACTIVE_PHASES: frozenset[str] = frozenset({"placed", "starting", "running", "stopping"})

# A sandbox with no command queued or running, none ended and no touch for this
# long is stopped with its final save (docs/saves.md, "Idle and cold starts").
DEFAULT_IDLE_TIMEOUT_S = 1800.0


class LostInfo(msgspec.Struct, frozen=True, kw_only=True):
    host: str
    generation: int
    last_renewal_at: float
    fence_at: float
    fenced: bool = False
    cause: Literal["host", "files_gone"] = "host"  # as `sandbox.lost` says


class RecoveredFrom(msgspec.Struct, frozen=True, kw_only=True):
    """Which files a recovery brought back, and how far they were behind the failure."""

    source: Literal["save", "snapshot", "base image"]
    save_id: str | None = None
    completed_at: float | None = None
    captured_at: float | None = None
    behind_failure_s: float | None = None
    lost_host: str = ""
    lost_generation: int = 0


# A sandbox's Connections travel in one host instruction (NATS's 1 MiB payload).
MAX_CONNECTIONS = 16
MAX_CONNECTIONS_BYTES = 128 * 1024


class Connection(msgspec.Struct, frozen=True, kw_only=True):
    """A Connection as the log knows it: where its value is kept, never the value."""

    value_id: str
    size: int
    revision: int  # the revision that set it


class StartRecord(msgspec.Struct, frozen=True, kw_only=True):
    """The latest start: how long it took from the ask, and what it restored."""

    requested_at: float  # the start request (or the placement's creation)
    started_at: float
    restore: ev.RestoreReport | None = None


class Command(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    state: CommandState
    argv: list[str]
    request_key: str
    request_digest: str
    cwd: str | None = None
    env: dict[str, str] = {}
    timeout_s: float | None = None
    kill_grace_s: float = 5.0
    user: str = "user"
    secret_names: list[str] = []
    host: str | None = None
    generation: int = 0
    pid: int | None = None
    exit_code: int | None = None
    signal: int | None = None
    reason: str = ""
    cancel_requested: bool = False
    output_kept: dict[str, int] = {}
    output_complete: bool = True
    queued_at: float = 0.0
    # Queued while its sandbox was stopped for being idle: it waits for a cold start.
    cold: bool = False
    # The start a cold command waited for (a later reap and wake is not its start).
    woke_with: StartRecord | None = None
    started_at: float | None = None  # when its host reported it running
    ended_at: float | None = None

    @property
    def ended(self) -> bool:
        return self.state in END_STATES


class Sandbox(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    tenant: str
    phase: Phase
    created_at: float
    memory_limit_bytes: int | None = None
    host: str | None = None
    generation: int = 0
    reason: str = ""
    delete_requested: bool = False
    capabilities: dict[str, str] = {}
    save_interval_s: float = sv.DEFAULT_SAVE_INTERVAL_S
    stop_deadline_s: float = 60.0
    source_snapshot_id: str | None = None
    source_snapshot_digest: str = ""
    source_sandbox_id: str | None = None
    running_since: float | None = None
    final_save_id: str | None = None  # the final save of the latest stop
    saves: PMap[str, sv.SaveRecord] = EMPTY
    recovery_policy: Literal["lazy", "eager"] = "lazy"
    network: str = "none"
    image: str | None = None
    pids_limit: int | None = None
    cpu_limit: float | None = None
    disk_limit_bytes: int | None = None
    lost: LostInfo | None = None  # set from the loss until a recovery has started it
    recovered_from: RecoveredFrom | None = None  # of the latest recovery
    restore_save_id: str | None = None  # what the current placement restores, if needed
    # Persistent maps: each event replaces an entry without copying the rest.
    commands: PMap[str, Command] = EMPTY
    # The ids of its queued commands, in order: what `plan` looks at on every
    # change, without going through every command the sandbox ever ran.
    queued: tuple[str, ...] = ()
    # idempotency key -> digest of the request body that used it (compacted: the
    # newest; the older ones in `forgotten_keys`, decision 085)
    requests: PMap[str, str] = EMPTY
    # Compacted away from `requests`: sorted runs of their fingerprints (`fingerprints`).
    forgotten_keys: tuple[bytes, ...] = ()
    connections: dict[str, Connection] = {}  # name -> where its value is kept
    connections_revision: int = 0  # every set or removal counts one
    # The revision the current placement's host wrote (None: nothing yet).
    connections_delivered: int | None = None
    # Idle limits (docs/saves.md, "Idle and cold starts"): 0 = never reaped.
    idle_timeout_s: float = 0.0
    last_active_at: float = 0.0  # started, a command queued/started/ended, a touch
    # Retention of a stopped sandbox (decision 074): 0 = kept until deleted; else
    # deleted once stopped or failed for this long, counted from `settled_at`.
    keep_stopped_s: float = 0.0
    settled_at: float | None = None  # when it last became stopped or failed
    # Its commands not ended (queued, dispatched or running), in the order they
    # were queued: what the scheduler's passes, recovery and views look at, so a
    # sandbox that ran 10,000 commands costs no more per event than a new one.
    unended_ids: tuple[str, ...] = ()
    # How many of its commands ended in each end state (views count without
    # going through every command).
    ended_counts: dict[str, int] = {}
    # Counts what can change its files (a placement started, a command queued,
    # started or ended, connections delivered or dropped): a save requested at
    # the same count, captured quiet, still holds them (`unchanged_since`).
    activity: int = 0
    # The saves requested since the count last moved that may be quiet: the next
    # move stamps their `changed_at` (from then on their files may differ from
    # the sandbox's).
    requested_since_activity: tuple[str, ...] = ()
    start_requested_at: float | None = None
    last_start: StartRecord | None = None
    # Indexes over the saves, kept in step with them by `_with_save` (decision
    # 055): the saver's tick and reactions, recovery and the views read these, so
    # a sandbox with 10,000 saves behind it costs no more per event than a new one.
    saves_in_flight: tuple[str, ...] = ()  # requested, captured or uploaded; oldest first
    saves_completed: tuple[str, ...] = ()  # completed, not expired: retention bounds them
    snapshot_ids: tuple[str, ...] = ()  # every Snapshot taken of it, oldest first
    # The failed attempts requested after the newest completed (or since expired)
    # save, by request time: a streak that makes save health "failing"; and that
    # save's request time, which a later attempt must pass to count.
    save_failures: tuple[str, ...] = ()
    save_streak_after: float | None = None
    # The latest save requested: its generation and time (the saver's interval
    # counts from it while the placement is the same).
    last_save_request: tuple[int, float] | None = None
    # Set by `compact` once it dropped something (a service's cached copy): a
    # decision that reads what it drops is made again on the whole state.
    compacted: bool = False

    @property
    def connections_current(self) -> bool:
        """Whether the placement's files are the Connections as they are now:
        until they are, no command is dispatched (one queued after a `set` sees it)."""
        return self.connections_revision == 0 or (
            self.connections_delivered == self.connections_revision
        )

    @property
    def last_completed_save(self) -> sv.SaveRecord | None:
        return sv.newest_completed(self.saves[i] for i in self.saves_completed)

    def saves_under_way(self) -> list[sv.SaveRecord]:
        """Its saves requested, captured or uploaded, oldest first."""
        return [self.saves[i] for i in self.saves_in_flight]

    def failed_saves(self) -> list[sv.SaveRecord]:
        """The failed attempts since the last save that completed, oldest first."""
        return [self.saves[i] for i in self.save_failures]

    def snapshots(self) -> list[sv.SaveRecord]:
        return [self.saves[i] for i in self.snapshot_ids]

    def named_saves(self) -> PMap[str, sv.SaveRecord]:
        """The saves its indexes and fields name: those under way, completed,
        Snapshots, the failure streak, those waiting to be stamped, the final save
        and the one its placement restores: all its view reads. The rest are
        expired or failed behind it (final: they never change again), however
        many they are."""
        return PMap((i, self.saves[i]) for i in self._named_save_ids())

    def _named_save_ids(self) -> list[str]:
        ids = (
            *self.saves_in_flight,
            *self.saves_completed,
            *self.snapshot_ids,
            *self.save_failures,
            *self.requested_since_activity,
            *(i for i in (self.final_save_id, self.restore_save_id) if i is not None),
        )
        return [i for i in dict.fromkeys(ids) if i in self.saves]

    def restore_point(self) -> str | None:
        """The save a fresh workspace is materialised from: the last completed
        save, else the Snapshot the sandbox was created from, else none (base image)."""
        latest = self.last_completed_save
        return latest.id if latest is not None else self.source_snapshot_id

    def restore_digest(self) -> str:
        """The recorded manifest digest of the save the placement restores ("":
        none recorded, as for a seed or a save made before digests were)."""
        save_id = self.restore_save_id
        if save_id is None:
            return ""
        if save_id in self.saves:
            return self.saves[save_id].manifest_digest
        return self.source_snapshot_digest if save_id == self.source_snapshot_id else ""

    def queued_commands(self) -> list[Command]:
        return [self.commands[cid] for cid in self.queued]

    @property
    def unended(self) -> int:
        """Commands queued, dispatched or running: never idle while any."""
        return len(self.unended_ids)

    def unended_commands(self) -> list[Command]:
        return [self.commands[cid] for cid in self.unended_ids]

    def command_counts(self) -> dict[str, int]:
        """How many of its commands are in each state."""
        counts = dict(self.ended_counts)
        for cid in self.unended_ids:
            # (A state stored without its commands, as the read model's rows
            # are, counts its ended ones only: the rows count the rest.)
            if (command := self.commands.get(cid)) is not None:
                counts[command.state] = counts.get(command.state, 0) + 1
        return counts


def _woken(state: Sandbox, start: StartRecord) -> Sandbox:
    """Cold commands still queued get the start they waited for."""
    for cid in state.queued:
        command = state.commands[cid]
        if command.cold and command.woke_with is None:
            state = _with_command(state, msgspec.structs.replace(command, woke_with=start))
    return state


def _save_requested(state: Sandbox, event: ev.SaveRequested, at: float) -> Sandbox:
    if event.save_id in state.saves:
        return state
    state = _with_save(state, sv.requested(event, at, activity=state.activity))
    return msgspec.structs.replace(
        state, requested_since_activity=(*state.requested_since_activity, event.save_id)
    )


def _save_advanced(state: Sandbox, save_id: str, event: ev.AnyEvent, at: float) -> Sandbox:
    record = state.saves.get(save_id)
    new = sv.advanced(record, event, at) if record is not None else None
    return state if new is None else _with_save(state, new)


def _save_unchanged(state: Sandbox, event: ev.SaveUnchanged, at: float) -> Sandbox:
    """The save ends `unchanged`; its parent, if still the last completed save,
    holds the files as of this capture (decision 067), and may stay quiet from
    here as a save captured now would."""
    before = state.saves.get(event.save_id)
    waited = event.save_id in state.requested_since_activity
    state = _save_advanced(state, event.save_id, event, at)
    record = state.saves.get(event.save_id)
    latest = state.last_completed_save
    if record is None or record == before or record.state != "unchanged":
        return state
    if latest is None or latest.id != record.parent_id:
        return state  # another save completed meanwhile: this capture confirms nothing
    if record.activity < latest.activity:
        # Requested before what confirmed the parent last (a command's end that
        # held the files, decision 078): that says more, and later.
        return state
    state = _with_save(state, sv.confirmed(latest, record))
    if waited and _may_stay_quiet(state.saves[latest.id]):
        # The parent takes the place of this save: the next move of the count
        # stamps it (`held_until`), as it would have stamped this save.
        waiting = tuple(i for i in state.requested_since_activity if i != record.id)
        if latest.id not in waiting:
            waiting = (*waiting, latest.id)
        state = msgspec.structs.replace(state, requested_since_activity=waiting)
    return state


def _snapshot_deleted(state: Sandbox, save_id: str) -> Sandbox:
    """The Snapshot becomes a save like the others (decision 069): its name and
    its place among the Snapshots go; its state and files stay what they are,
    for retention to judge as any save's."""
    record = state.saves.get(save_id)
    if record is None or record.kind != "snapshot":
        return state
    record = msgspec.structs.replace(record, kind="scheduled", snapshot_name=None)
    state = msgspec.structs.replace(
        state,
        saves=state.saves.set(save_id, record),
        snapshot_ids=tuple(i for i in state.snapshot_ids if i != save_id),
    )
    return state


def _with_save(state: Sandbox, record: sv.SaveRecord) -> Sandbox:
    """The save put in (new or moved on), with the indexes that spare a pass over
    all of them kept in step: under way, completed, Snapshots, the failure
    streak and the latest request."""
    before = state.saves.get(record.id)
    moved = before is None or before.state != record.state
    failures, after = state.save_failures, state.save_streak_after
    counted = after is None or record.requested_at > after
    if moved and record.state in ("completed", "unchanged", "expired") and counted:
        # A success later than the attempts before it ends the streak (an
        # unchanged capture too: the last completed save holds the files).
        after = record.requested_at
        failures = tuple(f for f in failures if state.saves[f].requested_at > after)
    elif moved and record.state == "failed" and counted:
        at = bisect_right([state.saves[f].requested_at for f in failures], record.requested_at)
        failures = (*failures[:at], record.id, *failures[at:])
    snapshots, last_request = state.snapshot_ids, state.last_save_request
    waiting = state.requested_since_activity
    if record.id in waiting and not _may_stay_quiet(record):
        waiting = tuple(i for i in waiting if i != record.id)
    if before is None:
        if record.kind == "snapshot":
            snapshots = (*snapshots, record.id)
        latest = (record.generation, record.requested_at)
        last_request = latest if last_request is None else max(last_request, latest)
    return msgspec.structs.replace(
        state,
        saves=state.saves.set(record.id, record),
        saves_in_flight=_indexed(state.saves_in_flight, record.id, record.state in sv.IN_FLIGHT),
        saves_completed=_indexed(state.saves_completed, record.id, record.state == "completed"),
        snapshot_ids=snapshots,
        save_failures=failures,
        save_streak_after=after,
        last_save_request=last_request,
        requested_since_activity=waiting,
    )


def _may_stay_quiet(record: sv.SaveRecord) -> bool:
    """Whether the save's `changed_at` can still matter: only a quiet save's
    does (`held_until`), so one captured otherwise, or failed, is not stamped
    and leaves `requested_since_activity`, which a long command running with
    saves every interval would otherwise grow without end."""
    return record.state == "requested" or (
        record.quiet and record.state not in ("failed", "unchanged")
    )


def _changed(state: Sandbox, at: float) -> Sandbox:
    """Something that can change its files happened at `at`: the saves requested
    since the last such thing are stamped, and the count moves on."""
    for save_id in state.requested_since_activity:
        record = state.saves.get(save_id)
        if record is not None and record.changed_at is None:
            state = _with_save(state, msgspec.structs.replace(record, changed_at=at))
    return msgspec.structs.replace(state, activity=state.activity + 1, requested_since_activity=())


def _files_held(state: Sandbox, save_id: str, generation: int, at: float) -> Sandbox:
    """A command ended and its host found every file as the save `save_id` holds
    them, nothing else running in the sandbox, with nothing recorded since it
    looked that could change a file (the count it looked at is the count before
    the end, `files_at`; decision 078). If that save is still the last completed
    one and no other command is unended, it holds the files as of this end, as
    an unchanged capture (decision 067) would have found: no save is due."""
    latest = state.last_completed_save
    if (
        state.phase != "running"
        or generation != state.generation
        or state.unended_ids
        or latest is None
        or latest.id != save_id
    ):
        return state
    held = msgspec.structs.replace(
        latest,
        confirmed_at=at,
        confirmed_generation=generation,
        activity=state.activity,
        quiet=True,
        changed_at=None,
    )
    state = _with_save(state, held)
    # The next move of the count stamps it (`held_until`), as after a quiet save.
    waiting = state.requested_since_activity
    if save_id not in waiting:
        waiting = (*waiting, save_id)
    return msgspec.structs.replace(state, requested_since_activity=waiting)


def _with_command(state: Sandbox, command: Command) -> Sandbox:
    """The command put in (new or changed), with the indexes that spare a pass
    over all of them kept in step: queued, unended, and the ended counts."""
    queued = _indexed(state.queued, command.id, command.state == "queued")
    unended_ids = _indexed(state.unended_ids, command.id, not command.ended)
    before = state.commands.get(command.id)
    ended_counts = state.ended_counts
    if before is not None and before.ended and before.state != command.state:
        # (Only a command queued again under an ended one's id: never by `decide`.)
        ended_counts = {k: n - (k == before.state) for k, n in ended_counts.items()}
        ended_counts = {k: n for k, n in ended_counts.items() if n}
    if command.ended and (before is None or before.state != command.state):
        ended_counts = {**ended_counts, command.state: ended_counts.get(command.state, 0) + 1}
    return msgspec.structs.replace(
        state,
        commands=state.commands.set(command.id, command),
        queued=queued,
        unended_ids=unended_ids,
        ended_counts=ended_counts,
    )


def compact(state: Sandbox) -> Sandbox:
    """What a service keeps of a sandbox to decide on (decision 057): its ended
    commands go (an end state is final, and no periodic decision reads them);
    their request keys stay, so a retry is still known as one: the newest
    exactly, older ones `fingerprints.BLOCK` at a time as 8-byte fingerprints
    (decision 085; a request with such a key is decided on the whole state,
    `whole_needed`). A deleted
    sandbox forgets its request keys too: every request to it is refused or
    changes nothing, and `whole_needed` has it decided on the whole state.
    Its saves that nothing names go as well (decision 068): expired, failed
    behind the streak, or ended unchanged, final and read by no decision or
    view (`named_saves` keeps those under way, completed, Snapshots, the
    streak, those waiting to be stamped, the final save and the one restored).
    Cheap when nothing is to go (the per-event case): lengths compared."""
    deleted = state.phase == "deleted"
    # Those under way and those completed are apart and all named: as many
    # saves as those, and none is to go (the common case, without a pass).
    saves_named = len(state.saves) <= len(state.saves_in_flight) + len(state.saves_completed)
    kept_saves = None if saves_named else state._named_save_ids()
    if kept_saves is not None and len(kept_saves) == len(state.saves):
        kept_saves = None
    if (
        len(state.commands) == len(state.unended_ids)
        and not (deleted and (state.requests or state.forgotten_keys))
        and len(state.requests) < 2 * fingerprints.BLOCK
        and kept_saves is None
    ):
        return state
    commands: PMap[str, Command] = (
        state.commands
        if len(state.commands) == len(state.unended_ids)
        else PMap((i, state.commands[i]) for i in state.unended_ids)
    )
    saves = state.saves
    if kept_saves is not None:
        kept = set(kept_saves)
        saves = PMap((i, record) for i, record in state.saves.items() if i in kept)
    requests, forgotten = state.requests, state.forgotten_keys
    if deleted:
        requests, forgotten = EMPTY, ()
    else:
        # Whole blocks of the oldest, while two blocks' worth are held: the same
        # blocks whether compacted after every event or once after many (the
        # keys are in the order they came), so a checkpoint's states equal a
        # fold from zero compacted (`audit --checkpoints`).
        while len(requests) >= 2 * fingerprints.BLOCK:
            forgotten = fingerprints.with_block(forgotten, islice(requests, fingerprints.BLOCK))
            requests = PMap(islice(requests.items(), fingerprints.BLOCK, None))
    return msgspec.structs.replace(
        state,
        commands=commands,
        saves=saves,
        requests=requests,
        forgotten_keys=forgotten,
        compacted=True,
    )


def forgettable(state: Sandbox) -> bool:
    """Whether a service need keep nothing of this sandbox (decision 061): it is
    deleted, no command of it is unended, no save of it is under way, and it has
    no completed save left (retention expires all but its Snapshots once it is
    deleted, decision 060; a sandbox with Snapshots is kept, as they are
    starting points that name it). Nothing periodic decides on it again; a
    request to it is decided on it read back from the log."""
    return (
        state.phase == "deleted"
        and not state.unended_ids
        and not state.saves_in_flight
        and not state.saves_completed
    )


def whole_needed(state: Sandbox | None, request: rq.AnyRequest) -> bool:
    """Whether deciding `request` on this (compacted) state may read what
    `compact` dropped: then it is decided on the whole state, read back from the
    log. A deleted sandbox's request keys (every request to it is a retry, or
    refused, or noted); an ended command a run's retry or a cancel names, and
    the reply shows. Rare: a new request to a live sandbox needs none of it.
    (And a failed Snapshot's delete, on any kept state: deleted, it is named by
    nothing and dropped, and the reply shows it.)"""
    if state is None:
        return False
    if isinstance(request, rq.DeleteSnapshot):
        record = state.saves.get(request.save_id)
        if record is not None and record.state == "failed":
            return True
    if not state.compacted:
        return False
    if state.phase == "deleted":
        return True
    if remembers(state, request.key) is None:
        return True  # a key compacted into a fingerprint: only the log is exact
    if isinstance(request, rq.StartSandbox) and any(
        remembers(state, key) is None for key in request.superseded_by
    ):
        return True  # (a stop that supersedes a late start, decision 082, likewise)
    match request:
        case rq.RunCommand():  # a retry: known by its key, its command gone
            return (
                request.key in state.requests
                and rq.command_id_for(state.id, request.key) not in state.commands
            )
        case rq.CancelCommand():
            return request.command_id not in state.commands
        case rq.SnapshotSandbox():  # a retry, its Snapshot deleted and dropped since
            save_id = rq.save_id_for(state.id, f"snapshot:{request.key}")
            return request.key in state.requests and save_id not in state.saves
        case rq.DeleteSnapshot():  # a retry, or a save that is no Snapshot (any more)
            return request.save_id not in state.saves
        case _:
            return False


def remembers(state: Sandbox, key: str) -> bool | None:
    """Whether the sandbox was sent a request with `key`: None when only its
    whole state is exact (its fingerprint is kept: sent before, but for a chance
    of one in ~10^13, decision 085).
    Not told of a deleted sandbox's compacted state."""
    if key in state.requests:
        return True
    return None if fingerprints.may_hold(state.forgotten_keys, key) else False


def queued_by(state: Sandbox, key: str) -> bool | None:
    """Whether the run request with `key` made its command here: kept, or
    ended and compacted away (its key stays; a run is never a request that
    changes nothing). None: only the whole state can say (`remembers`)."""
    if rq.command_id_for(state.id, key) in state.commands:
        return True
    return remembers(state, key)


def ended_away(state: Sandbox, command_id: str, key: str) -> bool:
    """Whether the command, queued, may have ended and been dropped by
    `compact`: its end record is then in the log only (`AggregateStore.read_whole`).
    Of a deleted sandbox, whose request keys went too: any command not kept.
    A key kept only as a fingerprint counts as known (decision 085)."""
    if not state.compacted or command_id in state.commands:
        return False
    return remembers(state, key) is not False or state.phase == "deleted"


def _indexed(ids: tuple[str, ...], member_id: str, member: bool) -> tuple[str, ...]:
    """`ids` with `member_id` at its end or taken out (few: only open commands,
    saves under way or kept)."""
    if member:
        return ids if member_id in ids else (*ids, member_id)
    return tuple(i for i in ids if i != member_id) if member_id in ids else ids


def _remember(state: Sandbox, key: str, digest: str) -> PMap[str, str]:
    # Each key is remembered by one event, once: a retry appends nothing, and the
    # keys sandhold makes itself (`wake:`, `idle:`, `kept-stopped:`) are unique.
    # `compact` counts on it (decision 085): a key remembered again after it was
    # moved to a fingerprint would be held twice, and a fold compacted after
    # every event would then differ from one compacted at the end.
    return state.requests.set(key, digest)


def evolve(state: Sandbox | None, envelope: Envelope) -> Sandbox | None:
    """Apply one event. The only place a sandbox's state changes."""
    replace = msgspec.structs.replace
    event, envelope_time = envelope.event, envelope.time
    if isinstance(event, ev.SandboxCreated):
        return Sandbox(
            id=event.sandbox_id,
            tenant=event.tenant,
            phase="pending",
            created_at=envelope_time,
            memory_limit_bytes=event.memory_limit_bytes,
            requests=EMPTY.set(event.request_key, event.request_digest),
            save_interval_s=event.save_interval_s or sv.DEFAULT_SAVE_INTERVAL_S,
            stop_deadline_s=event.stop_deadline_s,
            source_snapshot_id=event.source_snapshot_id,
            source_snapshot_digest=event.source_snapshot_digest,
            source_sandbox_id=event.source_sandbox_id,
            recovery_policy=event.recovery,
            network=event.network,
            image=event.image,
            pids_limit=event.pids_limit,
            cpu_limit=event.cpu_limit,
            disk_limit_bytes=event.disk_limit_bytes,
            idle_timeout_s=event.idle_timeout_s or 0.0,
            keep_stopped_s=event.keep_stopped_s or 0.0,
            last_active_at=envelope_time,
            start_requested_at=envelope_time,
        )
    if state is None:
        return None  # an event for a sandbox we never saw created: nothing to apply to
    match event:
        case ev.SandboxPlaced(host=host, generation=generation):
            return replace(
                state,
                phase="placed",
                host=host,
                generation=generation,
                reason="",
                # (logs written before the field existed: the same rule, applied here)
                restore_save_id=event.restore_save_id or state.restore_point(),
                connections_delivered=None,  # a new placement's host has none yet
            )
        case ev.SandboxStarting():
            return replace(state, phase="starting")
        case ev.SandboxStarted(capabilities=capabilities):
            recovered = _recovered_from(state) if state.lost is not None else state.recovered_from
            start = StartRecord(
                requested_at=state.start_requested_at or envelope_time,
                started_at=envelope_time,
                restore=event.restore,
            )
            state = _changed(_woken(state, start), envelope_time)
            return replace(
                state,
                phase="running",
                capabilities=capabilities,
                running_since=envelope_time,
                lost=None,
                recovered_from=recovered,
                connections_delivered=event.connections_revision,
                last_active_at=_later(state, envelope_time),
                last_start=start,
            )
        case ev.SandboxLost():
            lost = LostInfo(
                host=event.host,
                generation=event.generation,
                last_renewal_at=event.last_renewal_at,
                fence_at=event.fence_at,
                cause=event.cause,
            )
            return replace(state, phase="lost", lost=lost, running_since=None)
        case ev.SandboxFenced() if state.lost is not None:
            return replace(state, lost=replace(state.lost, fenced=True))
        case ev.SandboxFenced():
            return state
        case ev.SandboxRecoveryRequested(request_key=key, request_digest=digest):
            requests = _remember(state, key, digest) if key and digest else state.requests
            return replace(
                state,
                phase="recovering",
                requests=requests,
                start_requested_at=envelope_time,
            )
        case ev.SandboxStartFailed(reason=reason):
            return replace(state, phase="failed", reason=reason, settled_at=envelope_time)
        case ev.SandboxWaiting(reason=reason) if state.phase in ("pending", "recovering"):
            return replace(state, reason=reason)
        case ev.SandboxWaiting():
            return state  # placed meanwhile: the placement said it all
        case ev.SandboxStartRequested(request_key=key, request_digest=digest):
            return replace(
                state,
                phase="pending",
                reason="",
                requests=_remember(state, key, digest),
                start_requested_at=envelope_time,
            )
        case ev.SandboxStopRequested(request_key=key, request_digest=digest) if state.phase in (
            "stopping",
            "stopped",
        ):
            # Someone's Stop of a sandbox reaped for being idle: the stop (and its
            # final save) already under way stands; only the reason changes, so a
            # command no longer wakes it (decision 045).
            return replace(state, requests=_remember(state, key, digest), reason=event.reason)
        case ev.SandboxStopRequested(request_key=key, request_digest=digest):
            # Only a sandbox that holds a place on a host has processes to stop.
            phase = "stopping" if state.phase in ACTIVE_PHASES else "stopped"
            if event.final_save_id is not None and event.final_save_id not in state.saves:
                latest = state.last_completed_save
                requested = ev.SaveRequested(
                    save_id=event.final_save_id,
                    kind="final",
                    host=state.host,
                    generation=state.generation,
                    parent_id=latest.id if latest else None,
                )
                state = _with_save(
                    state, sv.requested(requested, envelope_time, activity=state.activity)
                )
            return replace(
                state,
                phase=phase,
                requests=_remember(state, key, digest),
                final_save_id=event.final_save_id,
                running_since=None,
                reason=event.reason,
                settled_at=envelope_time if phase == "stopped" else state.settled_at,
            )
        case ev.SandboxStopped():
            return replace(state, phase="stopped", settled_at=envelope_time)
        case ev.SandboxTouched(request_key=key, request_digest=digest):
            return replace(
                state,
                requests=_remember(state, key, digest),
                last_active_at=_later(state, envelope_time),
            )
        case ev.SandboxDeleteRequested(request_key=key, request_digest=digest):
            phase = "stopping" if state.phase in ACTIVE_PHASES else state.phase
            # A deleted sandbox's files are discarded, not saved.
            return replace(
                state,
                phase=phase,
                delete_requested=True,
                requests=_remember(state, key, digest),
                final_save_id=None,
                reason=event.reason or state.reason,  # (someone's Delete gives none)
            )
        case ev.SandboxDeleted():
            return replace(state, phase="deleted")
        case ev.CommandQueued(dispatched_to=dispatch):
            command = Command(
                id=event.command_id,
                state="queued" if dispatch is None else "dispatched",
                host=None if dispatch is None else dispatch.host,
                generation=0 if dispatch is None else dispatch.generation,
                argv=event.argv,
                request_key=event.request_key,
                request_digest=event.request_digest,
                cwd=event.cwd,
                env=event.env,
                timeout_s=event.timeout_s,
                kill_grace_s=event.kill_grace_s,
                user=event.user,
                secret_names=event.secret_names,
                queued_at=envelope_time,
                cold=wakes_on_command(state),
            )
            state = replace(
                _changed(state, envelope_time),
                requests=_remember(state, event.request_key, event.request_digest),
                last_active_at=_later(state, envelope_time),
            )
            return _with_command(state, command)
        case ev.CommandDispatched(command_id=cid, host=host, generation=generation):
            return _update_command(state, cid, state="dispatched", host=host, generation=generation)
        case ev.CommandStarted(command_id=cid, pid=pid):
            state = replace(
                _changed(state, envelope_time), last_active_at=_later(state, envelope_time)
            )
            return _update_command(state, cid, state="running", pid=pid, started_at=envelope_time)
        case ev.CommandCancelRequested(command_id=cid, request_key=key, request_digest=digest):
            state = replace(state, requests=_remember(state, key, digest))
            return _update_command(state, cid, cancel_requested=True)
        case ev.CommandEnded():
            ending = state.commands.get(event.command_id)
            # (The count the host looked at is the one before this end moves it.)
            ends = ending is not None and not ending.ended
            looked = ends and event.files_of is not None and event.files_at == state.activity
            if ends:
                state = replace(
                    _changed(state, envelope_time), last_active_at=_later(state, envelope_time)
                )
            state = _update_command(
                state,
                event.command_id,
                state=event.state,
                exit_code=event.exit_code,
                signal=event.signal,
                reason=event.reason,
                output_kept=event.output_kept,
                output_complete=event.output_complete,
                ended_at=envelope_time,
                # (its start's, unless that went unreported: decision 095)
                pid=ending.pid if ending is not None and ending.pid is not None else event.pid,
            )
            if looked and event.files_of is not None:
                state = _files_held(state, event.files_of, event.generation, envelope_time)
            return state
        case ev.ConnectionSet(name=name):
            connection = Connection(
                value_id=event.value_id, size=event.size, revision=event.revision
            )
            return replace(
                state,
                connections={**state.connections, name: connection},
                connections_revision=event.revision,
                requests=_remember(state, event.request_key, event.request_digest),
            )
        case ev.ConnectionRemoved(name=name):
            return replace(
                state,
                connections={k: v for k, v in state.connections.items() if k != name},
                connections_revision=event.revision,
                requests=_remember(state, event.request_key, event.request_digest),
            )
        case ev.ConnectionsDelivered(generation=generation, revision=revision):
            if generation != state.generation:
                return state
            return replace(_changed(state, envelope_time), connections_delivered=revision)
        case ev.ConnectionsDropped(generation=generation):
            if generation != state.generation:
                return state
            return replace(_changed(state, envelope_time), connections_delivered=None)
        case ev.RequestNoted(request_key=key, request_digest=digest):
            return replace(state, requests=_remember(state, key, digest))
        case ev.SaveRequested(request_key=key, request_digest=digest) if key and digest:
            state = _save_requested(state, event, envelope_time)
            return replace(state, requests=_remember(state, key, digest))
        case ev.SaveRequested():
            return _save_requested(state, event, envelope_time)
        case ev.SaveCaptured() | ev.SaveUploaded() | ev.SaveCompleted() | ev.SaveFailed():
            return _save_advanced(state, event.save_id, event, envelope_time)
        case ev.SaveUnchanged():
            return _save_unchanged(state, event, envelope_time)
        case ev.SnapshotDeleted(save_id=save_id, request_key=key, request_digest=digest):
            state = replace(state, requests=_remember(state, key, digest))
            return _snapshot_deleted(state, save_id)
        case ev.SavesExpired(save_ids=save_ids):
            for save_id in save_ids:
                state = _save_advanced(state, save_id, event, envelope_time)
            return state
        case (
            ev.SandboxCreated()
            | ev.HostRegistered()
            | ev.HostLost()
            | ev.HostFenced()
            | ev.TaskEvent()
        ):
            return state  # created: handled above; a host's or a task's events: not ours
        case _:
            assert_never(event)


def _recovered_from(state: Sandbox) -> RecoveredFrom:
    """From the save the placement restored (fixed when it was placed)."""
    assert state.lost is not None
    lost = state.lost
    restored = state.saves.get(state.restore_save_id) if state.restore_save_id else None
    if restored is not None:  # one of its own saves (a Snapshot of itself included)
        # The save holds the files as of its capture; the failure is dated by the
        # last renewal recovery saw (a capture just after it counts as not behind).
        taken = sv.holds_as_of(restored)
        # A quiet save held the files until their first change (decision 051).
        held = held_until(restored, state, now=lost.last_renewal_at)
        if taken and held is not None:
            taken = max(taken, held)
        behind = max(0.0, lost.last_renewal_at - taken) if taken else None
        return RecoveredFrom(
            source="save",
            save_id=restored.id,
            completed_at=restored.completed_at,
            captured_at=restored.captured_at,
            behind_failure_s=behind,
            lost_host=lost.host,
            lost_generation=lost.generation,
        )
    if state.restore_save_id is not None:  # the Snapshot it was created from
        return RecoveredFrom(
            source="snapshot",
            save_id=state.restore_save_id,
            lost_host=lost.host,
            lost_generation=lost.generation,
        )
    return RecoveredFrom(source="base image", lost_host=lost.host, lost_generation=lost.generation)


def _update_command(sandbox: Sandbox, command_id: str, /, **changes: object) -> Sandbox:
    command = sandbox.commands.get(command_id)
    if command is None or command.ended:
        # An end state is final: hosts report only on commands not ended
        # (`reports.news`), and the indexes rely on an ended command not changing.
        return sandbox
    return _with_command(sandbox, msgspec.structs.replace(command, **changes))


# --- decide ------------------------------------------------------------------


def _require(state: Sandbox | None, sandbox_id: str, tenant: str) -> Sandbox:
    # Another tenant's sandbox is reported exactly like a missing one.
    if state is None or state.tenant != tenant:
        raise Rejected("sandbox_not_found", f"no sandbox {sandbox_id}")
    return state


class Defaults(msgspec.Struct, frozen=True, kw_only=True):
    """The scheduler's configuration, recorded into each sandbox at creation."""

    save_interval_s: float = sv.DEFAULT_SAVE_INTERVAL_S
    stop_deadline_s: float = 60.0
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S  # 0: never reaped


# A Snapshot's owning sandbox and record, looked up by id: (sandbox, save) or None.
FindSnapshot = Callable[[str], "tuple[Sandbox, sv.SaveRecord] | None"]


def _no_snapshots(_: str) -> None:
    return None


def decide(
    state: Sandbox | None,
    request: rq.AnyRequest,
    *,
    defaults: Defaults = Defaults(),  # noqa: B008 - frozen, shared on purpose
    find_snapshot: FindSnapshot = _no_snapshots,
) -> list[ev.AnyEvent]:
    """Decide what a client request changes. `[]` = nothing new (already applied).

    Raises `Rejected` when the request cannot be honoured in this state. A new
    key on a request that changes nothing is still recorded (`RequestNoted`).
    """
    digest = rq.request_digest(request)
    if isinstance(request, rq.CreateSandbox):
        events = _create(state, request, digest, defaults, find_snapshot)
    else:
        events = _decide(state, request, digest)
    if not events and state is not None and request.key not in state.requests:
        return [ev.RequestNoted(request_key=request.key, request_digest=digest)]
    return events


def _create(
    state: Sandbox | None,
    request: rq.CreateSandbox,
    digest: str,
    defaults: Defaults,
    find_snapshot: FindSnapshot,
) -> list[ev.AnyEvent]:
    if state is not None:
        seen_before(state.requests, request.key, digest)
        return []
    source_sandbox_id = None
    source_digest = ""
    if request.from_snapshot is not None and request.seed is not None:
        raise Rejected(
            "invalid_request", "give `from_snapshot` or `seed`, not both: one starting point"
        )
    if request.from_snapshot is not None:
        found = find_snapshot(request.from_snapshot)
        if found is None or found[0].tenant != request.tenant or found[1].kind != "snapshot":
            raise Rejected("snapshot_not_found", f"no snapshot {request.from_snapshot}")
        owner, snapshot = found
        if snapshot.state != "completed":
            raise Rejected(
                "snapshot_not_completed",
                f"snapshot {snapshot.id} is {snapshot.state}; only a completed snapshot "
                "can be a starting point",
            )
        source_sandbox_id = owner.id
        source_digest = snapshot.manifest_digest
    elif request.seed is not None:
        source_digest = request.seed_manifest_digest or ""
    return [
        ev.SandboxCreated(
            sandbox_id=rq.sandbox_id_for(request.tenant, request.key),
            request_key=request.key,
            request_digest=digest,
            memory_limit_bytes=request.memory_limit_bytes,
            tenant=request.tenant,
            save_interval_s=request.save_interval_s or defaults.save_interval_s,
            stop_deadline_s=request.stop_deadline_s or defaults.stop_deadline_s,
            source_snapshot_id=request.from_snapshot or request.seed,
            source_snapshot_digest=source_digest,
            source_sandbox_id=source_sandbox_id,
            recovery=request.recovery or "lazy",
            network=request.network,
            image=request.image,
            pids_limit=request.pids_limit,
            cpu_limit=request.cpu_limit,
            disk_limit_bytes=request.disk_limit_bytes,
            idle_timeout_s=(
                defaults.idle_timeout_s
                if request.idle_timeout_s is None
                else request.idle_timeout_s
            ),
            keep_stopped_s=request.keep_stopped_s or None,
        )
    ]


def _later(state: Sandbox, at: float) -> float:
    """Activity only moves the idle clock forward: events carry their writer's wall
    clock, and a host whose clock is behind must not make a sandbox look idle."""
    return max(state.last_active_at, at)


def wakes_on_command(state: Sandbox) -> bool:
    """Reaped for being idle (stopping or stopped): a command brings it back,
    once stopped, and then runs. A sandbox someone stopped stays stopped."""
    return (
        state.reason == "idle"
        and state.phase in ("stopping", "stopped")
        and not (state.delete_requested)
    )


def accepts_commands(state: Sandbox) -> bool:
    return not state.delete_requested and (
        state.phase in LAUNCHABLE_PHASES or wakes_on_command(state)
    )


def dispatch_to(state: Sandbox) -> ev.Dispatch | None:
    """Where a command queued now goes at once: the placement the sandbox runs
    on, once its Connections are delivered (a command never starts without
    them). None: it waits (for a start, a placement, a delivery), and `plan`
    dispatches it when that comes."""
    if (
        state.phase == "running"
        and state.host is not None
        and state.connections_current
        and not state.delete_requested
    ):
        return ev.Dispatch(host=state.host, generation=state.generation)
    return None


def reaps_at(state: Sandbox) -> float | None:
    """When the reaper stops this sandbox if nothing happens first; None: not
    idle now (not running, a command queued or running) or never reaped."""
    if state.phase != "running" or state.idle_timeout_s <= 0 or state.unended > 0:
        return None
    if state.delete_requested:
        return None
    return state.last_active_at + state.idle_timeout_s


def unchanged_since(state: Sandbox) -> sv.SaveRecord | None:
    """The completed save whose files the running sandbox still has, if that is
    known: one of this placement, captured while nothing but the sandbox's box
    ran, with nothing since that could change a file (a command queued, started
    or ended, connections delivered). Another scheduled save would copy the same
    files again; with a thousand idle sandboxes such saves kept both cores of a
    host busy (docs/benchmarks.md (j), decision 051)."""
    latest = state.last_completed_save
    if (
        state.phase != "running"
        or latest is None
        or state.generation not in (latest.generation, latest.confirmed_generation)
        or not _still_holds(latest, state)
    ):
        return None
    return latest


def _still_holds(save: sv.SaveRecord, state: Sandbox) -> bool:
    """A quiet save with nothing since that could change a file."""
    return save.quiet and save.changed_at is None and save.activity == state.activity


def held_until(save: sv.SaveRecord, state: Sandbox, *, now: float) -> float | None:
    """For a quiet save, until when the sandbox's files were (or are) its files:
    the first moment after it that something could have changed them, `now`
    while nothing has. None: not a quiet save, or not known."""
    if not save.quiet:
        return None
    if save.changed_at is not None:
        return save.changed_at
    return now if _still_holds(save, state) else None


def saved_until(state: Sandbox, *, now: float) -> float | None:
    """Up to when the sandbox's files are in a completed save, so that a failure
    now would not lose them: when its last save completed or, for a save taken
    while it was quiet, the first moment after it that a command could have
    changed them (`now` while nothing has: running, stopping, stopped or lost
    alike). None: no save has completed."""
    latest = state.last_completed_save
    if latest is None or latest.completed_at is None:
        return None
    saved = max(latest.completed_at, latest.confirmed_at or 0.0)
    held = held_until(latest, state, now=now)
    return saved if held is None else max(saved, held)


def placed_on(state: Sandbox) -> str | None:
    """The host the sandbox holds a place on (counts toward its capacity, and is
    lost with it), if any."""
    return state.host if state.phase in ACTIVE_PHASES else None


def waits_outside_its_log(state: Sandbox) -> bool:
    """Waiting on something its own events will not announce: room on a host (a
    slot frees when another sandbox stops), or a deleted sandbox's copy on a host
    that may have died before destroying it. The scheduler plans these again
    every few seconds."""
    return state.phase in ("pending", "recovering") or (
        state.delete_requested and state.phase in ("stopped", "failed")
    )


def deletes_at(state: Sandbox) -> float | None:
    """When a stopped or failed sandbox is deleted for having been kept its
    `keep_stopped_s` (decision 074); None: not stopped now, or kept until deleted."""
    if state.keep_stopped_s <= 0 or state.delete_requested or state.settled_at is None:
        return None
    if state.phase not in ("stopped", "failed") or state.unended_ids:
        # (A command queued to wake a sandbox reaped for being idle: it starts.)
        return None
    return state.settled_at + state.keep_stopped_s


def delete_if_kept_long_enough(state: Sandbox, *, now: float, cause: str) -> list[ev.AnyEvent]:
    """A Delete, once the sandbox has been stopped for its `keep_stopped_s`. Its
    Snapshots stay (decision 060); its other saves and its copy go."""
    at = deletes_at(state)
    if at is None or now < at:
        return []
    return [
        ev.SandboxDeleteRequested(
            request_key=f"kept-stopped:{cause}", request_digest="", reason="kept_stopped"
        )
    ]


def reap_if_idle(state: Sandbox, *, now: float, cause: str) -> list[ev.AnyEvent]:
    """A Stop, with its final save, once the sandbox has been idle for its timeout."""
    at = reaps_at(state)
    if at is None or now < at:
        return []
    return stop_requested(state, key=f"idle:{cause}", digest="", reason="idle")


def stop_requested(state: Sandbox, *, key: str, digest: str, reason: str) -> list[ev.AnyEvent]:
    # A sandbox placed on a host has a workspace there: save it once stopped.
    holds_files = state.host is not None and state.phase in ACTIVE_PHASES
    final = rq.save_id_for(state.id, f"final:{key}") if holds_files else None
    return [
        ev.SandboxStopRequested(
            request_key=key, request_digest=digest, final_save_id=final, reason=reason
        )
    ]


def _decide(state: Sandbox | None, request: rq.AnyRequest, digest: str) -> list[ev.AnyEvent]:
    match request:
        case rq.CreateSandbox():
            raise AssertionError("decided by _create")
        case rq.StartSandbox():
            state = _require(state, request.sandbox_id, request.tenant)
            if seen_before(state.requests, request.key, digest):
                return []
            if any(key in state.requests for key in request.superseded_by):
                return []  # (noted: what it was sent for has ended since)
            if deletion_asked(state):
                raise Rejected("sandbox_deleted", f"sandbox {state.id} is deleted")
            if state.phase == "stopping":
                raise Rejected(
                    "sandbox_stopping",
                    f"sandbox {state.id} is stopping; start it once it has stopped",
                )
            if state.phase in ("stopped", "failed"):
                return [ev.SandboxStartRequested(request_key=request.key, request_digest=digest)]
            if state.phase == "lost":
                # Nothing restarts by itself: this start is what brings it back.
                return [
                    ev.SandboxRecoveryRequested(
                        cause="start", request_key=request.key, request_digest=digest
                    )
                ]
            return []  # already pending, placed, starting, running or recovering
        case rq.StopSandbox():
            state = _require(state, request.sandbox_id, request.tenant)
            if seen_before(state.requests, request.key, digest):
                return []
            if state.phase == "deleted":
                raise Rejected("sandbox_deleted", f"sandbox {state.id} is deleted")
            if wakes_on_command(state):
                # Reaped for being idle, and now stopped by someone: it stays
                # stopped, and commands queued to wake it end unlaunched (decision 045).
                return [ev.SandboxStopRequested(request_key=request.key, request_digest=digest)]
            if state.phase in ("stopping", "stopped", "failed"):
                return []
            return stop_requested(state, key=request.key, digest=digest, reason="")
        case rq.TouchSandbox():
            state = _require(state, request.sandbox_id, request.tenant)
            if seen_before(state.requests, request.key, digest):
                return []
            _refuse_if_deleted(state)
            return [ev.SandboxTouched(request_key=request.key, request_digest=digest)]
        case rq.SnapshotSandbox():
            state = _require(state, request.sandbox_id, request.tenant)
            if seen_before(state.requests, request.key, digest):
                return []
            # The decision point for the host-failure issue: a lost sandbox is refused here.
            if state.phase in ("lost", "recovering"):
                raise Rejected(
                    "sandbox_lost",
                    f"sandbox {state.id} is {state.phase}: its host failed, so there is "
                    "nothing current to snapshot; start it (or run a command) to recover it first",
                )
            if state.phase != "running":
                raise Rejected(
                    "sandbox_not_running",
                    f"sandbox {state.id} is {state.phase}; a Snapshot is taken of a running "
                    "sandbox",
                )
            taken = {
                s.snapshot_name for s in state.snapshots() if s.state not in ("failed", "expired")
            }
            if request.name in taken:
                raise Rejected(
                    "snapshot_name_taken",
                    f"sandbox {state.id} already has a snapshot named {request.name!r}",
                )
            latest = state.last_completed_save
            return [
                ev.SaveRequested(
                    save_id=rq.save_id_for(state.id, f"snapshot:{request.key}"),
                    kind="snapshot",
                    host=state.host,
                    generation=state.generation,
                    parent_id=latest.id if latest else None,
                    snapshot_name=request.name,
                    request_key=request.key,
                    request_digest=digest,
                )
            ]
        case rq.DeleteSnapshot():
            # Of a deleted sandbox too: its Snapshots are all that is left of it.
            state = _require(state, request.sandbox_id, request.tenant)
            if seen_before(state.requests, request.key, digest):
                return []
            record = state.saves.get(request.save_id)
            if record is None or record.kind != "snapshot":
                raise Rejected(
                    "snapshot_not_found",
                    f"sandbox {state.id} has no snapshot {request.save_id}",
                )
            if record.state in sv.IN_FLIGHT:
                # Whoever asked for it waits for its end (a task's artifacts):
                # it ends a Snapshot, completed or failed, and is deleted then.
                raise Rejected(
                    "snapshot_not_completed",
                    f"snapshot {record.id} is {record.state}; it can be deleted once it "
                    "completed or failed",
                )
            return [
                ev.SnapshotDeleted(
                    save_id=request.save_id, request_key=request.key, request_digest=digest
                )
            ]
        case rq.DeleteSandbox():
            state = _require(state, request.sandbox_id, request.tenant)
            if seen_before(state.requests, request.key, digest) or state.delete_requested:
                return []
            return [ev.SandboxDeleteRequested(request_key=request.key, request_digest=digest)]
        case rq.RunCommand():
            state = _require(state, request.sandbox_id, request.tenant)
            if seen_before(state.requests, request.key, digest):
                return []
            if not accepts_commands(state):
                raise Rejected(
                    "sandbox_not_running",
                    f"sandbox {state.id} is {state.phase}; start it before running commands",
                )
            # A command sent to a lost sandbox brings it back, and then runs there.
            recover: list[ev.AnyEvent] = (
                [ev.SandboxRecoveryRequested(cause="command")] if state.phase == "lost" else []
            )
            return recover + [
                ev.CommandQueued(
                    command_id=rq.command_id_for(state.id, request.key),
                    request_key=request.key,
                    request_digest=digest,
                    argv=request.argv,
                    cwd=request.cwd,
                    env=request.env,
                    timeout_s=request.timeout_s,
                    kill_grace_s=request.kill_grace_s,
                    user=request.user,
                    secret_names=sorted(request.secrets),
                    # (One event where the sandbox can take it now: one append
                    # less on every command's way, decision 098.)
                    dispatched_to=dispatch_to(state),
                )
            ]
        case rq.SetConnection():
            state = _require(state, request.sandbox_id, request.tenant)
            if seen_before(state.requests, request.key, digest):
                return []
            _refuse_if_deleted(state)
            others = {n: c for n, c in state.connections.items() if n != request.name}
            size = len(request.value.encode())
            if len(others) >= MAX_CONNECTIONS:
                raise Rejected(
                    "too_many_connections",
                    f"sandbox {state.id} has {len(others)} Connections, the most it may have; "
                    "remove one first",
                )
            if size + sum(c.size for c in others.values()) > MAX_CONNECTIONS_BYTES:
                raise Rejected(
                    "connections_too_large",
                    f"a sandbox's Connections may hold {MAX_CONNECTIONS_BYTES} bytes together; "
                    f"with this one ({size} bytes) {state.id}'s would hold more",
                )
            return [
                ev.ConnectionSet(
                    name=request.name,
                    value_id=rq.connection_value_id(state.id, request.key),
                    size=size,
                    revision=state.connections_revision + 1,
                    request_key=request.key,
                    request_digest=digest,
                )
            ]
        case rq.RemoveConnection():
            state = _require(state, request.sandbox_id, request.tenant)
            if seen_before(state.requests, request.key, digest):
                return []
            _refuse_if_deleted(state)
            if request.name not in state.connections:
                raise Rejected(
                    "connection_not_found", f"sandbox {state.id} has no Connection {request.name!r}"
                )
            return [
                ev.ConnectionRemoved(
                    name=request.name,
                    revision=state.connections_revision + 1,
                    request_key=request.key,
                    request_digest=digest,
                )
            ]
        case rq.CancelCommand():
            state = _require(state, request.sandbox_id, request.tenant)
            if seen_before(state.requests, request.key, digest):
                return []
            command = state.commands.get(request.command_id)
            if command is None:
                raise Rejected(
                    "command_not_found", f"no command {request.command_id} in {state.id}"
                )
            if command.ended or command.cancel_requested:
                return []
            return [
                ev.CommandCancelRequested(
                    command_id=command.id, request_key=request.key, request_digest=digest
                )
            ]
        case _:
            assert_never(request)


def deletion_asked(state: Sandbox) -> bool:
    """Deleted, or on its way there: someone asked to delete it. Nothing starts it
    again, and only then may a host destroy its files (decision 065)."""
    return state.phase == "deleted" or state.delete_requested


def _refuse_if_deleted(state: Sandbox) -> None:
    if deletion_asked(state):
        raise Rejected("sandbox_deleted", f"sandbox {state.id} is deleted")


def result_of(state: Sandbox, request: rq.AnyRequest) -> Sandbox | Command | sv.SaveRecord:
    """What the caller gets back: the sandbox, or the command a run/cancel names."""
    match request:
        case rq.RunCommand():
            return state.commands[rq.command_id_for(state.id, request.key)]
        case rq.CancelCommand():
            return state.commands[request.command_id]
        case rq.SnapshotSandbox():
            return state.saves[rq.save_id_for(state.id, f"snapshot:{request.key}")]
        case rq.DeleteSnapshot():
            return state.saves[request.save_id]
        case _:
            return state


def aggregate_of(request: rq.AnyRequest) -> str:
    """The sandbox id a request is about (derived from the key for a create)."""
    if isinstance(request, rq.CreateSandbox):
        return rq.sandbox_id_for(request.tenant, request.key)
    return request.sandbox_id
