"""A live projection of one aggregate kind, plus the decide-and-append loop.

One follower (`follow.py`) reads `<prefix>.ev.<kind>.>` and folds every event into
an in-memory state per aggregate with the domain's `evolve`. Deciding uses
that state and appends with its sequence as the expected one; if JetStream
says someone else wrote first, the store catches up on that aggregate and
the decision is made again. The cache can be stale; the fence cannot.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, Generic, TypeVar, get_type_hints

import msgspec
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import RawStreamMsg
from nats.js.errors import NotFoundError
from sandhold.bus.append import WrongSequence, append, last_message, last_sequence
from sandhold.bus.checkpoint import (
    Checkpoint,
    Checkpoints,
    compaction_name,
    fold_version,
    path_for,
)
from sandhold.bus.codec import FENCE_HEADER, decode_envelope, has_fence
from sandhold.bus.electing import patiently
from sandhold.bus.follow import (  # noqa: F401 - stream_sequence re-exported
    Follower,
    read_range,
    stream_sequence,
)
from sandhold.bus.names import Names
from sandhold.domain.envelope import Envelope, wrap
from sandhold.domain.errors import InfraError, Rejected
from sandhold.domain.events import AnyEvent
from sandhold.domain.fold import fold
from sandhold.telemetry import context

log = logging.getLogger(__name__)

S = TypeVar("S")
G = TypeVar("G", bound="Grouping[Any]")  # an index kept in step with a store (`group`)
Evolve = Callable[[S | None, Envelope], S | None]
Decide = Callable[[S | None], list[AnyEvent]]
Compact = Callable[[S], S]
Forget = Callable[[S], bool]

# A checkpoint is written when this many events were folded since the last one,
# looked at every CHECKPOINT_EVERY_S, and when the store stops: a restart then
# folds about a minute of events, or a few thousand, whatever the log's size.
CHECKPOINT_EVERY_S = 30.0
CHECKPOINT_MIN_EVENTS = 1000


class Executed(msgspec.Struct, Generic[S]):
    state: S | None
    seq: int
    appended: list[Envelope]


class AggregateStore(Generic[S]):
    def __init__(
        self,
        js: JetStreamContext,
        names: Names,
        kind: str,
        evolve: Evolve[S],
        *,
        actor: str,
        follow: bool = True,
        checkpoint_dir: Path | None = None,
        compact: Compact[S] | None = None,
        forget: Forget[S] | None = None,
        pace_s: float | None = None,
    ) -> None:
        """`follow=False`: no consumer at all; an aggregate is read (direct gets)
        when asked for (`sync`), and when a decision on what was last read is
        refused, empty or fenced off (decision 054). For a user that may create
        no consumer (a host-agent, decision 032).

        `checkpoint_dir`: keep the folded state there (`checkpoint.py`), so a
        start folds only the events after it; the state's type is what
        `evolve` says it returns.

        `compact`: what is kept of each state after every change (decision 057):
        memory and checkpoints then grow with what deciding needs, not with every
        command ever ended; a decision that reads what it drops says so
        (`execute(whole=...)`) and is then made on the whole state, read back.

        `forget`: whether an aggregate needs nothing kept at all any more (a
        deleted sandbox nothing is left of, decision 061): it is dropped from
        memory and checkpoints as that state is folded, its later events fold
        onto nothing, and a decision on an aggregate not held is made on it read
        back whole (`read_whole`). Only where a follower keeps the rest current.

        `pace_s`: live events folded at most this often, in one batch
        (`Follower`, decision 087): for a service that looks at its states on
        a tick of its own, not at each event."""
        self._js = js
        self._pace_s = pace_s
        self._follow = follow
        self._stream = names.events_stream
        self._names = names
        self._kind = kind
        self._evolve = evolve
        self._compact = compact
        self._forget = forget if follow else None
        self._actor = actor
        self._states: dict[str, S] = {}
        self._seqs: dict[str, int] = {}
        self._listeners: list[Callable[[str], None]] = []
        self._watchers: list[Callable[[str, list[Envelope]], None]] = []
        self._forgetters: list[Callable[[str, S], None]] = []
        self._follower: Follower[Envelope] | None = None
        # Decisions on one aggregate in this process take turns; other processes
        # are kept honest by the fence. Held only while someone decides (with how
        # many are deciding or waiting): not one per aggregate ever decided on.
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}
        # The trace context of each aggregate's latest event (its `traceparent`
        # header): what a service does about that aggregate continues its trace.
        self._traces: dict[str, str] = {}
        self._checkpoints: Checkpoints[S] | None = None
        if checkpoint_dir is not None and follow:
            state_type = get_type_hints(evolve).get("return")
            if state_type is not None:
                self._checkpoints = Checkpoints(
                    path_for(checkpoint_dir, kind),
                    state_type,
                    compaction=compaction_name(compact),
                )
        self._last_event = (0, "")  # the last event folded in: its sequence and id
        self._checkpointed = 0  # the position the last checkpoint covers
        self._checkpointing: asyncio.Task[None] | None = None
        self.folded = 0  # events folded in by this store (a checkpoint's not counted)
        self.forgotten = 0  # aggregates dropped by `forget` since the start

    # --- reading --------------------------------------------------------------

    async def start(self, *, timeout: float = 60.0) -> None:
        """Replay every aggregate of this kind (from its checkpoint, if it has a
        good one), then follow live events (unless made with `follow=False`: then
        aggregates are read one by one, on demand)."""
        if not self._follow:
            return
        position = await self._load_checkpoint()
        self._follower = Follower(
            self._js,
            self._stream,
            self._names.events(self._kind, ">"),
            decode_envelope,
            self._on_event,
            start_seq=position + 1,
            what=f"{self._kind} event",
            pace_s=self._pace_s,
            bulk=True,
        )
        await self._follower.start(timeout=timeout)
        if self._checkpoints is not None:
            self._checkpointing = asyncio.create_task(self._keep_checkpointing())

    async def stop(self) -> None:
        if self._checkpointing is not None:
            self._checkpointing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._checkpointing
        if self._follower is not None:
            await self._follower.stop()
            with contextlib.suppress(Exception):
                await self.checkpoint()

    async def _load_checkpoint(self) -> int:
        """The states of a good checkpoint, announced to the listeners as if each
        had just changed (what they derive is level-triggered); its position."""
        if self._checkpoints is None:
            return 0
        started = time.monotonic()
        found = await self._checkpoints.load(self._js, self._stream, self._kind)
        if found is None:
            return 0
        self._states = {k: v for k, v in found.states.items() if v is not None}
        self._seqs, self._traces = found.seqs, found.traces
        dropped = []
        if self._forget is not None:  # (one written before this store forgot so)
            for aggregate_id, state in list(self._states.items()):
                if self._forget(state):
                    self.forgotten += 1
                    for forgetter in self._forgetters:
                        forgetter(aggregate_id, state)
                    self._drop(aggregate_id)
                    dropped.append(aggregate_id)
        self._last_event = (found.last_event_seq, found.last_event_id)
        self._checkpointed = found.position
        for aggregate_id in [*self._states, *dropped]:
            for callback in self._listeners:
                callback(aggregate_id)
        log.info(
            "%s: %d aggregate(s) from the checkpoint at seq %d in %.2fs; folding what came after",
            self._kind,
            len(self._states),
            found.position,
            time.monotonic() - started,
        )
        return found.position

    async def checkpoint(self) -> int:
        """Write a checkpoint now if anything was folded since the last one; the
        bytes written (0: nothing to write)."""
        follower = self._follower
        if self._checkpoints is None or follower is None:
            return 0
        position = follower.position
        if position <= self._checkpointed:
            return 0
        # Copied here, on the loop, in one go: a consistent picture (states are
        # immutable; only the dicts holding them change), encoded in a thread.
        checkpoint = Checkpoint(
            version=fold_version(),
            stream=self._stream,
            kind=self._kind,
            position=position,
            last_event_seq=self._last_event[0],
            last_event_id=self._last_event[1],
            states=dict(self._states),
            seqs=dict(self._seqs),
            traces=dict(self._traces),
            compaction=self._checkpoints.compaction,
        )
        written = await asyncio.to_thread(self._checkpoints.write, checkpoint)
        self._checkpointed = position
        return written

    async def _keep_checkpointing(self) -> None:
        while True:
            await asyncio.sleep(CHECKPOINT_EVERY_S)
            follower = self._follower
            if follower is None or follower.position - self._checkpointed < CHECKPOINT_MIN_EVENTS:
                continue
            try:
                await self.checkpoint()
            except Exception as err:  # a full disk must not stop the service: it folds more
                log.warning("%s: checkpoint not written: %r", self._kind, err)

    async def catch_up(self, *, timeout: float = 30.0) -> None:
        """Wait until every event of this kind the log holds now is folded here: a
        barrier before judging all aggregates at once (what garbage collection may
        delete, where a sandbox fits), since another instance of this service may
        have appended a moment ago. `TimeoutError` when the follower cannot get
        there in `timeout` seconds; nothing to wait for without a follower."""
        if self._follower is None:
            return
        last = await last_sequence(
            self._js, self._stream, self._names.events(self._kind, ">"), from_leader=True
        )
        await self._follower.reach(last, timeout=timeout)

    def listen(self, callback: Callable[[str], None]) -> None:
        """`callback(aggregate_id)` after every change to an aggregate."""
        self._listeners.append(callback)

    def select(self, keep: Callable[[S], bool]) -> Selection[S]:
        """The ids of the aggregates whose state passes `keep`, kept in step with
        every change from now on (and with every state held already)."""
        return self._kept_in_step(Selection(self, keep))

    def group(self, key: Callable[[S], str | None]) -> Grouping[S]:
        """The aggregates grouped by `key` of their state (None: in no group),
        kept in step as `select` is."""
        return self._kept_in_step(Grouping(self, key))

    def _kept_in_step(self, grouping: G) -> G:
        self.listen(grouping.changed)
        for aggregate_id in self._states:
            grouping.changed(aggregate_id)
        return grouping

    def watch(self, callback: Callable[[str, list[Envelope]], None]) -> None:
        """`callback(aggregate_id, envelopes)` with the events of every change
        as they are folded (not those a checkpoint already holds)."""
        self._watchers.append(callback)

    def on_forget(self, callback: Callable[[str, S], None]) -> None:
        """`callback(aggregate_id, state)` with the last state of an aggregate
        as it is forgotten (`forget`), before its listeners hear of the change:
        what a service kept beside the state about it can go with it."""
        self._forgetters.append(callback)

    def get(self, aggregate_id: str) -> tuple[S | None, int]:
        return self._states.get(aggregate_id), self._seqs.get(aggregate_id, 0)

    def ids(self) -> list[str]:
        return list(self._states)

    async def known(self, aggregate_id: str) -> bool:
        """Whether the aggregate has events: held here, or in the log (one not
        folded yet, or forgotten); one read from the leader when not held."""
        if aggregate_id in self._seqs:
            return True
        subject = self.subject(aggregate_id)
        return await last_sequence(self._js, self._stream, subject, from_leader=True) > 0

    def subject(self, aggregate_id: str) -> str:
        return self._names.events(self._kind, aggregate_id)

    def trace_of(self, aggregate_id: str) -> str | None:
        """The `traceparent` of the aggregate's latest event, if it was traced."""
        return self._traces.get(aggregate_id)

    def _note_trace(self, aggregate_id: str, traceparent: str | None) -> None:
        if traceparent:
            self._traces[aggregate_id] = traceparent
        else:
            self._traces.pop(aggregate_id, None)

    def _on_event(self, seq: int, msg: Msg, envelope: Envelope) -> None:
        aggregate_id = msg.subject.rsplit(".", 1)[1]
        self.folded += 1
        self._apply(aggregate_id, seq, [envelope], (msg.headers or {}).get(context.TRACEPARENT))

    def _apply(
        self, aggregate_id: str, seq: int, envelopes: list[Envelope], traceparent: str | None
    ) -> None:
        if seq <= self._seqs.get(aggregate_id, 0):
            return  # already applied (our own append, or a catch-up read)
        self._note_trace(aggregate_id, traceparent)
        state = fold(self._evolve, envelopes, self._states.get(aggregate_id))
        if state is not None and self._compact is not None:
            state = self._compact(state)
        if self._forget is not None and (state is None or self._forget(state)):
            # Nothing kept, not even its sequence: a later event folds onto
            # nothing, and a decision reads the aggregate back (`_execute`).
            if state is not None and aggregate_id in self._states:  # (not one read again)
                self.forgotten += 1
                for forgetter in self._forgetters:
                    forgetter(aggregate_id, state)
            self._drop(aggregate_id)
        else:
            if state is not None:
                self._states[aggregate_id] = state
            self._seqs[aggregate_id] = seq
        if envelopes and seq > self._last_event[0]:
            self._last_event = (seq, envelopes[-1].id)
        for watcher in self._watchers:
            watcher(aggregate_id, envelopes)
        for callback in self._listeners:
            callback(aggregate_id)

    def _drop(self, aggregate_id: str) -> None:
        self._states.pop(aggregate_id, None)
        self._seqs.pop(aggregate_id, None)
        self._traces.pop(aggregate_id, None)

    async def sync(
        self, aggregate_id: str, *, from_leader: bool = False, news_expected: bool = False
    ) -> tuple[S | None, int]:
        """Catch up on one aggregate to the subject's current last sequence.
        `from_leader`: up to the end the stream's leader knows, which covers every
        append acknowledged so far (a direct get's replica may be a moment behind).
        `news_expected`: the caller knows of an event not read yet (a host's
        instruction follows one), so the first one is asked for alongside the
        last: one round trip where one or two events are new (the usual), and one
        wasted where there were none."""
        if self._forget is not None and aggregate_id not in self._seqs:
            return await self._read_unheld(aggregate_id)
        subject = self.subject(aggregate_id)
        # Where the reading is: not the cache's sequence, which an aggregate
        # forgotten while it is read no longer has.
        position = self._seqs.get(aggregate_id, 0)
        if not news_expected:
            last = await last_sequence(self._js, self._stream, subject, from_leader=from_leader)
        else:
            last_msg, first = await asyncio.gather(
                last_message(self._js, self._stream, subject, from_leader=from_leader),
                self._next_or_none(subject, position + 1),
            )
            last = 0 if last_msg is None else last_msg.seq or 0
            if first is not None:
                position = self._apply_raw(aggregate_id, first)
            if (
                from_leader  # (a direct get's headers are not the stored ones alone)
                and last_msg is not None
                and _previous_on_subject(last_msg) == position
            ):
                # The last event names the one before it on the subject (its fence,
                # checked by the server when it was stored): the one just read, so
                # nothing lies between them and nothing more is read.
                position = self._apply_raw(aggregate_id, last_msg)
        while position < last:
            raw = await self._next_or_none(subject, position + 1)
            if raw is None:
                break
            position = self._apply_raw(aggregate_id, raw)
        return self.get(aggregate_id)

    async def _read_unheld(self, aggregate_id: str) -> tuple[S | None, int]:
        """`sync` of an aggregate a forgetting store does not hold (forgotten,
        or not folded yet): what the log has, as this store would keep it, but
        not kept: the follower folds it in order if it is one to keep (a state
        put in beside it could miss what it folds meanwhile), and no listener
        sees a state of its past."""
        state, last = await self.read_whole(aggregate_id)
        if state is not None and self._compact is not None:
            state = self._compact(state)
        assert self._forget is not None
        if state is None or self._forget(state):
            return None, 0
        return state, last

    async def _next_or_none(self, subject: str, seq: int) -> RawStreamMsg | None:
        """The subject's first message from `seq` on, None if there is none."""
        try:
            # Not a direct get: its answer's headers would hide a stored message
            # bounced onto this subject (codec.reflected, decision 034).
            return await patiently(partial(self._next_msg, subject, seq), attempt_s=2.0)
        except NotFoundError:
            return None

    def _apply_raw(self, aggregate_id: str, raw: RawStreamMsg) -> int:
        """Fold one message read; its sequence."""
        # A message stored without the fence is not an event (follow.py): passed
        # over, so the next append still expects the subject's real last sequence.
        believed = [decode_envelope(raw.data or b"")] if has_fence(raw.headers) else []
        seq = raw.seq or 0
        self._apply(aggregate_id, seq, believed, (raw.headers or {}).get(context.TRACEPARENT))
        return seq

    async def _next_msg(self, subject: str, seq: int) -> RawStreamMsg:
        return await self._js.get_msg(self._stream, seq=seq, subject=subject, next=True)

    async def read_whole(self, aggregate_id: str) -> tuple[S | None, int]:
        """The aggregate folded from its first event, not compacted, and the
        subject's last sequence it covers: what a compacted state dropped, read
        back for the decision that needs it. Not kept: the next change compacts."""
        subject = self.subject(aggregate_id)
        last = await last_sequence(self._js, self._stream, subject, from_leader=True)
        records = await read_range(
            self._js, self._stream, subject, decode_envelope, until_seq=last,
            what=f"{self._kind} events",
        )  # fmt: skip
        return fold(self._evolve, (envelope for _, _, envelope in records), None), last

    # --- deciding -------------------------------------------------------------

    async def follow_up(self, aggregate_id: str, decide: Decide[S], *, why: str) -> Executed[S]:
        """A decision a service makes on its own (not for a request): it is caused
        by the state it was decided on, so two instances deciding it agree on ids."""
        # No trace is continued here: a decision on a timer (a scheduled save, a
        # host that stopped renewing) starts its own; one set off by an event runs
        # in a reconcile pass that already continues that event's (`DirtyLoop`).
        _, seq = self.get(aggregate_id)
        cause = f"{aggregate_id}@{seq}"
        return await self.execute(
            aggregate_id,
            decide,
            id_base=f"{self._actor}:{why}",
            causation_id=cause,
            correlation_id=cause,
        )

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
        whole: Callable[[S | None], bool] | None = None,
    ) -> Executed[S]:
        """Decide on the current state and append the result behind the fence.

        `decide` may raise `Rejected`; that propagates unchanged. On a
        conflict the aggregate is re-read and `decide` runs again. `whole(state)`:
        whether `decide` may read what the store's compaction dropped from this
        state; it then decides on the whole state read back (`read_whole`, fresh
        from the leader), and `Executed.state` is the whole one.
        """
        lock, users = self._locks.get(aggregate_id, (None, 0))
        if lock is None:
            lock = asyncio.Lock()
        self._locks[aggregate_id] = (lock, users + 1)
        try:
            async with lock:
                return await self._execute(
                    aggregate_id, decide, id_base, causation_id, correlation_id, trace_id,
                    attempts, whole,
                )  # fmt: skip
        finally:
            lock, users = self._locks[aggregate_id]
            if users == 1:
                del self._locks[aggregate_id]
            else:
                self._locks[aggregate_id] = (lock, users - 1)

    async def _execute(
        self,
        aggregate_id: str,
        decide: Decide[S],
        id_base: str,
        causation_id: str,
        correlation_id: str,
        trace_id: str | None,
        attempts: int,
        whole: Callable[[S | None], bool] | None,
    ) -> Executed[S]:
        # Decided on what was last read, even where nothing follows the log (a
        # host-agent's store, read on demand): events decided on an old state are
        # refused by the fence and decided again after a read, so only a refusal
        # or "nothing to do" needs a state just read before it is believed. (A
        # read first cost every report of a host a round trip: two per command.)
        synced = False
        read_back: tuple[S | None, int] | None = None  # the whole state, when needed
        for _ in range(attempts):
            state, seq = read_back or self.get(aggregate_id)
            if read_back is None and state is None and self._forget is not None:
                # Not held: never created, not folded yet, or forgotten (`forget`).
                # Decided on what the log has; what it appends is the follower's
                # to fold (`_append`), if the aggregate is one to keep.
                read_back = await self.read_whole(aggregate_id)
                state, seq = read_back
            elif read_back is None and whole is not None and whole(state):
                read_back = await self.read_whole(aggregate_id)
                state, seq = read_back
                # The events decided are folded into the cache once appended: it
                # must be where the whole state is, or they would be folded onto
                # a state missing what came between (and those never folded).
                await self.sync(aggregate_id)
            try:
                events = decide(state)
            except Rejected:
                if synced or read_back is not None:
                    raise
                # Never refuse on a stale cache: read what is really there first.
                await self.sync(aggregate_id)
                synced = True
                continue
            if not events:
                if not self._follow and not synced and read_back is None:
                    await self.sync(aggregate_id)  # nothing keeps it current but this
                    synced = True
                    continue
                return Executed(state, seq, [])
            with context.span(
                # (the ignore: our tags are all str; msgspec's may be int)
                "append " + " ".join(e.__struct_config__.tag for e in events),  # type: ignore[misc]
                kind="producer",
                **{f"{self._kind}_id": aggregate_id},
            ):
                done = await self._append(
                    aggregate_id, events, seq, id_base, causation_id, correlation_id, trace_id
                )
            if done is None:
                await self.sync(aggregate_id)
                synced, read_back = True, None
                continue
            appended, last = done
            if read_back is not None or aggregate_id not in self._seqs:
                # The whole state, as the cache's now is; or one the cache forgot
                # as these were folded: what it was decided on, and them.
                return Executed(fold(self._evolve, appended, state), last, appended)
            state, seq = self.get(aggregate_id)
            return Executed(state, seq, appended)
        raise InfraError(
            f"{aggregate_id}: gave up after {attempts} conflicting appends", retryable=True
        )

    async def _append(
        self,
        aggregate_id: str,
        events: list[AnyEvent],
        seq: int,
        id_base: str,
        causation_id: str,
        correlation_id: str,
        trace_id: str | None,
    ) -> tuple[list[Envelope], int] | None:
        """Append `events` after `seq` and apply them; the envelopes and the last
        one's sequence, None if someone wrote first."""
        envelopes = wrap(
            events,
            aggregate_id=aggregate_id,
            # The expected sequence is part of the id: the same decision on the
            # same state dedupes, a new decision on newer state never does.
            id_base=f"{id_base}@{seq}",
            actor=self._actor,
            causation_id=causation_id,
            correlation_id=correlation_id,
            time=time.time(),
            trace_id=trace_id or context.trace_id(),
        )
        try:
            sequences = await append(
                self._js, self._stream, self.subject(aggregate_id), envelopes, seq
            )
        except WrongSequence:
            return None
        traceparent = context.traceparent()
        previous = seq
        for envelope, new_seq in zip(envelopes, sequences, strict=True):
            # Folded here only onto the state it follows: a decision made on a
            # state read back (not held, or held behind it) leaves them to the
            # follower, which folds what lies between first.
            if self._seqs.get(aggregate_id, 0) == previous:
                self._apply(aggregate_id, new_seq, [envelope], traceparent)
            previous = new_seq
        return envelopes, sequences[-1]


