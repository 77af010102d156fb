"""The saver: asks for saves on schedule, and makes a save count only once verified.

It is also the reaper: a running sandbox idle for its `idle_timeout_s` (no command
queued or running, none ended, no touch) is stopped with its final save, and a
stopped one kept for its `keep_stopped_s` is deleted (decision 074).

It follows every sandbox's events. Each second it requests the saves that are
due; whenever a sandbox changes it sends the save work its state calls for,
verifies uploaded saves against the save store (manifest and every chunk it
names) before appending `SaveCompleted`, fails saves that took too long, and
applies retention. Now and then it collects chunks no retained save needs.

Two savers at once (docs/deploy.md): scheduling, timeouts, retention and save
instructions are decided by both, on the same state, with the same ids, so the
fence lets one append and the other's is the same event (one save per
schedule slot: its id is `scheduled@<seq>`). Verification and garbage
collection judge the save store together and must take turns, across
processes too: only the instance holding the claim `saver.claim.store` does
them (claims.py), and `<prefix>.admin.gc` is answered by that one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable

import msgspec
from sandhold.bus.claims import Claim
from sandhold.bus.codec import reflected
from sandhold.bus.instances import instance_bucket
from sandhold.bus.names import Names
from sandhold.bus.reconciler import DirtyLoop, send_work
from sandhold.bus.service import Shell, instance_name
from sandhold.domain import events as ev
from sandhold.domain import sandbox as sb
from sandhold.domain import saver as policy
from sandhold.domain.envelope import Envelope
from sandhold.domain.errors import InfraError, SandholdError
from sandhold.domain.saves import SaveRecord
from sandhold.saves import (
    CorruptManifest,
    MissingManifest,
    SaveStore,
    collect_garbage,
    delete_unretained_manifests,
)

log = logging.getLogger("sandhold.saver")

# How often the sandboxes kept stopped for a time are looked at: their deletion
# is due days after their stop, so a few seconds late is nothing.
KEPT_LOOK_S = 5.0


class Saver:
    name = "saver"

    def __init__(
        self,
        nats_url: str,
        names: Names,
        *,
        tick_s: float = 1.0,
        save_timeout_s: float = 600.0,
        keep_last: int = 5,
        gc_interval_s: float = 600.0,
        gc_grace_s: float = 3600.0,
        instance: str | None = None,
        claim_ttl: float = 5.0,
    ) -> None:
        self._names = names
        self._shell = Shell(self.name, nats_url, names)
        self.instance = instance or instance_name(self.name)
        self._claim_ttl = claim_ttl
        self._tick_s = tick_s
        self._save_timeout_s = save_timeout_s
        self._keep_last = keep_last
        self._gc_interval_s = gc_interval_s
        self._gc_grace_s = gc_grace_s
        self._dirty_loop = DirtyLoop(
            self._reconcile,
            what="reconciling saves",
            trace_of=lambda sid: self.sandboxes.trace_of(sid),
        )
        # Verification and garbage collection take turns, so GC never judges the
        # store while a save is between "all chunks present" and SaveCompleted;
        # across processes, only the holder of the store claim does either.
        self._store_lock = asyncio.Lock()
        self._duty_taken = asyncio.Event()
        # Saves ended for good (expired or failed) since the last collection. The
        # store keeps no record of most of them (decision 068), so the next
        # collection is told of them from here and deletes their manifests then,
        # not a grace later. (Lost with the process: the grace catches those.)
        self._ended_saves: set[str] = set()

    async def run(self) -> None:
        async with self._shell as shell:
            self._js = shell.js
            self.store = SaveStore(shell.nc, self._names)
            self.sandboxes = shell.store(
                "sandbox", sb.evolve, compact=sb.compact, forget=sb.forgettable
            )
            self.sandboxes.listen(self._mark_dirty)
            self.sandboxes.watch(self._note_ended_saves)
            # What the schedule looks at each tick (not every sandbox ever made).
            self._scheduled = self.sandboxes.select(policy.on_schedule)
            # Stopped ones to delete once kept their time (decision 074): a week
            # of tasks' sandboxes, so looked at every KEPT_LOOK_S, not each tick.
            self._kept = self.sandboxes.select(lambda s: sb.deletes_at(s) is not None)
            await shell.start_stores()
            self.duty = Claim(
                await instance_bucket(shell.js, self._names),
                self.name,
                "store",
                self.instance,
                ttl=self._claim_ttl,
                on_change=self._duty_changed,
            )
            await self.duty.look()  # free (the first saver, or one given up): verify at once
            shell.spawn(self.duty.run(), "store claim")
            shell.on_close(self.duty.release)
            for sandbox_id in self.sandboxes.ids():
                self._mark_dirty(sandbox_id)
            shell.spawn(self._schedule(), "schedule")
            shell.spawn(self._dirty_loop.run(), "reconcile")
            shell.spawn(self._collector(), "collector")
            await shell.nc.subscribe(f"{self._names.prefix}.admin.gc", cb=self._on_gc_request)
            log.info("saver ready")
            await shell.serve()

    async def shutdown(self) -> None:
        self._shell.stop()

    def _mark_dirty(self, sandbox_id: str) -> None:
        self._dirty_loop.mark(sandbox_id)

    def _note_ended_saves(self, _sandbox_id: str, envelopes: list[Envelope]) -> None:
        # Not those a fold from zero replays (a start without a checkpoint): a
        # manifest older than the grace goes at the next collection anyway, and
        # every save that ever ended would otherwise be held until then.
        recent = time.time() - self._gc_grace_s
        for envelope in envelopes:
            if envelope.time < recent:
                continue
            match envelope.event:
                case ev.SavesExpired(save_ids=save_ids):
                    self._ended_saves.update(save_ids)
                case ev.SaveFailed(save_id=save_id):
                    self._ended_saves.add(save_id)

    def _duty_changed(self, held: bool) -> None:
        if not held:
            self._duty_taken.clear()
            return
        self._duty_taken.set()
        # Saves a former holder left unverified are this instance's to verify now.
        for sandbox_id in self.sandboxes.ids():
            self._mark_dirty(sandbox_id)

    # --- the schedule -----------------------------------------------------------

    async def _schedule(self) -> None:
        kept_looked_at = 0.0
        while True:
            now = time.time()
            if now - kept_looked_at >= KEPT_LOOK_S:
                kept_looked_at = now
                await self._delete_kept(now)
            for sandbox_id in self._scheduled.ids():
                state, seq = self.sandboxes.get(sandbox_id)
                if state is None:
                    continue
                try:
                    if policy.due_save(state, now=now, cause=f"scheduled@{seq}"):
                        await self._follow_up(
                            sandbox_id,
                            lambda s, seq=seq, now=now: (
                                policy.due_save(s, now=now, cause=f"scheduled@{seq}") if s else []
                            ),
                            "schedule",
                        )
                    if sb.reap_if_idle(state, now=now, cause=str(seq)):
                        # Idle for its timeout: stopped with its final save, as a Stop
                        # is; a command (or a start) brings it back from that save.
                        await self._follow_up(
                            sandbox_id,
                            lambda s, seq=seq, now=now: (
                                sb.reap_if_idle(s, now=now, cause=str(seq)) if s else []
                            ),
                            "idle",
                        )
                    if policy.timed_out(state, now=now, timeout_s=self._save_timeout_s):
                        await self._follow_up(
                            sandbox_id,
                            lambda s, now=now: (
                                policy.timed_out(s, now=now, timeout_s=self._save_timeout_s)
                                if s
                                else []
                            ),
                            "timeout",
                        )
                except Exception as err:  # this sandbox's turn fails; the schedule goes on
                    log.warning("scheduling a save of %s: %r", sandbox_id, err)
            await asyncio.sleep(self._tick_s)

    async def _delete_kept(self, now: float) -> None:
        """Delete, as a Delete does, each sandbox stopped for its `keep_stopped_s`."""
        for sandbox_id in self._kept.ids():
            state, seq = self.sandboxes.get(sandbox_id)
            if state is None or not sb.delete_if_kept_long_enough(state, now=now, cause=str(seq)):
                continue
            try:
                await self._follow_up(
                    sandbox_id,
                    lambda s, seq=seq: (
                        sb.delete_if_kept_long_enough(s, now=now, cause=str(seq)) if s else []
                    ),
                    "kept stopped",
                )
            except Exception as err:  # this one's turn fails; the next look tries again
                log.warning("deleting %s, kept stopped its time: %r", sandbox_id, err)

    # --- reacting to changes ----------------------------------------------------

    async def _reconcile(self, sandbox_id: str) -> None:
        state, _ = self.sandboxes.get(sandbox_id)
        if state is None:
            return
        for host, work in policy.save_work(state):
            await send_work(self._js, self._names, host, work)
        if self.duty.held():  # else the twin holding the store claim verifies
            for save in policy.awaiting_verification(state):
                async with self._store_lock:
                    await self._verify(sandbox_id, save.id)
        if policy.expired(state, keep_last=self._keep_last):
            await self._follow_up(
                sandbox_id,
                lambda s: policy.expired(s, keep_last=self._keep_last) if s else [],
                "retention",
            )

    async def _verify(self, sandbox_id: str, save_id: str) -> None:
        if not self.duty.held():
            return  # lapsed while garbage collection had the lock: the new holder verifies
        state, _ = self.sandboxes.get(sandbox_id)
        if state is None or save_id not in state.saves:
            return  # (an uploaded save keeps its sandbox held: not expected)
        save = state.saves[save_id]
        # What the host stored just before it said so is read as the stream's leader
        # has it (a replica a moment behind is asked no further: SavesStream.get).
        problems, total_bytes, files = await self._check(save)
        if not self.duty.held():
            return  # lapsed meanwhile: whoever holds the claim now verifies it afresh
        await self._follow_up(
            sandbox_id,
            lambda s: (
                policy.verified(s, save_id, problems, total_bytes=total_bytes, files=files)
                if s
                else []
            ),
            f"verify:{save_id}",
        )
        log.info(
            "save %s of %s %s",
            save_id,
            sandbox_id,
            "failed verification: " + "; ".join(problems) if problems else "completed",
        )

    async def _check(self, save: SaveRecord) -> tuple[list[str], int, int]:
        """What stops `save` from counting (nothing: verified), its bytes and files.
        A store that cannot be reached raises: "could not check" fails nothing."""
        try:
            manifest = await self.store.get_manifest(save.id, digest=save.manifest_digest)
        except (MissingManifest, CorruptManifest) as err:
            return [f"manifest: {err}"], 0, 0
        except InfraError as err:
            if err.retryable:
                raise
            return [f"manifest: {err}"], 0, 0
        # Chunks new in this save are read back and re-hashed; the rest were
        # verified with the parent and only need to be present.
        known: set[str] = set()
        if save.parent_id:
            with contextlib.suppress(SandholdError):
                known = (await self.store.get_manifest(save.parent_id)).digests
        problems = await self.store.verify(
            manifest, recheck=manifest.digests - known, read_from_store=True
        )
        return problems, manifest.total_bytes, manifest.files

    # --- garbage collection -----------------------------------------------------

    async def _collector(self) -> None:
        while True:
            await asyncio.sleep(self._gc_interval_s)
            if not self.duty.held():
                self._ended_saves.clear()  # the twin holding the store claim collects
                continue
            try:
                await self.collect_garbage()
            except Exception:
                log.exception("garbage collection failed; will try again")

    async def collect_garbage(self, grace_s: float | None = None) -> dict[str, object]:
        async with self._store_lock:
            if not self.duty.held():
                raise NotHolding(
                    f"{self.instance} does not hold the store claim "
                    f"(held by {self.duty.seen_holder}): it neither verifies nor collects"
                )
            return await self._collect(self._gc_grace_s if grace_s is None else grace_s)

    async def _collect(self, grace_s: float) -> dict[str, object]:
        # What the log says now, including what a former holder appended a moment ago.
        await self.sandboxes.catch_up()
        states = (self.sandboxes.get(sandbox_id)[0] for sandbox_id in self.sandboxes.ids())
        retained, dropped = retained_and_dropped(s for s in states if s is not None)
        told = set(self._ended_saves)
        # Manifests of expired and failed saves go first (and any other no
        # retained save has, once older than the grace); then every chunk that
        # no retained manifest names (and that is older than the grace) goes too.
        now = time.time()
        manifests = await delete_unretained_manifests(
            self.store, {*dropped, *told}, retained, now=now, grace_s=grace_s
        )
        self._ended_saves -= told
        stats = await collect_garbage(
            self.store, retained, now=now, grace_s=grace_s, may_delete=self.duty.held
        )
        result = {**msgspec.structs.asdict(stats), "deleted_manifests": manifests}
        log.info("garbage collection: %s", result)
        return result

    async def _on_gc_request(self, msg) -> None:
        """`<prefix>.admin.gc` (core request/reply): collect now, answer with the counts.

        Every saver hears it; the one holding the store claim answers. Another
        answers only if the claim comes to it while the caller still waits (its
        holder is gone), so a request is answered once, however many savers run."""
        if reflected(msg.headers):
            log.error("a bounced stored message on %s: not a request, dropped", msg.subject)
            return
        if not self.duty.held():
            handover = self.duty.ttl + self.duty.margin + 2 * self.duty.interval
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._duty_taken.wait(), handover)
            if not self.duty.held():
                log.info(
                    "%s: %s left to %s, which holds the store claim",
                    self.instance,
                    msg.subject,
                    self.duty.seen_holder,
                )
                return
        try:
            body = msgspec.json.decode(msg.data) if msg.data else {}
            result = {"ok": True, **await self.collect_garbage(body.get("grace_s"))}
        except Exception as err:  # the caller gets the reason; the saver carries on
            result = {"ok": False, "error": str(err)}
        await msg.respond(msgspec.json.encode({**result, "instance": self.instance}))

    async def _follow_up(self, sandbox_id: str, decide, why: str) -> None:
        await self.sandboxes.follow_up(sandbox_id, decide, why=why)


class NotHolding(SandholdError):
    """This saver does not hold the store claim: its twin verifies and collects."""


def retained_and_dropped(states: Iterable[sb.Sandbox]) -> tuple[list[str], list[str]]:
    """The saves garbage collection keeps (with every chunk they name), and those
    whose manifests it removes.

    Kept: what retention keeps, and saves uploaded and awaiting verification. A
    verification by a former holder of the store claim (paused past its claim)
    may still append `SaveCompleted` for one; its chunks stay until it ends one
    way or the other, as the log will say at the next collection."""
    retained: set[str] = set()
    dropped: set[str] = set()
    for state in states:
        retained.update(policy.retained(state))
        retained.update(s.id for s in policy.awaiting_verification(state))
        dropped.update(policy.dropped(state))
    return sorted(retained), sorted(dropped)
