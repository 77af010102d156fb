"""The service shell: what every service's life shares, written once.

    async with Shell("saver", url, names) as shell:
        store = shell.store("sandbox", sb.evolve)     # folded, then followed
        await shell.start_stores()
        await shell.work_queue(durable, config, handle, what="requests")
        shell.spawn(loop(), "schedule")
        await shell.serve()                           # ready, until stopped or crashed

Connecting and ensuring the streams happen on entry; leaving stops the loops,
the stores' followers and the connection, within a deadline even when NATS is
gone. A loop that raises (rather than handling its own trouble) is a crash:
logged with its traceback, the service stops and `serve` raises
`ServiceCrashed`, so the process exits non-zero and its supervisor (`sandhold
up`, systemd, Kubernetes) restarts it, instead of a dead loop going unnoticed.
`run_service` runs one under uvloop with SIGTERM/SIGINT as a graceful stop.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import faulthandler
import gc
import logging
import os
import signal
import threading
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, Protocol, TypeVar

import msgspec
import nats
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig
from sandhold.bus import checkpoint, deadletters
from sandhold.bus import credentials as creds
from sandhold.bus.cancelling import cancel_and_wait
from sandhold.bus.connection import close_quickly, connect
from sandhold.bus.electing import patiently
from sandhold.bus.names import Names
from sandhold.bus.reconciler import consume
from sandhold.bus.store import AggregateStore, Compact, Evolve, Forget
from sandhold.bus.streams import await_streams
from sandhold.telemetry import metrics, setup

S = TypeVar("S")
# How long a stopping service may take to finish its loops and close, before
# they are cancelled (and, should even that hang, the process ends anyway).
STOP_TIMEOUT_S = 10.0

log = logging.getLogger(__name__)


class Service(Protocol):
    name: str

    async def run(self) -> None: ...

    async def shutdown(self) -> None: ...


class ServiceCrashed(RuntimeError):
    """A service's loop raised: the service stopped (its traceback is logged)."""