class Grouping(Generic[S]):
    """A store's aggregates by a key of their state (`AggregateStore.group`),
    e.g. sandboxes by the host they hold a place on: who is on a host, or how
    many, without going through every aggregate."""

    def __init__(self, store: AggregateStore[S], key: Callable[[S], str | None]) -> None:
        self._store = store
        self._key = key
        self._group_of: dict[str, str] = {}
        self._members: dict[str, set[str]] = {}

    def changed(self, aggregate_id: str) -> None:
        state, _ = self._store.get(aggregate_id)
        now = self._key(state) if state is not None else None
        before = self._group_of.get(aggregate_id)
        if now == before:
            return
        if before is not None:
            self._members[before].discard(aggregate_id)
            if not self._members[before]:
                del self._members[before]
        if now is None:
            del self._group_of[aggregate_id]
        else:
            self._group_of[aggregate_id] = now
            self._members.setdefault(now, set()).add(aggregate_id)

    def members(self, group: str) -> set[str]:
        return set(self._members.get(group, ()))

    def sizes(self) -> dict[str, int]:
        return {group: len(members) for group, members in self._members.items()}


_SELECTED = "selected"


class Selection(Grouping[S]):
    """Some of a store's aggregates, by their state (`AggregateStore.select`): a
    periodic pass over them costs what they are, not every aggregate the log
    ever held (a deleted sandbox kept in the store costs no pass). One
    group of a grouping: those that pass."""

    def __init__(self, store: AggregateStore[S], keep: Callable[[S], bool]) -> None:
        super().__init__(store, lambda state: _SELECTED if keep(state) else None)

    def ids(self) -> list[str]:
        """A copy, in a stable order: the pass may change the selection."""
        return sorted(self.members(_SELECTED))

    def __len__(self) -> int:
        return len(self._members.get(_SELECTED, ()))


def _previous_on_subject(raw: RawStreamMsg) -> int | None:
    """The sequence of the subject's message before an event: what its append
    expected (`FENCE_HEADER`); None for a message that is no event."""
    if not has_fence(raw.headers):
        return None
    try:
        return int((raw.headers or {})[FENCE_HEADER])
    except ValueError:
        return None
