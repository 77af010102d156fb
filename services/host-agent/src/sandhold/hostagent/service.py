"""The host-agent: does the work sent to its host and reports what happened.

It registers its host (a new epoch on every start), renews its lease, takes
instructions off `<prefix>.work.<host>` and its save instructions off
`<prefix>.work.<host>.saves` (decision 064), runs them with the process driver,
streams command output to OUTPUT, and reports facts to the sandbox's subject
through the domain's `decide_report`: a report for a superseded placement is
refused there, and the append's expected sequence refuses anything decided
on stale state.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from pathlib import Path
from typing import NamedTuple

import msgspec
import nats.errors
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, Header
from nats.js.errors import NotFoundError
from sandhold.bus import leases
from sandhold.bus.cancelling import cancel_and_wait
from sandhold.bus.codec import OFFSET_HEADER, STREAM_HEADER, reflected
from sandhold.bus.electing import ELECTING
from sandhold.bus.names import Names
from sandhold.bus.reconciler import dead_letter
from sandhold.bus.service import Shell
from sandhold.domain import events as ev
from sandhold.domain import host as host_domain
from sandhold.domain import recovery
from sandhold.domain import sandbox as sb
from sandhold.domain import work as wk
from sandhold.domain.errors import InfraError, Rejected, SandholdError
from sandhold.domain.reports import HostReport, decide_report
from sandhold.hostagent.driver import CommandExit, CommandHandle, OutputChunk, ProcessDriver
from sandhold.hostagent.driver.boxes import IsolationUnavailable, SandboxSettings
from sandhold.hostagent.driver.driver import DEFAULT_PIDS_LIMIT, Isolation, SandboxNotFound
from sandhold.hostagent.driver.port import SandboxDriver
from sandhold.hostagent.saving import LOOK_MAX_NAMES, HostSaves
from sandhold.saves import DEFAULT_CACHE_BYTES, ChunkCache, SaveStore
from sandhold.telemetry import context, metrics

log = logging.getLogger("sandhold.host-agent")

_work_decoder = msgspec.json.Decoder(wk.AnyWork)

# Work messages in hand at once per queue (the work, the saves), across
# sandboxes (each sandbox's one at a time).
WORK_CONCURRENCY = 32

# How long a work message delivered and never answered waits to be delivered
# again. Messages in hand are kept alive meanwhile (`consume`), so this is not a
# bound on a restore or a final save: it is how late a run instruction lost on
# its way here (the node this agent was connected to killed as it delivered
# it) still starts.
WORK_ACK_WAIT_S = 10.0


class _Lane(msgspec.Struct):
    sandbox_id: str = ""


_lane_decoder = msgspec.json.Decoder(_Lane)


def _work_lane(msg: Msg) -> str:
    """The sandbox a work message is for ("" for what does not decode: handled,
    and refused, in a lane of its own)."""
    try:
        return _lane_decoder.decode(msg.data).sandbox_id
    except (msgspec.DecodeError, msgspec.ValidationError):
        return ""


_lease_decoder = msgspec.json.Decoder(leases.Lease)


class KilledInFence(msgspec.Struct, frozen=True, kw_only=True):
    """Written next to a sandbox's files when a fence killed its processes: the
    loss is said once the log can be written again, by this agent or the next."""

    generation: int
    last_renewal_at: float  # wall time of the last renewal before the fence
    fenced_at: float  # wall time by which its processes were killed


_fence_decoder = msgspec.json.Decoder(KilledInFence)


class HostAgent:
    name = "host-agent"

    def __init__(
        self,
        nats_url: str,
        names: Names,
        *,
        host_id: str,
        root: Path,
        capacity_sandboxes: int = 64,
        chunk_cache_bytes: int = DEFAULT_CACHE_BYTES,
        lease_interval: float = 1.0,
        lease_ttl: float = 5.0,
        stale_copies: str = "destroy",
        interrupt_on_exit: bool = False,
        isolation: Isolation = "namespaces",
        image_roots: list[Path] | None = None,
        warm_supervisors: int = 2,
    ) -> None:
        self._names = names
        self._warm = warm_supervisors
        self.host_id = host_id
        connection = f"sandhold-host-agent-{host_id}"
        self._shell = Shell(self.name, nats_url, names, connection_name=connection)
        self._root = Path(root)
        self._capacity = capacity_sandboxes
        self._chunk_cache_bytes = chunk_cache_bytes
        self.cache: ChunkCache | None = None
        self._lease_interval = lease_interval
        self._lease_ttl = lease_ttl
        self._stale_copies = stale_copies  # "destroy" | "quarantine"
        self._last_renewed: float | None = None  # monotonic time of the last renewal
        self._last_renewed_at = 0.0  # and its wall time, as the lease says it
        self._fenced = False
        self._fencing: asyncio.Task[None] | None = None  # the one fence under way
        self._interrupt_on_exit = interrupt_on_exit
        self._isolation: Isolation = isolation
        self._image_roots = image_roots
        self._watchers: dict[str, asyncio.Task[None]] = {}  # command id -> watcher
        self._watcher_sandbox: dict[str, str] = {}
        self._jobs: set[asyncio.Task[None]] = set()
        self.epoch = 0

    # --- lifecycle ------------------------------------------------------------

    async def run(self) -> None:
        self.driver: SandboxDriver = ProcessDriver(
            self._root,
            self.host_id,
            warm=self._warm,
            isolation=self._isolation,
            image_roots=self._image_roots,
        )
        async with self._shell as shell:
            self._nc, self._js = shell.nc, shell.js
            await self.driver.start()
            shell.on_close(self.driver.close)
            actor = f"host-agent:{self.host_id}"
            # Read on demand, never followed: a host-agent may create no consumer on
            # the log (a push consumer delivers where its maker says, decision 032).
            self.sandboxes = shell.store(
                "sandbox", sb.evolve, actor=actor, follow=False, compact=sb.compact
            )
            self.hosts = shell.store("host", host_domain.evolve, actor=actor, follow=False)
            await shell.start_stores()
            if self._chunk_cache_bytes > 0:
                self.cache = await asyncio.to_thread(
                    ChunkCache, self._root / "chunk-cache", self._chunk_cache_bytes
                )
                cache = self.cache
                metrics.watch_chunk_cache(
                    self.host_id, lambda: msgspec.structs.asdict(cache.stats())
                )
            self.saving = HostSaves(
                shell.nc,
                self._names,
                self.driver,
                SaveStore(shell.nc, self._names),
                self._root,
                self.host_id,
                cache=self.cache,
            )
            for sandbox_id in self.driver.layout.sandbox_ids():
                # A previous agent may have died between freeze and thaw.
                with contextlib.suppress(Exception):
                    await self.driver.thaw(sandbox_id)
            self._kv = await leases.lease_bucket(shell.js, self._names)
            await self._declare_killed_copies()
            await self._register()
            await self._drop_stale_copies()
            await self._claim_cgroups()
            await self._adopt_commands()
            await self._check_connections()
            shell.on_close(self._end_watchers)
            shell.spawn(self._renew_lease(), "lease renewal")
            # Two queues (decision 064): saves come in bursts (every changed
            # sandbox every interval), and a command taken off one queue with
            # them would wait behind the burst; a restore or a final save (part
            # of a start or a stop) keeps its sandbox's order with the rest.
            working = [
                await shell.work_queue(
                    self._names.hostwork_stream,
                    # Work given up on is dropped: whoever sent it sends again what
                    # the state calls for.
                    ConsumerConfig(
                        durable_name=self._names.work_consumer(self.host_id, saves=saves),
                        filter_subject=self._names.work(self.host_id, saves=saves),
                        ack_policy=AckPolicy.EXPLICIT,
                        ack_wait=WORK_ACK_WAIT_S,
                        max_deliver=20,
                    ),
                    functools.partial(self._handle, saves_only=saves),
                    what=f"{'saves' if saves else 'work'} for {self.host_id}",
                    # Each sandbox's work in order, sandboxes side by side: a command
                    # never waits behind another sandbox's restore or final save.
                    lane=_work_lane,
                    concurrency=WORK_CONCURRENCY,
                )
                for saves in (False, True)
            ]
            shell.on_stopping(lambda: self._wind_down(working))
            log.info(
                "host-agent %s ready (epoch %d, %s)",
                self.host_id,
                self.epoch,
                self.driver.capabilities(),
            )
            await shell.serve(host=self.host_id, epoch=self.epoch)

    async def _wind_down(self, working: list[asyncio.Task[None]]) -> None:
        """No new work, no job left half-done; with `interrupt_on_exit`, every
        command interrupted while the lease is still renewed (a slow command's
        grace must not look like a host failure)."""
        with contextlib.suppress(asyncio.CancelledError):
            await cancel_and_wait(working)
        with contextlib.suppress(asyncio.CancelledError):
            await self._end_jobs(timeout=_WIND_DOWN_JOBS_S)
        if self._interrupt_on_exit:
            await self._interrupt_everything()

    async def _end_watchers(self) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            await cancel_and_wait(list(self._watchers.values()))

    async def shutdown(self) -> None:
        self._shell.stop()

    async def _register(self) -> None:
        await self._adopt_recovery_settings()
        previous = 0
        with contextlib.suppress(Exception):
            entry = await self._kv.get(self.host_id)
            if entry.value:
                previous = _lease_decoder.decode(entry.value).epoch
        registered, _ = await self.hosts.sync(self.host_id)
        self.epoch = max(previous, registered.epoch if registered else 0) + 1
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        registration = ev.HostRegistered(
            host=self.host_id,
            epoch=self.epoch,
            capacity_sandboxes=self._capacity,
            memory_bytes=memory,
            capabilities={k: str(v) for k, v in self.driver.capabilities().items()},
        )
        await self.hosts.execute(
            self.host_id,
            lambda state: host_domain.decide_register(state, registration),
            id_base=f"register:{self.epoch}",
            causation_id=f"{self.host_id}:start:{self.epoch}",
            correlation_id=f"{self.host_id}:start:{self.epoch}",
        )
        await self._put_lease()

    async def _adopt_recovery_settings(self) -> None:
        """Fence no later than recovery would: if the recovery service publishes a
        shorter lease TTL than ours, ours must not outlast it."""
        with contextlib.suppress(Exception):
            entry = await self._kv.get(leases.SETTINGS_KEY)
            settings = msgspec.json.decode(entry.value or b"{}", type=leases.RecoverySettings)
            if settings.lease_ttl_s < self._lease_ttl:
                log.warning(
                    "lease TTL %.1fs follows recovery's (was %.1fs)",
                    settings.lease_ttl_s,
                    self._lease_ttl,
                )
                self._lease_ttl = settings.lease_ttl_s

    async def _put_lease(self) -> None:
        # The lease counts from when it is offered, as its `renewed_at` says and as
        # recovery reads it: a put whose acknowledgement is slow (an fsync on a busy
        # disk) or comes after a pause must not stretch this agent's own deadline.
        offered = time.monotonic()
        lease = leases.Lease(
            host=self.host_id,
            epoch=self.epoch,
            renewed_at=time.time(),
            interval_s=self._lease_interval,
            chunk_cache=self.cache.stats() if self.cache is not None else None,
        )
        await leases.renew(self._kv, lease)
        self._last_renewed = offered
        self._last_renewed_at = lease.renewed_at

    def _lease_expired(self) -> bool:
        return (
            self._last_renewed is not None
            and time.monotonic() - self._last_renewed > self._lease_ttl
        )

    async def _renew_lease(self) -> None:
        while True:
            # Checked before renewing: a process that was paused (SIGSTOP) must
            # notice the gap before its first renewal makes it look alive again.
            try:
                # Checked before renewing: a process that was paused (SIGSTOP) must
                # notice the gap before its first renewal makes it look alive again.
                if self._fenced or self._lease_expired():
                    # (One begun elsewhere, by a report, is finished first.) Back
                    # only once every process here is killed.
                    if await self._fence():
                        await self._come_back()
                else:
                    # Bounded by what is left of the lease: a put that hangs must not
                    # keep this agent from noticing that it has to fence itself.
                    left = self._lease_ttl - (time.monotonic() - (self._last_renewed or 0.0))
                    await asyncio.wait_for(self._put_lease(), max(0.05, left))
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is None or task.cancelling():
                    raise  # the agent is stopping
                # A cancellation meant for an await inside (a timed-out put's)
                # that escaped: the lease is still this loop's to renew.
                log.error("lease renewal: a stray cancellation; renewing on")
                metrics.lease_renewal_failed(self.host_id)
            except Exception as err:  # a missed renewal is the recovery service's business
                log.warning("lease renewal failed: %s", err)
                metrics.lease_renewal_failed(self.host_id)
            await asyncio.sleep(self._until_next_check())

    def _until_next_check(self) -> float:
        """The next renewal, or the lease's deadline if that comes first: after a
        failed renewal the fence must start at the deadline, not up to an interval
        later (recovery's fence margin is counted from the deadline)."""
        if self._fenced or self._last_renewed is None:
            return self._lease_interval
        deadline = self._last_renewed + self._lease_ttl - time.monotonic()
        return max(0.01, min(self._lease_interval, deadline + 0.01))

    async def _fence(self) -> bool:
        """Fence once, whoever notices first (the renewal loop, a report): the
        others wait for the same fence instead of running a second one beside it.
        False: the fence failed; still fenced, and the next call fences again."""
        if self._fencing is None:
            self._fenced = True  # from this moment on, whatever the fence meets
            self._fencing = asyncio.create_task(self._fence_self())
        fencing = self._fencing
        try:
            await asyncio.shield(fencing)
        except asyncio.CancelledError:
            raise
        except Exception as err:
            # Still fenced; the next caller fences again rather than re-raising this.
            log.error("fencing %s failed, will try again: %r", self.host_id, err)
            if self._fencing is fencing:
                self._fencing = None
            return False
        return True

    async def _fence_self(self) -> None:
        """No renewal for lease_ttl: others may already run our sandboxes elsewhere.
        Kill every sandbox process here and write nothing more about them."""
        self._fenced = True
        log.error(
            "host-agent %s could not renew its lease for %.1fs: fencing itself",
            self.host_id,
            self._lease_ttl,
        )
        # A save under way would freeze a box the fence is killing (a frozen process
        # cannot die): saves end first; they count as failed by the saver's timeout.
        await self._end_jobs(timeout=_FENCE_JOBS_S)
        for sandbox_id in self.driver.layout.sandbox_ids():
            with contextlib.suppress(Exception):
                await self.driver.stop_sandbox(sandbox_id, grace=0.0)
            # Wherever they are recovered, they are delivered anew; none stay here.
            with contextlib.suppress(Exception):
                await self.driver.remove_connections(sandbox_id)
            generation = self._local_generation(sandbox_id)
            if generation is not None:
                killed = KilledInFence(
                    generation=generation,
                    last_renewal_at=self._last_renewed_at,
                    fenced_at=time.time(),
                )
                with contextlib.suppress(OSError):
                    self._fence_file(sandbox_id).write_bytes(msgspec.json.encode(killed))

    async def _come_back(self) -> None:
        """Reachable again: the copies the fence killed are lost, a new epoch, then
        drop the copies that now belong to another placement, silently (their
        sandboxes' logs moved on without us)."""
        await self._declare_killed_copies()
        await self._register()
        await self._drop_stale_copies()
        self._fenced = False
        self._fencing = None
        log.warning("host-agent %s is back with epoch %d", self.host_id, self.epoch)

    def _generation_file(self, sandbox_id: str) -> Path:
        return self.driver.layout.sandbox_dir(sandbox_id) / "generation"

    def _fence_file(self, sandbox_id: str) -> Path:
        return self.driver.layout.sandbox_dir(sandbox_id) / "killed-in-fence"

    async def _declare_killed_copies(self) -> None:
        """A placement whose processes the fence killed is lost. Recovery says so
        when it judges the host before the host is back; when the host is back
        first (NATS away for everyone, then back for everyone at once), the new
        epoch's lease looks fine and nobody else ever would: its commands would
        stay `running` forever. So this agent says it, before its new epoch."""
        for sandbox_id in self.driver.layout.sandbox_ids():
            marker = self._fence_file(sandbox_id)
            try:
                killed = _fence_decoder.decode(marker.read_bytes())
            except FileNotFoundError:
                continue
            except (OSError, msgspec.DecodeError) as err:
                log.error("%s: unreadable fence record (%s): judged by recovery", sandbox_id, err)
                marker.unlink(missing_ok=True)
                continue
            decide = functools.partial(
                recovery.declare_lost_here,
                host=self.host_id,
                generation=killed.generation,
                last_renewal_at=killed.last_renewal_at,
                fence_at=killed.fenced_at,
            )
            await self.sandboxes.sync(sandbox_id)
            await self.sandboxes.follow_up(sandbox_id, decide, why="killed-in-fence")
            marker.unlink(missing_ok=True)

    def _local_generation(self, sandbox_id: str) -> int | None:
        try:
            return int(self._generation_file(sandbox_id).read_text())
        except (OSError, ValueError):
            return None

    def _is_current(self, sandbox_id: str) -> bool:
        state, _ = self.sandboxes.get(sandbox_id)
        return (
            state is not None
            and state.host == self.host_id
            and state.generation == self._local_generation(sandbox_id)
            and state.phase not in ("lost", "recovering", "deleted")
        )

    async def _adopt_commands(self) -> None:
        """Watch the commands an earlier agent launched here: their ends are this
        one's to report, and their starts if that agent did not report them (it
        died within moments of a launch, decision 095)."""
        for handle in await self.driver.adopt_all():
            state, _ = self.sandboxes.get(handle.sandbox_id)
            if state is not None and self._is_current(handle.sandbox_id):
                cause = f"{handle.command_id}:adopted"
                self._watch(handle, _Launch(handle.command_id, state.generation, cause))

    async def _check_connections(self) -> None:
        """Connections live on a tmpfs: after a reboot (or a full shutdown, which
        removes them) a sandbox still placed here has none. Say so, and the
        scheduler delivers them again before its next command runs."""
        for sandbox_id in self.driver.layout.sandbox_ids():
            state, _ = self.sandboxes.get(sandbox_id)
            if not self._is_current(sandbox_id) or state is None:
                continue
            if state.connections_delivered is None or state.phase != "running":
                continue
            if self.driver.connection_names(sandbox_id) == sorted(state.connections):
                continue
            dropped = ev.ConnectionsDropped(
                host=self.host_id, generation=state.generation, epoch=self.epoch
            )
            with contextlib.suppress(Rejected):
                await self._report(sandbox_id, dropped, f"{self.host_id}:start:{self.epoch}")

    async def _drop_stale_copies(self) -> None:
        """Never fails: it runs after a new epoch is registered, and a come-back
        that failed there would register yet another epoch on its next try. A
        copy that cannot be judged or dropped now is dropped at the next start."""
        for sandbox_id in self.driver.layout.sandbox_ids():
            try:
                await self._drop_if_stale(sandbox_id)
            except Exception as err:
                log.warning("stale copy of %s not dropped now: %r", sandbox_id, err)

    async def _claim_cgroups(self) -> None:
        try:
            removed = await self.driver.claim_cgroups()
        except OSError as err:  # a sandbox's start then says what is wrong with them
            log.warning("this host's cgroups not claimed: %s", err)
            return
        if removed:
            log.info(
                "removed the empty cgroups of %d sandboxes this host does not hold "
                "(left by a data dir that is gone)",
                len(removed),
            )

    async def _drop_if_stale(self, sandbox_id: str) -> None:
        # Judged on the log as its leader has it: a copy is never dropped on a
        # reading a moment behind.
        await self.sandboxes.sync(sandbox_id, from_leader=True)
        if self._is_current(sandbox_id):
            return
        log.warning("dropping stale copy of %s (%s)", sandbox_id, self._stale_copies)
        if self._stale_copies == "quarantine":
            await self.driver.stop_sandbox(sandbox_id, grace=0.0)
            target = self._root / "quarantine" / f"{sandbox_id}-{int(time.time())}"
            target.parent.mkdir(parents=True, exist_ok=True)
            self.driver.layout.sandbox_dir(sandbox_id).rename(target)
            with contextlib.suppress(Exception):
                await self._destroy(sandbox_id)
        else:
            await self._destroy(sandbox_id)

    async def _destroy(self, sandbox_id: str) -> None:
        """The copy gone from this host: its processes, cgroups and files, and
        what its saves keep here (their spool: the parent manifests)."""
        await self.driver.destroy_sandbox(sandbox_id)
        await asyncio.to_thread(self.saving.forget, sandbox_id)

    # --- work -----------------------------------------------------------------

    async def _handle(self, msg: Msg, *, saves_only: bool = False) -> None:
        if reflected(msg.headers):
            # Another host had the server bounce bytes of its own here (decision 034).
            log.error("a bounced stored message on %s: not work, dropped", msg.subject)
            await msg.term()
            return
        try:
            work = _work_decoder.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as err:
            log.error("undecodable work on %s: %s", msg.subject, err)
            await dead_letter(msg, f"work for {self.host_id}")
            return
        if saves_only and not isinstance(work, wk.SaveSandboxWork):
            # Only the saver may write there (its permission), and it sends saves
            # alone: a run or a destroy on that subject is nobody's instruction.
            log.error("a %s on %s, the queue of saves: dropped", type(work).__name__, msg.subject)
            await dead_letter(msg, f"saves for {self.host_id}")
            return
        if self._fenced:
            await msg.nak(delay=1)  # nothing is done while fenced; decided again once back
            return
        try:
            with context.span(
                f"host-agent {type(work).__name__}",
                sandbox_id=work.sandbox_id,
                command_id=getattr(work, "command_id", None),
                save_id=getattr(work, "save_id", None),
            ):
                await self._do(work)
        except Rejected as err:
            if err.code == "self_fenced":
                # Not stale: fenced midway, it is done (or judged stale) once back.
                await msg.nak(delay=self._lease_interval)
                return
            log.info("%s for %s dropped: %s", type(work).__name__, work.sandbox_id, err)
        except _RETRIED as err:
            # The bus not answering (an election, a reconnect) is retried like any
            # infrastructure error: in a second, not after ack_wait.
            log.warning(
                "%s for %s failed, will retry: %r", type(work).__name__, work.sandbox_id, err
            )
            await msg.nak(delay=1)
            return
        # Handled (or dropped as stale): the work queue's loop acknowledges it.

    async def _current(self, work: wk.AnyWork) -> sb.Sandbox:
        """The sandbox as the log has it now, if this work still belongs to it.
        The instruction was sent once the event it follows from was appended, so
        a read now sees that event (the command or save it names)."""
        # Nothing follows the log here: every instruction is checked against the
        # sandbox as the log has it now, up to the end its leader knows (a replica
        # a moment behind would make new work look stale, and stale work is dropped).
        # (news_expected: it was sent after an event this store has not read.)
        state, _ = await self.sandboxes.sync(work.sandbox_id, from_leader=True, news_expected=True)
        if state is None or state.generation < work.generation:
            # Newer than the log shows: not yet, never "stale" (asked again shortly).
            raise InfraError(
                f"generation {work.generation} of {work.sandbox_id} not read yet", retryable=True
            )
        if state.generation != work.generation or state.host != self.host_id:
            raise Rejected("stale_generation", f"work for generation {work.generation} is stale")
        if state.phase in ("lost", "recovering"):
            raise Rejected("sandbox_lost", f"{work.sandbox_id} was declared lost on this host")
        allowed = _PHASES_FOR.get(type(work))
        if allowed is not None and state.phase not in allowed:
            # e.g. a run redelivered after the stop: never launch into a stopped sandbox
            raise Rejected("wrong_phase", f"{type(work).__name__} for a {state.phase} sandbox")
        if self._fenced or self._lease_expired():
            # Fenced (or due to) while reading: nothing is launched, started or frozen now.
            raise InfraError(f"{self.host_id} is fenced", retryable=True)
        return state

    async def _do(self, work: wk.AnyWork) -> None:
        sid, gen, me = work.sandbox_id, work.generation, self.host_id
        match work:
            case wk.StartSandboxWork():
                await self._current(work)
                await self._report(sid, ev.SandboxStarting(host=me, generation=gen), work.msg_id)
                try:
                    local = self._local_generation(sid)
                    # (gen itself: this very start, tried again after a failed report.)
                    if local is not None and local not in (gen - 1, gen):
                        # The copy here is from an older placement (the sandbox ran
                        # elsewhere since): never reuse it, start from the save.
                        await self._destroy(sid)
                    settings = SandboxSettings(
                        network=work.network,
                        image=work.image,
                        disk_limit_bytes=work.disk_limit_bytes,
                    )
                    # Its disk first: a restore writes into it.
                    await self.driver.provision(sid, settings)
                    restored = None
                    if work.restore_save_id is not None:
                        restored = await self.saving.restore_workspace(
                            sid, work.restore_save_id, work.restore_manifest_digest
                        )
                    # Before the box, which binds them: its first command finds them.
                    await self.driver.deliver_connections(sid, work.connections)
                    await self.driver.create_sandbox(
                        sid,
                        work.memory_limit_bytes,
                        settings,
                        pids_limit=work.pids_limit or DEFAULT_PIDS_LIMIT,
                        cpu_limit=work.cpu_limit,
                    )
                    self._generation_file(sid).write_text(str(gen))
                except (OSError, SandholdError, IsolationUnavailable) as err:
                    failed = ev.SandboxStartFailed(host=me, generation=gen, reason=str(err))
                    await self._report(sid, failed, work.msg_id)
                    return
                capabilities = {k: str(v) for k, v in self.driver.sandbox_capabilities(sid).items()}
                started = ev.SandboxStarted(
                    host=me,
                    generation=gen,
                    capabilities=capabilities,
                    connections_revision=work.connections_revision,
                    restore=restored,
                )
                await self._report(sid, started, work.msg_id)
            case wk.RunCommandWork():
                state = await self._current(work)
                command = state.commands.get(work.command_id)
                if command is None and sb.ended_away(state, work.command_id, work.request_key):
                    return  # ended, and not kept (decision 057): a late or repeated instruction
                if command is None:
                    # Sent after its dispatch was appended: not read yet, not unknown.
                    raise InfraError(f"{work.command_id} not read yet", retryable=True)
                if command.ended:
                    if state.phase == "running" and await self._copy_gone(sid):
                        # Its end was reported, the loss not yet (the agent died
                        # between the two, or the loss's append failed): say it now.
                        await self._declare_copy_gone(work)
                    return
                if command.cancel_requested and await self._never_launched(sid, command, gen):
                    # Its cancel was decided before this came (a twin's, or one
                    # sent while this was on its way): it never runs now.
                    await self._report_unlaunched(
                        work, work.command_id, "cancelled before it started"
                    )
                    return
                try:
                    await self._launch(work)
                except SandboxNotFound as err:
                    await self._not_launched(work, str(err))
            case wk.CancelCommandWork():
                if await self.driver.interrupt(sid, work.command_id):
                    return
                if self.driver.launched(sid, work.command_id):
                    return  # (it ended: its end is reported, or was)
                # Cancelled before its run instruction came (decision 098 dispatches
                # a command as it is queued; the instruction follows): it must not
                # stay `dispatched`, and its run, if it comes, finds it ended.
                state = await self._current(work)
                command = state.commands.get(work.command_id)
                if (
                    command is not None
                    and command.cancel_requested
                    and await self._never_launched(sid, command, gen)
                ):
                    await self._report_unlaunched(
                        work, work.command_id, "cancelled before it started"
                    )
            case wk.DeliverConnectionsWork():
                state = await self._current(work)
                if work.revision < state.connections_revision:
                    # Taken again after a newer set was written (its own delivery
                    # comes, or came): its values must not replace the newer ones.
                    raise Rejected("stale_revision", f"connections revision {work.revision}"
                                   f" is older than {state.connections_revision}")  # fmt: skip
                await self.driver.deliver_connections(sid, work.connections)
                delivered = ev.ConnectionsDelivered(host=me, generation=gen, revision=work.revision)
                await self._report(sid, delivered, work.msg_id)
            case wk.StopSandboxWork():
                state = await self._current(work)
                await self.driver.stop_sandbox(sid)
                await self._settle(sid)
                await self._end_unlaunched(state, work)
                final = state.saves.get(work.final_save_id) if work.final_save_id else None
                if final is not None and final.state == "requested":
                    await self._final_save(work)
                await self.driver.remove_connections(sid)  # delivered anew at its next start
                await self._report(sid, ev.SandboxStopped(host=me, generation=gen), work.msg_id)
            case wk.SaveSandboxWork():
                state = await self._current(work)
                save = state.saves.get(work.save_id)
                if save is None or save.state != "requested":
                    return
                # In the background: other work for this host must not wait for an
                # upload. The instruction is done with now; if this agent dies midway the
                # saver's timeout fails the save (it never counts half-done).
                self._background(
                    self.saving.save(
                        sid,
                        gen,
                        work.save_id,
                        work.parent_save_id,
                        freeze=True,
                        report=lambda e: self._report(sid, e, work.msg_id),
                        # (A Snapshot is stored whatever it holds: decision 067.)
                        may_be_unchanged=save.kind == "scheduled",
                    )
                )
            case wk.DestroySandboxWork():
                state = await self._current(work)
                if not sb.deletion_asked(state):
                    # Sent only after a delete request: the files are not destroyed
                    # on any other word (the report would be refused all the same).
                    raise Rejected("delete_not_requested", f"no delete of {sid} was requested")
                await self.driver.stop_sandbox(sid)
                await self._settle(sid)
                await self._end_unlaunched(state, work)
                await self._destroy(sid)
                await self._report(sid, ev.SandboxDeleted(host=me, generation=gen), work.msg_id)

    def _background(self, job) -> None:
        task = asyncio.create_task(job)
        self._jobs.add(task)
        task.add_done_callback(self._jobs.discard)

    async def _end_jobs(self, timeout: float) -> None:
        """End the saves under way, and wait until they have: a save's thaw runs
        as it ends, so a fence's kill or a shutdown after this finds no save
        freezing anything (cancelled once, a save could carry on to its next
        wait: decision 080). `timeout` bounds the wait: a fence has its margin
        to keep, a shutdown the service's stop."""
        if not await cancel_and_wait(list(self._jobs), timeout=timeout):
            log.warning("%d save(s) of %s had not ended after %ss", len(self._jobs),
                        self.host_id, timeout)  # fmt: skip

    async def _final_save(self, work: wk.StopSandboxWork) -> None:
        """The save taken once processes are stopped, bounded by the stop deadline."""
        assert work.final_save_id is not None
        sid, gen = work.sandbox_id, work.generation

        async def report(event: HostReport) -> None:
            await self._report(sid, event, work.msg_id)

        deadline = asyncio.timeout(work.deadline_s)
        try:
            async with deadline:
                await self.saving.save(
                    sid, gen, work.final_save_id, work.parent_save_id, freeze=False, report=report
                )
        except TimeoutError:
            if not deadline.expired():
                raise  # the bus's timeout (nats-py's subclasses it): tried again, not "late"
            await report(
                ev.SaveFailed(
                    save_id=work.final_save_id,
                    stage="timeout",
                    host=self.host_id,
                    generation=gen,
                    reason=f"the stop deadline of {work.deadline_s:.0f}s passed "
                    "during the final save",
                )
            )

    async def _settle(self, sandbox_id: str) -> None:
        """Wait until every command of the sandbox has reported its end."""
        watchers = [
            t for cid, t in self._watchers.items() if self._watcher_sandbox.get(cid) == sandbox_id
        ]
        if watchers:
            # `wait`, not `gather`: cancelled, this must not cancel the watchers,
            # which are the agent's (their ends would go unreported).
            await asyncio.wait(watchers)

    async def _report(self, sandbox_id: str, report: HostReport, cause: str) -> None:
        if self._fenced or self._lease_expired():
            await self._fence()
        if self._fenced:
            raise Rejected("self_fenced", f"{self.host_id} is fenced: it reports nothing")
        await self.sandboxes.execute(
            sandbox_id,
            lambda state: decide_report(state, report),
            id_base=f"{self.host_id}:{report.__struct_config__.tag}:{_report_key(report)}",
            causation_id=cause,
            correlation_id=cause,
        )

    # --- commands -------------------------------------------------------------

    async def _copy_gone(self, sandbox_id: str) -> bool:
        return await asyncio.to_thread(self.driver.copy_gone, sandbox_id)

    async def _report_unlaunched(self, work: wk.AnyWork, command_id: str, reason: str) -> None:
        ended = ev.CommandEnded(
            command_id=command_id,
            state="not_launched",
            reason=reason,
            host=self.host_id,
            generation=work.generation,
        )
        await self._report(work.sandbox_id, ended, work.msg_id)

    async def _end_unlaunched(
        self, state: sb.Sandbox, work: wk.StopSandboxWork | wk.DestroySandboxWork
    ) -> None:
        """A stop's: the commands dispatched here whose run instruction had not
        come (the stop decided between a command's queuing, which dispatches
        it, and its instruction: decision 098) never ran, and never will: said
        so, not left for the scheduler to call `unknown` once stopped."""
        for command in state.unended_commands():
            if await self._never_launched(work.sandbox_id, command, work.generation):
                reason = f"the sandbox was {state.phase} before it started"
                await self._report_unlaunched(work, command.id, reason)

    async def _never_launched(self, sandbox_id: str, command: sb.Command, generation: int) -> bool:
        """Whether this host can tell that `command`, dispatched to this placement,
        never ran here: no directory of it (made before anything runs, kept until
        its end is reported). Not where the sandbox's own files are gone (then
        nothing can be told: the loss that follows says what it may have done)."""
        return (
            command.state == "dispatched"
            and command.generation == generation
            and command.host == self.host_id
            and not self.driver.launched(sandbox_id, command.id)
            and not await self._copy_gone(sandbox_id)
        )

    async def _not_launched(self, work: wk.RunCommandWork, why: str) -> None:
        """The log has the sandbox running here and the driver found no workspace.

        If the sandbox's directory is gone (a disk lost or wiped under a live
        agent), this command never started and no other will here: the host says
        so (`not_launched`: sent again, it runs once the sandbox is back), ends
        what is left of the copy, and declares the placement lost, fenced from
        now, so that recovery ends its other commands and brings it back from its
        last completed save at its next use. (Before, the instruction came back
        until max_deliver and the command stayed `dispatched` for ever.) If the
        directory is there, its disk is mounted again (after a reboot) and the
        launch tried once more; what is still missing (without namespaces, a
        workspace removed from inside) makes that command `launch_failed`."""
        sid, gen, me = work.sandbox_id, work.generation, self.host_id
        if not await self._copy_gone(sid):
            try:
                await self._launch(work)
                return
            except SandboxNotFound:
                failed = ev.CommandEnded(
                    command_id=work.command_id,
                    state="launch_failed",
                    reason="/workspace is missing in the sandbox (removed from inside it?)",
                    host=me,
                    generation=gen,
                )
                await self._report(sid, failed, work.msg_id)
                return
        log.error("%s: its files are gone from this host (%s): declared lost", sid, why)
        never = ev.CommandEnded(
            command_id=work.command_id,
            state="not_launched",
            output_complete=True,
            reason=f"the sandbox's files are gone from host {me}: the command never started; "
            "the sandbox comes back from its last completed save at its next use",
            host=me,
            generation=gen,
        )
        await self._report(sid, never, work.msg_id)
        await self._declare_copy_gone(work)

    async def _declare_copy_gone(self, work: wk.RunCommandWork) -> None:
        """End whatever of the copy still runs, and declare the placement lost
        (safe to repeat: `declare_lost_here` decides nothing twice)."""
        sid, gen, me = work.sandbox_id, work.generation, self.host_id
        try:
            await self._destroy(sid)
        except Exception as err:  # the loss is said all the same: nothing here is current
            log.warning("%s: what is left of its copy not destroyed: %r", sid, err)
        now = time.time()
        decide = functools.partial(
            recovery.declare_lost_here,
            host=me,
            generation=gen,
            last_renewal_at=now,
            fence_at=now,
            cause="files_gone",
        )
        await self.sandboxes.follow_up(sid, decide, why=f"files-gone:{work.msg_id}")

    async def _launch(self, work: wk.RunCommandWork) -> None:
        handle = await self.driver.launch(
            work.sandbox_id,
            work.command_id,
            work.argv,
            cwd=work.cwd,
            env=work.env,
            secrets=work.secrets,
            timeout_s=work.timeout_s,
            kill_grace_s=work.kill_grace_s,
            user="root" if work.user == "root" else "user",
        )
        # Watched from now, not once the start is reported: a short command's
        # output and end are read while its start is being appended, and its end
        # is reported right after (never before: the log keeps their order). Its
        # start is the watcher's to report, so this sandbox's next work is not
        # held while it waits to see whether the command ends at once.
        self._watch(handle, _Launch(work.command_id, work.generation, work.msg_id))

    async def _report_start(self, handle: CommandHandle, launch: _Launch) -> None:
        """Report the command's start, unless it ended within moments (decision
        095: then its end alone is reported, with its pid); its end waits."""
        try:
            started = await handle.started()
            if isinstance(started, int) and not await launch.ends_within(START_REPORT_DELAY_S):
                report = ev.CommandStarted(
                    command_id=launch.command_id,
                    host=self.host_id,
                    generation=launch.generation,
                    pid=started,
                )
                await self._report_until_done(handle.sandbox_id, report, launch.cause, "start")
        except Exception:  # (the end is reported all the same, after its wait)
            log.exception("reporting the start of %s", launch.command_id)
        finally:
            launch.start_told.set()

    def _watch(self, handle: CommandHandle, launch: _Launch) -> None:
        if handle.command_id in self._watchers:
            return  # (launched again, or adopted: its watcher reports its start too)
        task = asyncio.create_task(self._follow(handle, launch))
        self._watchers[handle.command_id] = task
        self._watcher_sandbox[handle.command_id] = handle.sandbox_id
        task.add_done_callback(lambda _: self._forget(handle.command_id))

    def _forget(self, command_id: str) -> None:
        self._watchers.pop(command_id, None)
        self._watcher_sandbox.pop(command_id, None)

    async def _follow(self, handle: CommandHandle, launch: _Launch) -> None:
        """Report the command's start (`_report_start`) while its output is
        streamed to OUTPUT; then report how it ended, after the start."""
        start = asyncio.create_task(self._report_start(handle, launch))
        try:
            await self._follow_to_its_end(handle, launch)
        finally:
            try:
                # (Again and again: one cancellation may be swallowed on its way.)
                await cancel_and_wait([start])
            finally:
                # Reported, its supervisor was given back (`mark_reported`). Not (this
                # agent fenced, a bug, stopping; cancelled again while the start's
                # report was cancelled): it takes no other command (088).
                self.driver.let_go(handle.sandbox_id, handle.command_id)

    async def _follow_to_its_end(self, handle: CommandHandle, launch: _Launch) -> None:
        sid, cid, generation = handle.sandbox_id, handle.command_id, launch.generation
        # Only a command this agent did not launch can have output in OUTPUT already.
        fresh = not handle.adopted
        kept = {"stdout": 0, "stderr": 0} if fresh else await self._kept_offsets(sid, cid)
        complete = True
        exit_record: CommandExit | None = None
        async for item in handle.watch(dict(kept)):
            if handle.exit_seen:  # (its output may still be on its way to OUTPUT)
                launch.exited.set()
            if isinstance(item, OutputChunk):
                try:
                    await self._publish_output(sid, cid, item)
                    kept[item.stream] = item.offset + len(item.data)
                except Exception as err:
                    # What JetStream did not acknowledge is not kept (the host keeps its
                    # copy among the last reported commands' only, decision 077).
                    log.warning("output of %s not kept: %s", cid, err)
                    complete = False
            else:
                exit_record = item
        assert exit_record is not None
        # Looked at while the start's append may still be on its way (decision 078).
        look = self._look_at_files(sid, cid, generation) if fresh else None
        # A start whose report keeps failing does not hold the end for ever.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_START_TOLD_WAIT_S):
                await launch.start_told.wait()
        state, _ = self.sandboxes.get(sid)
        files_of, files_at = files_at_end(state, cid, look)
        ended = ev.CommandEnded(
            command_id=cid,
            state=exit_record.reason,
            exit_code=exit_record.exit_code,
            signal=exit_record.signal,
            reason=exit_record.detail,
            host=self.host_id,
            generation=generation,
            output_kept=kept,
            output_complete=complete,
            # (The start's report may have been left out for it: `_report_start`.)
            pid=exit_record.pid,
            files_of=files_of,
            files_at=files_at,
        )
        # Until recorded or refused: an end unreported is a command left running.
        if await self._report_until_done(sid, ended, f"{cid}:exit", "end"):
            await self.driver.mark_reported(sid, cid)

    async def _report_until_done(
        self, sandbox_id: str, report: ev.CommandStarted | ev.CommandEnded, cause: str, what: str
    ) -> bool:
        """Report a command's start or end, again while the bus does not answer;
        False if it is not reported (this agent fenced, or a bug)."""
        cid = report.command_id
        pause, failures = 0.5, 0
        while True:
            try:
                await self._report(sandbox_id, report, cause)
                return True
            except Rejected as err:
                log.info("%s of %s not recorded: %s", what, cid, err)
                # Fenced: not reported, whoever runs next here decides about it.
                return err.code != "self_fenced"
            except Exception as err:  # the bus not answering, in whatever words
                failures += 0 if isinstance(err, _RETRIED) else 1
                if failures >= _REPORT_BUG_ATTEMPTS:
                    # Not the bus: retrying would hold up this sandbox's stop (and the
                    # host's work behind it) for ever. Reported at the next start.
                    log.error("the %s of %s cannot be reported: %r", what, cid, err)
                    return False
                log.warning("reporting the %s of %s failed, retrying: %r", what, cid, err)
                await asyncio.sleep(pause)
                pause = min(5.0, pause * 2)

    def _look_at_files(
        self, sandbox_id: str, command_id: str, generation: int | None
    ) -> Look | None:
        """As a command ends: if it is the only unended command of its sandbox
        and nothing is left running there, whether every file is as the last
        completed save holds them (`HostSaves.files_held`, decision 078). None:
        not so, or not known (a look that fails in any way holds nothing)."""
        state, _ = self.sandboxes.get(sandbox_id)
        if (
            state is None
            or state.phase != "running"
            or state.generation != generation
            or state.unended_ids != (command_id,)
            or (latest := state.last_completed_save) is None
            or latest.files > LOOK_MAX_NAMES  # (files only: names are as many or more)
        ):
            return None
        try:
            held = self.saving.files_held(sandbox_id, latest.id)
        except Exception:  # whatever it is, the end is reported all the same
            log.exception("looking at the files of %s at the end of %s", sandbox_id, command_id)
            return None
        return Look(latest.id, state.activity, _runs(state, command_id)) if held else None

    async def _kept_offsets(self, sandbox_id: str, command_id: str) -> dict[str, int]:
        """Where each stream's kept output ends, read back from OUTPUT (after a restart)."""
        kept = {"stdout": 0, "stderr": 0}
        for stream in kept:
            subject = f"{self._names.output(sandbox_id, command_id)}.{stream}"
            try:
                last = await self._js.get_last_msg(self._names.output_stream, subject, direct=True)
            except NotFoundError:
                continue  # nothing of this stream kept yet
            headers = last.headers or {}
            kept[stream] = int(headers[OFFSET_HEADER]) + len(last.data or b"")
        return kept

    async def _publish_output(self, sandbox_id: str, command_id: str, chunk: OutputChunk) -> None:
        await self._js.publish(
            f"{self._names.output(sandbox_id, command_id)}.{chunk.stream}",
            chunk.data,
            stream=self._names.output_stream,
            headers={
                Header.MSG_ID: f"{command_id}:{chunk.stream}:{chunk.offset}",
                STREAM_HEADER: chunk.stream,
                OFFSET_HEADER: str(chunk.offset),
            },
        )

    async def _interrupt_everything(self) -> None:
        """On a full shutdown (`sandhold up` stopping): end commands and record it.

        Every sandbox here is quieted, idle ones too: a namespaced sandbox's box
        is a process of its own, and nothing may outlive `sandhold up`. The next
        command after a restart starts a new box.
        """
        with_commands = {self._watcher_sandbox[c] for c in self._watchers}
        for sandbox_id in [
            *with_commands,
            *(set(self.driver.layout.sandbox_ids()) - with_commands),
        ]:
            await self.driver.stop_sandbox(sandbox_id)
            await self.driver.remove_connections(sandbox_id)  # given again at the next start
        if self._watchers:
            await asyncio.wait(list(self._watchers.values()), timeout=30)


# Work that failed on these is asked again in a second: infrastructure, or the bus
# not answering (an election, a reconnect) in nats-py's own words.
_RETRIED: tuple[type[Exception], ...] = (InfraError, nats.errors.Error, *ELECTING)
# Failures of any other kind before a command's end report is given up on.
_REPORT_BUG_ATTEMPTS = 10
# How long a fence waits for the saves under way to end before it kills: a
# small part of recovery's fence margin, which the kill must fit in.
_FENCE_JOBS_S = 0.5
# How long a shutdown waits for the saves under way to end: within the
# service's own stop (STOP_TIMEOUT_S), with the commands' interrupts after it.
_WIND_DOWN_JOBS_S = 5.0
# How long a command's end waits for its start to be reported (see `_report_start`).
_START_TOLD_WAIT_S = 30.0
# A command that ends this soon after it started has no start reported, only its
# end, with its pid (decision 095): one append and one event fewer for each short
# command, and none of the start's append on the way to its end.
START_REPORT_DELAY_S = 0.05


class _Launch:
    """A command this agent watches, as its start's report and its end's see
    it: its end is reported only once its start was (or will not be), since the
    log keeps their order; and no start is reported once its end was seen.
    `cause`: what the start's report was caused by (the run instruction)."""

    def __init__(self, command_id: str, generation: int, cause: str) -> None:
        self.command_id, self.generation, self.cause = command_id, generation, cause
        self.start_told = asyncio.Event()
        self.exited = asyncio.Event()

    async def ends_within(self, seconds: float) -> bool:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self.exited.wait()
        return self.exited.is_set()


_PHASES_FOR: dict[type, frozenset[str]] = {
    wk.StartSandboxWork: frozenset({"placed", "starting", "stopping"}),
    wk.RunCommandWork: frozenset({"running"}),
    wk.SaveSandboxWork: frozenset({"running"}),
    wk.DeliverConnectionsWork: frozenset({"running"}),
}


def _report_key(report: HostReport) -> str:
    if isinstance(report, ev.ConnectionsDelivered):
        return f"{report.revision}:{report.generation}"
    if isinstance(report, ev.ConnectionsDropped):
        return f"{report.epoch}:{report.generation}"
    subject = getattr(report, "command_id", None) or getattr(report, "save_id", None)
    return f"{subject}:{report.generation}" if subject else str(report.generation)


class Look(NamedTuple):
    """What a command's end found of the files (`HostAgent._look_at_files`)."""

    save_id: str  # the last completed save, whose files the sandbox still has
    activity: int  # the sandbox's count in the state looked from
    running: bool  # whether that state had the command's start already


def _runs(state: sb.Sandbox, command_id: str) -> bool:
    command = state.commands.get(command_id)
    return command is not None and command.state == "running"


def files_at_end(
    state: sb.Sandbox | None, command_id: str, look: Look | None
) -> tuple[str | None, int]:
    """What `command.ended` says of the files (`files_of`, `files_at`), decided on
    `state` once the command's start is recorded: the look's save, at this
    state's count, if nothing but the command's own start moved the count since
    the look (decision 078). Any other command launched meanwhile was read into
    this state first, by its instruction's check, and its queueing moved the
    count; one queued and not read here moves it in the log, and the fold then
    refuses the word (`files_at`)."""
    if look is None or state is None or state.phase != "running":
        return None, -1
    latest = state.last_completed_save
    started_since = _runs(state, command_id) and not look.running
    if (
        state.unended_ids != (command_id,)
        or latest is None
        or latest.id != look.save_id
        or state.activity != look.activity + started_since
    ):
        return None, -1
    return look.save_id, state.activity