class Shell:
    def __init__(
        self,
        name: str,
        nats_url: str,
        names: Names,
        *,
        connection_name: str | None = None,
    ) -> None:
        self.name = name
        self.names = names
        self._url = nats_url
        self._connection_name = connection_name or f"sandhold-{instance_name(name)}"
        self._nc: NATS | None = None
        self._js: JetStreamContext | None = None
        self._stores: list[AggregateStore[Any]] = []
        self._tasks: dict[asyncio.Task[None], str] = {}
        self._closers: list[Callable[[], Awaitable[object]]] = []
        self._winding_down: list[Callable[[], Awaitable[object]]] = []
        self._stopping = asyncio.Event()
        self._crash: tuple[str, BaseException] | None = None
        self._entered_by: asyncio.Task[Any] | None = None
        self._serving = False

    @property
    def nc(self) -> NATS:
        assert self._nc is not None, "use the shell inside `async with`"
        return self._nc

    @property
    def js(self) -> JetStreamContext:
        assert self._js is not None, "use the shell inside `async with`"
        return self._js

    async def __aenter__(self) -> Shell:
        self._entered_by = asyncio.current_task()
        self._nc = await connect(self._url, name=self._connection_name)
        self._js = self._nc.jetstream()
        await await_streams(self._js, self.names)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._stopping.set()  # (its loops are ended now: no crash of theirs)
        await self._end_tasks()
        for close in reversed(self._closers):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(close(), STOP_TIMEOUT_S)
        if self._nc is not None:
            await close_quickly(self._nc, *self._stores)

    # --- what a service is made of ---------------------------------------------

    def store(
        self,
        kind: str,
        evolve: Evolve[S],
        *,
        actor: str | None = None,
        follow: bool = True,
        compact: Compact[S] | None = None,
        forget: Forget[S] | None = None,
        pace_s: float | None = None,
    ) -> AggregateStore[S]:
        """An aggregate store of `kind`, stopped with the shell (`start_stores` folds
        it; one made with `follow=False` reads aggregates on demand instead), its
        states kept as `compact` leaves them, none kept that `forget` says of
        (`AggregateStore`), its live events folded at most every `pace_s`."""
        kept = os.environ.get(checkpoint.ENV)  # `--checkpoint-dir`
        store = AggregateStore(
            self.js,
            self.names,
            kind,
            evolve,
            actor=actor or self.name,
            follow=follow,
            checkpoint_dir=Path(kept) if kept else None,
            compact=compact,
            forget=forget,
            pace_s=pace_s,
        )
        self._stores.append(store)
        return store

    async def start_stores(self) -> None:
        """Fold every store made so far from the log, in the order they were made."""
        for store in self._stores:
            await store.start()

    async def work_queue(
        self,
        stream: str,
        config: ConsumerConfig,
        handle: Callable[[Msg], Awaitable[None]],
        *,
        what: str,
        lane: Callable[[Msg], str] | None = None,
        concurrency: int = 1,
    ) -> asyncio.Task[None]:
        """A durable consumer on `stream`, handled in a loop of the shell one
        message at a time, or in lanes (`consume`); messages it gives up on are
        answered and counted (`deadletters`). Creating the consumer also updates
        an existing one."""
        durable = config.durable_name
        assert durable is not None

        # Named as well as durable: the create request's subject then carries
        # its name and filter, which is what a permission can pin. A cluster
        # electing a leader (just started, or a node gone) answers late or
        # "unavailable": asked again until it answers.
        def not_yet(err: Exception) -> None:
            log.warning("%s: consumer %s not made yet (%r); asking again", self.name, durable, err)

        async def make() -> JetStreamContext.PullSubscription:
            await self.js.add_consumer(stream, config.evolve(name=config.name or durable))
            return await self.js.pull_subscribe_bind(durable, stream)

        sub = await patiently(make, wait_s=None, pause_s=0.5, on_first_wait=not_yet)
        await deadletters.watch(self.nc, stream, durable, what=what)
        # Kept alive three times per ack_wait: a message is delivered again
        # only when it is lost on its way, or its handler is gone.
        keep_alive_s = config.ack_wait / 3 if config.ack_wait else None
        consuming = consume(
            sub, handle, what=what, lane=lane, concurrency=concurrency, keep_alive_s=keep_alive_s
        )
        return self.spawn(consuming, what)

    def on_stopping(self, wind_down: Callable[[], Awaitable[object]]) -> None:
        """Something to do once a stop began, while the loops still run (a host
        agent interrupts its commands while it still renews its lease)."""
        self._winding_down.append(wind_down)

    def spawn(self, coroutine: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        """Run a loop for the service's lifetime; if it raises, the service stops."""
        task = asyncio.create_task(coroutine, name=f"{self.name}: {name}")
        self._tasks[task] = name
        task.add_done_callback(self._ended)
        return task

    def on_close(self, close: Callable[[], Awaitable[object]]) -> None:
        """Something to close when the shell closes (before the connection)."""
        self._closers.append(close)

    # --- its life ---------------------------------------------------------------

    async def serve(self, **ready: object) -> None:
        """Announce readiness, then serve until stopped; raise if a loop crashed."""
        if not self._stopping.is_set():
            if _freeze_when_serving:
                _freeze_start_up(self.name)
            # Still start-up: a stop now interrupts it (`stop`). NATS going away
            # between the announcement and its flush is no reason to crash.
            try:
                await announce_ready(self.nc, self.names, self.name, **ready)
            except (nats.errors.Error, OSError) as err:
                log.warning("%s: could not confirm its readiness announcement: %r", self.name, err)
            self._serving = True
            await self._stopping.wait()
        self._serving = True
        for wind_down in self._winding_down:
            try:
                await wind_down()
            except Exception:
                log.exception("%s: winding down failed", self.name)
        await self._end_tasks()
        if self._crash is not None:
            name, error = self._crash
            raise ServiceCrashed(f"{self.name}: its {name} loop crashed: {error!r}") from error

    def stop(self) -> None:
        """Begin a graceful stop; one still starting up is interrupted at once."""
        self._stopping.set()
        if not self._serving and self._entered_by is not None:
            self._entered_by.cancel()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def _ended(self, task: asyncio.Task[None]) -> None:
        name = self._tasks.pop(task, "?")
        if self._stopping.is_set():
            return
        if task.cancelled():
            # Not by `stop`: a cancellation meant for an await inside it escaped.
            # The loop's work (a host's lease renewal) would stop without a word.
            error: BaseException | None = RuntimeError(
                "cancelled while the service was not stopping"
            )
        else:
            error = task.exception()
        if error is None:
            return  # a loop that had nothing more to do
        log.critical("%s: its %s loop crashed; stopping", self.name, name, exc_info=error)
        self._crash = (name, error)
        self._stopping.set()

    async def _end_tasks(self) -> None:
        await cancel_and_wait(list(self._tasks), timeout=STOP_TIMEOUT_S)


# Set by `run_service`: the process is the service, and what it holds once it
# serves lives as long as the process (not so a test's own process, which runs
# shells one after another).
_freeze_when_serving = False


def _freeze_start_up(name: str) -> None:
    """Everything imported, the stores caught up: what exists now lives as long
    as the process. Frozen, the cyclic collector no longer walks it in every
    full collection, which it otherwise did ~40,000 objects of modules,
    functions and types at a time (decision 081). Still freed when its last
    reference goes; only a cycle among these would stay."""
    gc.collect()
    gc.freeze()
    log.info("%s: %d objects of its start-up frozen", name, gc.get_freeze_count())


async def announce_ready(nc: NATS, names: Names, service: str, **extra: object) -> None:
    """Tell `sandhold up` (or anyone listening) that this service is serving
    (as `instance`, where it runs more than once)."""
    instance = instance_name(service)
    if instance != service:
        extra = {"instance": instance, **extra}
    if metrics.port is not None:
        extra = {"metrics_port": metrics.port, **extra}
    body = msgspec.json.encode({"service": service, "pid": os.getpid(), **extra})
    await nc.publish(names.ready, body)
    await nc.flush()


def instance_name(service: str) -> str:
    """This process's instance of `service`: `--instance` (`scheduler-2`) where a
    service runs more than once, else the service's own name. Instances of one
    service share its credential and its durable consumers; the name tells them
    apart in leases, readiness, connections and logs (decision 035)."""
    return os.environ.get("SANDHOLD_INSTANCE") or service


def common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--nats",
        default=os.environ.get("SANDHOLD_NATS_URL"),
        required=False,
        help="NATS server URL(s), comma separated",
    )
    parser.add_argument(
        "--prefix",
        default=os.environ.get("SANDHOLD_PREFIX", "sh"),
        help="subject and stream prefix (default sh)",
    )
    parser.add_argument(
        "--instance",
        default=os.environ.get("SANDHOLD_INSTANCE"),
        help="this instance's name where a service runs more than once (`scheduler-2`); "
        "default: the service's own name",
    )
    parser.add_argument(
        "--credentials",
        default=os.environ.get(creds.ENV),
        help=f"this service's NATS credential file (or ${creds.ENV})",
    )
    parser.add_argument(
        "--checkpoint-dir",
        default=os.environ.get(checkpoint.ENV),
        help="keep the folded state of this service's projections here, so a restart "
        f"folds only the events after it (or ${checkpoint.ENV}; default: none, a start "
        "folds the whole log)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=_env_int("SANDHOLD_METRICS_PORT"),
        help="serve this process's Prometheus /metrics on this port (0: any free one)",
    )


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


def run_service(
    make: Callable[[argparse.Namespace], Service],
    parser: argparse.ArgumentParser,
    argv: list[str] | None = None,
    *,
    private_files: bool = True,
) -> None:
    """Parse arguments, then run the service on uvloop until SIGTERM/SIGINT.

    What a service writes is its own (umask 077: read models, staged clones, work
    directories). Not so the host-agent (`private_files=False`, umask 022
    whatever it inherited): it builds the sandboxes' trees, whose modes the
    sandboxes' own users need, and makes private what is (a command's spec
    holds its environment)."""
    global _freeze_when_serving
    args = parser.parse_args(argv)  # before the umask: `--help` leaves the caller's alone
    os.umask(0o077 if private_files else 0o022)
    if not args.nats:
        parser.error("--nats URL (or SANDHOLD_NATS_URL) is required")
    if args.credentials:  # every connection of this process is this service's user
        os.environ[creds.ENV] = args.credentials
    if args.checkpoint_dir:  # every store of this process keeps its checkpoint there
        os.environ[checkpoint.ENV] = args.checkpoint_dir
    if args.instance:  # announced as ready, named in its connections and logs
        os.environ["SANDHOLD_INSTANCE"] = args.instance
    # Logs, traces and metrics, named after the service (`sandhold run <service>`).
    setup(parser.prog.rsplit(" ", 1)[-1], metrics_port=args.metrics_port)
    # A crash below Python (a segfault, an abort in a library) leaves the
    # stacks of every thread in the service's log, not nothing.
    faulthandler.enable()
    import uvloop

    _freeze_when_serving = True  # (this process is the service from here on)

    async def main() -> None:
        service = make(args)
        loop = asyncio.get_running_loop()
        running = asyncio.ensure_future(service.run())

        def stop() -> None:
            log.info("%s: stopping", service.name)
            asyncio.ensure_future(service.shutdown())
            # A stop that does not finish in time is cut short, and a process
            # whose loop cannot even do that (a stuck thread) ends anyway.
            loop.call_later(STOP_TIMEOUT_S, running.cancel)
            deadline = threading.Timer(2 * STOP_TIMEOUT_S + 5, _exit_now, (service.name,))
            deadline.daemon = True
            deadline.start()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop)
        with contextlib.suppress(asyncio.CancelledError):
            await running

    uvloop.run(main())


def _exit_now(name: str) -> None:
    log.error("%s: did not stop in time; exiting", name)
    logging.shutdown()
    os._exit(1)
