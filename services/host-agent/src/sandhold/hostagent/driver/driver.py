"""The process driver: run sandbox commands on this host so they outlive the agent."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

from sandhold.hostagent.driver.boxes import (
    BOX_CGROUP,
    Boxes,
    IsolationUnavailable,
    SandboxSettings,
    User,
    command_cwd,
    command_env,
)
from sandhold.hostagent.driver.cgroups import CgroupError, Cgroups, detect_cgroups
from sandhold.hostagent.driver.connections import ConnectionFiles, default_root
from sandhold.hostagent.driver.handle import CommandHandle
from sandhold.hostagent.driver.layout import HostLayout, check_id, spread_subdirectories
from sandhold.hostagent.driver.owners import others_of
from sandhold.hostagent.driver.pool import (
    SUPERVISOR_MODULE,
    Doorbell,
    SupervisorPool,
    SupervisorStartError,
)
from sandhold.hostagent.driver.records import (
    DEFAULT_KILL_GRACE_S,
    CommandExit,
    CommandSpec,
    read_pid,
    write_json,
)
from sandhold.saves.manifest import Layout

# Processes and threads a sandbox may have at once unless it asks otherwise
# (docs/isolation.md): far above a build's needs, far below what hurts a host.
DEFAULT_PIDS_LIMIT = 4096
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Beyond the grace, how long a supervisor may take to record an exit.
_EXIT_MARGIN_S = 10.0
# Reported commands whose directories a sandbox keeps (mark_reported): the
# last KEEP_REPORTED, and all those reported in the last KEEP_REPORTED_FOR_S.
KEEP_REPORTED = 32
KEEP_REPORTED_FOR_S = 60.0

log = logging.getLogger("sandhold.host-agent.driver")


Isolation = Literal["namespaces", "process"]


@dataclass(frozen=True)
class _Placement:
    cwd: str
    env: dict[str, str]
    box: dict[str, Any] | None
    keep_visible: list[str]
    disk: str | None = None  # the sandbox's own disk's mount point, if it has one


class SandboxNotFound(LookupError):
    """The sandbox was never created on this host (or has been destroyed)."""


class ProcessDriver:
    """Runs commands under detached supervisors; all state lives under ``root``.

    Args:
        root: this host's directory, e.g. ``<data>/hosts/<host-id>``.
        host_id: names this host's cgroups, so agents on one machine never collide.
        warm: how many idle supervisors to keep ready.
        cgroups: a backend; detected from the mounts when None.
        isolate_tmp: give each command a private tmpfs on /tmp where possible
            (the process driver; a namespaced sandbox always has its own /tmp).
        poll_interval_s: how often adopted commands (no doorbell) are looked at.
        isolation: ``namespaces`` (the default: each sandbox in its own user,
            pid, mount, net, ipc and uts namespaces, see ``boxes``) or
            ``process``: commands run on the host as its root, UNISOLATED, for
            development only.
        image_roots: the directories whose subdirectories a sandbox may name as
            its image (default: ``<root>/../../images``, the data dir's).
    """

    def __init__(
        self,
        root: Path,
        host_id: str,
        *,
        warm: int = 2,
        cgroups: Cgroups | None = None,
        isolate_tmp: bool = True,
        poll_interval_s: float = 0.05,
        isolation: Isolation = "namespaces",
        image_roots: list[Path] | None = None,
        connections_root: Path | None = None,
    ) -> None:
        self.layout = HostLayout(Path(root))
        on_tmpfs = True
        if connections_root is None:
            connections_root, on_tmpfs = default_root(Path(root))
        self.connections = ConnectionFiles(connections_root, on_tmpfs=on_tmpfs)
        self.host_id = check_id("host id", host_id)
        self.cgroups = cgroups if cgroups is not None else detect_cgroups(host_id)
        self._pool = SupervisorPool(self.layout.root, warm)
        self._warm = warm
        self._isolate_tmp = isolate_tmp
        self._tmp_probe: tuple[bool, str] = (False, "not probed yet (call start())")
        self._poll_interval_s = poll_interval_s
        self._handles: dict[tuple[str, str], CommandHandle] = {}
        # Per sandbox: commands ended and reported whose cgroups a process they
        # left behind still held (`mark_reported`).
        self._left_cgroups: dict[str, set[str]] = {}
        # Per sandbox: the reported commands whose directories are still kept,
        # with when each was reported (wall clock, as the markers' mtimes), oldest first.
        self._reported: dict[str, collections.deque[tuple[str, float]]] = {}
        self.isolation: Isolation = isolation
        self.boxes = (
            Boxes(
                self.layout,
                self.host_id,
                self.cgroups,
                image_roots if image_roots is not None else [Path(root).parent.parent / "images"],
                starter=self._pool.start_box,
                connections=self.connections,
            )
            if isolation == "namespaces"
            else None
        )

    async def __aenter__(self) -> ProcessDriver:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def start(self) -> None:
        sandboxes = self.layout.root / "sandboxes"
        sandboxes.mkdir(parents=True, exist_ok=True)
        # Each sandbox's directory in a block group of its own: one tenant's file
        # churn (a build's thousand files made and removed) is no other's to walk
        # past when it makes a file (decision 090).
        spread_subdirectories(sandboxes)
        if self.boxes is not None:
            await self._pool.start()  # first: its zygote starts the boxes
            await self.boxes.start()
            self._tmp_probe = (True, "")
        else:
            probe = self._probe_tmp() if self._isolate_tmp else _disabled_tmp()
            self._tmp_probe, _ = await asyncio.gather(probe, self._pool.start())
        # After the zygote started: commands keep the limit they would have had.
        self._pool.open_files = _more_open_files()

    async def close(self) -> None:
        """Dismiss idle supervisors; running ones keep going for the next agent
        (and exit after their command: none is given another)."""
        await self._pool.close()
        for handle in self._handles.values():
            handle.detach()

    async def _probe_tmp(self) -> tuple[bool, str]:
        argv = [sys.executable, "-m", SUPERVISOR_MODULE, "--probe-tmp"]
        done = await asyncio.to_thread(subprocess.run, argv, capture_output=True, timeout=30)
        try:
            verdict = json.loads(done.stdout)
            return bool(verdict["tmp_isolation"]), str(verdict["detail"])
        except (ValueError, KeyError):
            return False, f"probe failed: {done.stderr.decode(errors='replace').strip()}"

    @property
    def freeze_method(self) -> str:
        """How a save holds the sandbox still: its cgroup's freezer, else SIGSTOP."""
        return "cgroup" if self.cgroups.can_freeze else "sigstop"

    def capabilities(self) -> dict[str, Any]:
        """What this host enforces, and in words what it does not."""
        tmp_ok, tmp_detail = self._tmp_probe
        limits = {
            "cgroup": self.cgroups.kind,
            "memory_limit": self.cgroups.enforces_memory_limit,
            "pids_limit": self.cgroups.enforces_pids_limit,
            "cpu_limit": self.cgroups.enforces_cpu_limit,
            # A file system per sandbox (disk.py): namespaced sandboxes only.
            "disk_quota": False,
            "freeze": self.freeze_method,
            "connections": "tmpfs" if self.connections.on_tmpfs else "disk",
            # Idle supervisors started ahead for the next launch (refilled once
            # none is idle); up to four times this kept once given back (088).
            "warm_supervisors": self._warm,
        }
        if self.boxes is not None:
            isolation = self.boxes.capabilities()
            message = isolation.pop("message_isolation")
            if not (self.cgroups.enforces_memory_limit and self.cgroups.can_freeze):
                message += f"; {self.cgroups.message}"
            if (problem := self.connections.problem) is not None:
                message += f"; {problem}"
            limits["disk_quota"] = isolation.pop("disk_quota")
            return {**isolation, **limits, "tmp_isolation": True, "message": message}
        degraded = ["UNISOLATED process driver (development only): commands run as the host's root"]
        if not (self.cgroups.enforces_memory_limit and self.cgroups.can_freeze):
            degraded.append(self.cgroups.message)
        if not tmp_ok:
            degraded.append(f"/tmp is shared with the host: {tmp_detail}")
        if (problem := self.connections.problem) is not None:
            degraded.append(problem)
        return {
            "driver": "process",
            "user": "host-root",
            "network": "host",
            "seccomp": False,
            **limits,
            "tmp_isolation": tmp_ok,
            "message": "; ".join(degraded),
        }

    def sandbox_capabilities(self, sandbox_id: str) -> dict[str, Any]:
        """What this host enforces for this sandbox (its network and base included)."""
        capabilities = self.capabilities()
        del capabilities["warm_supervisors"]  # the host's, not the sandbox's
        if self.boxes is None:
            return capabilities
        capabilities.update(self.boxes.sandbox_capabilities(sandbox_id))
        return {**capabilities, "message": self.capabilities()["message"]}

    # --- sandboxes ------------------------------------------------------------

    def workspace(self, sandbox_id: str) -> Path:
        """The workspace's host path (``/workspace`` inside a namespaced sandbox)."""
        if self.boxes is not None:
            return self.boxes.fs(sandbox_id).workspace
        return self.layout.workspace(sandbox_id)

    @property
    def save_layout(self) -> Layout:
        """What a save of this host holds: a namespaced sandbox's whole persistent root."""
        return "workspace" if self.boxes is None else "root"

    def save_root(self, sandbox_id: str) -> Path:
        """The directory a save captures (see ``save_layout``)."""
        if self.boxes is None:
            return self.layout.workspace(sandbox_id)
        return self.boxes.fs(sandbox_id).upper

    def has_local_copy(self, sandbox_id: str) -> bool:
        """Whether this host holds files of the sandbox (then nothing is restored over them)."""
        if self.boxes is None:
            workspace = self.layout.workspace(sandbox_id)
            return workspace.is_dir() and any(workspace.iterdir())
        return self.boxes.has_files(sandbox_id)

    def _holds(self, sandbox_id: str, workspace: Path) -> bool:
        """Whether the sandbox is here to run a command in. A namespaced sandbox
        is while its persistent root is: its /workspace, removed from inside (by
        its root), is the command's working directory judged in there, so a
        command elsewhere (`cwd` "/") still runs and can make it again. Without
        namespaces the workspace is all the sandbox has."""
        if self.boxes is None:
            return workspace.is_dir()
        return self.boxes.fs(sandbox_id).upper.is_dir()

    def copy_gone(self, sandbox_id: str) -> bool:
        """Whether this host no longer holds the sandbox at all: its directory is
        gone (a disk lost or wiped under the agent), or with namespaces its
        root's persistent layer (a disk of its own, unmounted since a reboot, is
        mounted first). A workspace removed from inside the sandbox is not a
        copy gone."""
        if not self.layout.sandbox_dir(sandbox_id).is_dir():
            return True
        if self.boxes is not None:
            self.boxes.mount_disk(sandbox_id)
            # Its root's persistent layer, which nothing inside it can remove.
            return not self.boxes.fs(sandbox_id).upper.is_dir()
        return False

    def id_offset(self, sandbox_id: str) -> int:
        """The host id that is root inside the sandbox (0 for the process driver)."""
        return 0 if self.boxes is None else self.boxes.id_offset(sandbox_id)

    def restored(self, sandbox_id: str) -> None:
        """A save was just restored into the workspace: make host-written files the sandbox's."""
        if self.boxes is not None:
            self.boxes.claim_restored(sandbox_id)

    async def provision(self, sandbox_id: str, settings: SandboxSettings) -> None:
        """Give the sandbox what must exist before any file of it is written here
        (its disk, when it has a limit), e.g. before a restore; safe to repeat."""
        if self.boxes is None:
            if settings.disk_limit_bytes is not None:
                raise IsolationUnavailable("the process driver enforces no disk quota")
            return
        await asyncio.to_thread(self.boxes.provision, sandbox_id, settings)

    async def create_sandbox(
        self,
        sandbox_id: str,
        memory_limit_bytes: int | None,
        settings: SandboxSettings | None = None,
        *,
        pids_limit: int | None = DEFAULT_PIDS_LIMIT,
        cpu_limit: float | None = None,
    ) -> None:
        """Create (or update the limits of) a sandbox and start its box; safe to repeat.

        ``pids_limit`` caps the sandbox's processes and threads (a fork bomb
        ends ``resource_exhausted``); None lifts it. ``cpu_limit`` is in CPUs
        (1.5: one and a half cores' time per period): a throttle, never an end.
        """
        self.layout.make_commands_dir(sandbox_id)
        await asyncio.to_thread(
            self.cgroups.create_sandbox, sandbox_id, memory_limit_bytes, pids_limit, cpu_limit
        )
        if self.boxes is None:
            await self.provision(sandbox_id, settings or SandboxSettings())
            self.layout.workspace(sandbox_id).mkdir(parents=True, exist_ok=True)
            return
        current = self.boxes.settings(sandbox_id) if settings is None else settings
        await asyncio.to_thread(self.boxes.prepare, sandbox_id, current)
        await self.boxes.ensure(sandbox_id)

    async def destroy_sandbox(self, sandbox_id: str) -> None:
        """Kill everything in the sandbox, then remove its cgroups and directory."""
        sandbox_dir = self.layout.sandbox_dir(sandbox_id)
        await self._thaw_quietly(sandbox_id)
        live = self._live_handles(sandbox_id)
        for handle in live:
            await self.interrupt(sandbox_id, handle.command_id, grace_s=0.0)
        await asyncio.to_thread(self.cgroups.kill_all, sandbox_id)
        self._end_box(sandbox_id)
        await self._await_exits(live, _EXIT_MARGIN_S)
        await asyncio.to_thread(self.cgroups.remove, sandbox_id)
        self._left_cgroups.pop(sandbox_id, None)
        self._reported.pop(sandbox_id, None)
        for key in [key for key in self._handles if key[0] == sandbox_id]:
            self._handles.pop(key).detach()
        if self.boxes is not None:
            # Unmounted first: rmtree must not empty the disk and then stop at its mount.
            await asyncio.to_thread(self.boxes.unmount_disk, sandbox_id)
        await asyncio.to_thread(shutil.rmtree, sandbox_dir, ignore_errors=True)
        await asyncio.to_thread(self.connections.remove, sandbox_id)

    async def deliver_connections(self, sandbox_id: str, values: dict[str, str]) -> None:
        """Make the sandbox's Connection files exactly `values` (name -> text),
        readable by the sandbox's users and by no other user of this host."""
        owner = self.id_offset(sandbox_id)
        await asyncio.to_thread(self.connections.write, sandbox_id, values, owner)

    def connection_names(self, sandbox_id: str) -> list[str]:
        """The names of the Connection files this host holds for the sandbox."""
        return self.connections.names(sandbox_id)

    async def remove_connections(self, sandbox_id: str) -> None:
        await asyncio.to_thread(self.connections.remove, sandbox_id)

    async def stop_sandbox(
        self, sandbox_id: str, grace: float = DEFAULT_KILL_GRACE_S
    ) -> dict[str, CommandExit]:
        """Interrupt every live command (TERM, grace, KILL) and return how each ended.

        Processes that outlived their command (background jobs) get the same
        treatment afterwards, so the sandbox is quiet when this returns.
        """
        await self._thaw_quietly(sandbox_id)
        live = self._live_handles(sandbox_id)
        for handle in live:
            await self.interrupt(sandbox_id, handle.command_id, grace_s=grace)
        exits = await self._await_exits(live, grace + _EXIT_MARGIN_S)
        await self._end_leftovers(sandbox_id, grace)
        self._end_box(sandbox_id)
        return exits

    def _end_box(self, sandbox_id: str) -> None:
        # The cgroup kill reaches the box too; without cgroups this is what does.
        if self.boxes is not None and (state := self.boxes.state(sandbox_id)) is not None:
            state.init.send(signal.SIGKILL)

    async def _thaw_quietly(self, sandbox_id: str) -> None:
        # A frozen process cannot act on TERM, nor die of KILL, until thawed.
        with contextlib.suppress(OSError):
            await self.thaw(sandbox_id)

    async def _end_leftovers(self, sandbox_id: str, grace: float) -> None:
        # The box is not asked: its pid 1 ignores TERM (it has no handler, and a
        # namespace's init is only ever ended by KILL), so waiting for it would
        # make every stop last its whole grace. It goes with the cgroup kill.
        pids = await asyncio.to_thread(self._leftovers, sandbox_id)
        if pids:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and self._leftovers(sandbox_id):
                await asyncio.sleep(self._poll_interval_s)
        await asyncio.to_thread(self.cgroups.kill_all, sandbox_id)

    def _leftovers(self, sandbox_id: str) -> set[int]:
        """The sandbox's processes but its box's: commands, and what they left behind."""
        box = set(self.cgroups.pids(sandbox_id, BOX_CGROUP)) if self.boxes is not None else set()
        return set(self.cgroups.pids(sandbox_id)) - box

    async def _await_exits(
        self, handles: list[CommandHandle], timeout_s: float
    ) -> dict[str, CommandExit]:
        async def one(handle: CommandHandle) -> CommandExit:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    return await handle.wait()
            # A supervisor that cannot finish is killed; its verdict is "unknown".
            handle.signal_supervisor(signal.SIGKILL)
            return await handle.wait()

        results = await asyncio.gather(*(one(handle) for handle in handles))
        return {handle.command_id: result for handle, result in zip(handles, results, strict=True)}

    def _live_handles(self, sandbox_id: str) -> list[CommandHandle]:
        live = []
        for command_id in self.layout.command_ids(sandbox_id):
            paths = self.layout.command(sandbox_id, command_id)
            if paths.exit.exists() or paths.reported.exists():
                continue
            handle = self._handle(sandbox_id, command_id)
            if handle.supervisor_alive():
                live.append(handle)
        return live

    async def freeze(self, sandbox_id: str) -> None:
        """Stop every process of the sandbox (for a crash-consistent save)."""
        if self.cgroups.can_freeze:
            await asyncio.to_thread(self.cgroups.freeze, sandbox_id)
        else:
            self._signal_groups(sandbox_id, signal.SIGSTOP)

    def quiet(self, sandbox_id: str) -> bool:
        """Nothing runs in the sandbox but its box: no command, and no process a
        command left behind. Asked while it is frozen (nothing forks meanwhile);
        False where this host cannot tell (no cgroups to list its processes)."""
        if self.cgroups.kind == "none":
            return False
        return not self._leftovers(sandbox_id)

    async def thaw(self, sandbox_id: str) -> None:
        if self.cgroups.can_freeze:
            await asyncio.to_thread(self.cgroups.thaw, sandbox_id)
        else:
            self._signal_groups(sandbox_id, signal.SIGCONT)

    def _signal_groups(self, sandbox_id: str, sig: signal.Signals) -> None:
        # Without a freezer the process groups of running commands are all we
        # can name; background jobs that left their group are not reached.
        for handle in self._live_handles(sandbox_id):
            pid = read_pid(handle.paths.pid)
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, sig)

    # --- commands -------------------------------------------------------------

    async def launch(
        self,
        sandbox_id: str,
        command_id: str,
        argv: list[str],
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        secrets: dict[str, str] | None = None,
        timeout_s: float | None = None,
        kill_grace_s: float = DEFAULT_KILL_GRACE_S,
        user: User = "user",
    ) -> CommandHandle:
        """Start a command, or adopt it if this command id was launched before.

        ``cwd`` defaults to the workspace; a relative one is taken from there.
        The environment is ``env`` over a minimal PATH and HOME, never the agent's,
        and ``secrets`` over that: they go to the supervisor through its pipe,
        never into the command's spec or any other file.
        ``user`` is the sandbox's unprivileged user or its root (namespaced only).
        """
        paths = self.layout.command(sandbox_id, command_id)
        known = self._handles.get((sandbox_id, command_id))
        if known is not None:
            return known
        workspace = self.workspace(sandbox_id)
        if not self._holds(sandbox_id, workspace):
            raise SandboxNotFound(f"sandbox {sandbox_id} does not exist on this host")
        try:
            paths.directory.mkdir()
        except FileExistsError:
            return self._handle(sandbox_id, command_id)
        handle = CommandHandle(sandbox_id, command_id, paths, poll_interval_s=self._poll_interval_s)
        self._handles[(sandbox_id, command_id)] = handle
        with handle.launching():
            placement = await self._placement(handle, workspace, cwd, env or {}, user)
            if placement is not None:
                await self._hand_over(
                    handle, argv, placement, timeout_s, kill_grace_s, secrets or {}
                )
        return handle

    async def _placement(
        self,
        handle: CommandHandle,
        workspace: Path,
        cwd: str | None,
        env: dict[str, str],
        user: User,
    ) -> _Placement | None:
        """Where and as whom the command runs; None (recorded launch_failed) if nowhere."""
        if self.boxes is None:
            return _Placement(
                cwd=str(workspace / cwd) if cwd else str(workspace),
                env={
                    "PATH": DEFAULT_PATH,
                    "HOME": str(workspace),
                    # no /run/connections without a mount namespace: the host's copy
                    "SANDHOLD_CONNECTIONS": str(self.connections.directory(handle.sandbox_id)),
                    **env,
                },
                box=None,
                keep_visible=[str(workspace)],
            )
        try:
            state = await self.boxes.ensure(handle.sandbox_id)
        except IsolationUnavailable as err:
            self._record_launch_failure(handle, f"the sandbox's namespaces: {err}")
            return None
        return _Placement(
            cwd=command_cwd(cwd),
            env=command_env(user, env, DEFAULT_PATH),
            box=self.boxes.target(state, user).to_json(),
            keep_visible=[],
            disk=self.boxes.disk_dir(handle.sandbox_id),
        )

    async def _hand_over(
        self,
        handle: CommandHandle,
        argv: list[str],
        placement: _Placement,
        timeout_s: float | None,
        kill_grace_s: float,
        secrets: dict[str, str],
    ) -> None:
        paths = handle.paths
        try:
            cgroup = self.cgroups.create_command(handle.sandbox_id, handle.command_id)
        except (CgroupError, OSError) as err:
            self._record_launch_failure(handle, f"cannot create the command's cgroup: {err}")
            return
        spec = CommandSpec(
            sandbox_id=handle.sandbox_id,
            command_id=handle.command_id,
            argv=list(argv),
            cwd=placement.cwd,
            env=placement.env,
            timeout_s=timeout_s,
            kill_grace_s=kill_grace_s,
            cgroup_procs=cgroup.procs,
            own_cgroup_procs=cgroup.own_procs if cgroup.own_procs is not None else cgroup.procs,
            oom_file=cgroup.oom_file,
            oom_kills_before=cgroup.oom_kills_before,
            pids_file=cgroup.pids_file,
            isolate_tmp=self._isolate_tmp and placement.box is None,
            keep_visible=placement.keep_visible,
            created_at=time.time(),
            box=placement.box,
            disk_dir=placement.disk,
        )
        # The supervisor is handed its spec, so the record on disk is written
        # while it starts the command (it makes the output files itself). Until
        # then `supervisor_alive` counts it as launching; an agent that dies
        # before either the record or the supervisor's own is in place leaves
        # a command never confirmed (`handle._vanished`), as before a hand-over.
        raw_spec = spec.to_json()
        while True:
            try:
                supervisor = await self._pool.take()
            except SupervisorStartError as err:
                self._record_launch_failure(handle, str(err))
                break
            handle.attach(Doorbell(supervisor.doorbell_fd), supervisor)
            try:
                await supervisor.hand_over(paths.directory, raw_spec, secrets)
                break
            except BrokenPipeError:
                handle.detach()  # it died while idle (or took nothing); take the next one
            except BaseException:
                handle.detach()  # cancelled midway (the agent stopping): it runs nothing
                raise
        write_json(paths.spec, raw_spec)

    def _record_launch_failure(self, handle: CommandHandle, detail: str) -> None:
        now = time.time()
        record = CommandExit(reason="launch_failed", detail=detail, started_at=now, ended_at=now)
        write_json(handle.paths.exit, record.to_json(), durable=True)

    async def interrupt(
        self, sandbox_id: str, command_id: str, *, grace_s: float | None = None
    ) -> bool:
        """Ask the command's supervisor to end it (TERM, grace, KILL).

        ``grace_s`` overrides the command's ``kill_grace_s``. Returns False if
        the command had already ended or never ran.
        """
        if not self.launched(sandbox_id, command_id):
            return False
        handle = self._handle(sandbox_id, command_id)
        started = await handle.started()
        if isinstance(started, CommandExit) or handle.exit_record() is not None:
            return False
        if grace_s is not None:
            write_json(handle.paths.interrupt, {"grace_s": grace_s})
        return handle.signal_supervisor(signal.SIGUSR1)

    def launched(self, sandbox_id: str, command_id: str) -> bool:
        return self.layout.command(sandbox_id, command_id).directory.is_dir()

    def handle(self, sandbox_id: str, command_id: str) -> CommandHandle:
        """The handle of a command known on disk."""
        if not self.launched(sandbox_id, command_id):
            raise LookupError(f"no command {command_id} in sandbox {sandbox_id}")
        return self._handle(sandbox_id, command_id)

    def _handle(self, sandbox_id: str, command_id: str) -> CommandHandle:
        key = (sandbox_id, command_id)
        if key not in self._handles:
            paths = self.layout.command(sandbox_id, command_id)
            self._handles[key] = CommandHandle(
                sandbox_id, command_id, paths, poll_interval_s=self._poll_interval_s
            )
        return self._handles[key]

    async def claim_cgroups(self) -> list[str]:
        """Take this host's cgroups for the agent's life, removing the empty ones
        of sandboxes no data dir of this host id holds when no other agent has
        them (see `Cgroups.claim_host`, `owners`); returns the ids of those
        removed. Call it before any sandbox is created: one being made has its
        directory first."""
        return await asyncio.to_thread(self._claim_cgroups)

    def _claim_cgroups(self) -> list[str]:
        # Another installation's sandboxes (one data dir of this host id) are
        # kept, stopped ones too: only a data dir that is gone leaves nobody's.
        keep = set(self.layout.sandbox_ids())
        for other in others_of(self.host_id, self.layout.root):
            keep.update(HostLayout(other).sandbox_ids())
        removed = self.cgroups.claim_host(keep)
        self._remove_reported_cgroups()
        return removed

    async def adopt_all(self) -> list[CommandHandle]:
        """Every command whose end has not been reported yet (after an agent
        restart). The same walk keeps each sandbox's reported directories as
        `mark_reported` would have (the last KEEP_REPORTED by when each end was
        reported, and those of the last KEEP_REPORTED_FOR_S) and removes the
        rest: what an earlier agent left, or what was there before decision 077."""
        unreported, kept = await asyncio.to_thread(self._walk_commands)
        self._reported.update(kept)
        return [self._handle(sandbox_id, command_id) for sandbox_id, command_id in unreported]

    def _walk_commands(
        self,
    ) -> tuple[list[tuple[str, str]], dict[str, collections.deque[tuple[str, float]]]]:
        unreported: list[tuple[str, str]] = []
        kept_by_sandbox: dict[str, collections.deque[tuple[str, float]]] = {}
        for sandbox_id in self.layout.sandbox_ids():
            # (One made before decision 090 spreads its next commands too.)
            spread_subdirectories(self.layout.commands_dir(sandbox_id))
            reported: list[tuple[float, str]] = []
            for command_id in self.layout.command_ids(sandbox_id):
                try:
                    at = self.layout.command(sandbox_id, command_id).reported.stat().st_mtime
                except FileNotFoundError:
                    unreported.append((sandbox_id, command_id))
                    continue
                reported.append((at, command_id))
            kept = collections.deque((command_id, at) for at, command_id in sorted(reported))
            self._tidy(sandbox_id, [], _evicted(kept, now=time.time()))
            if kept:
                kept_by_sandbox[sandbox_id] = kept
        return unreported, kept_by_sandbox

    def let_go(self, sandbox_id: str, command_id: str) -> None:
        handle = self._handles.get((sandbox_id, command_id))
        if handle is not None:
            handle.let_supervisor_go()

    async def mark_reported(self, sandbox_id: str, command_id: str) -> None:
        """Record that the command's end is durably in the log (it is not adopted
        again), and tidy up after it.

        Its own cgroups go (on v1 up to two stay as spares for the sandbox's next
        commands, decision 079): kept, a long-lived sandbox had one per command it
        ever ran, in each hierarchy (the kernel allows 65,535 memory cgroups, and
        every look at a sandbox's processes walked them all). One that a process
        the command left behind still holds is tried again at the sandbox's next
        command's end, and goes with the sandbox in any case.

        Its directory (spec, output copies, exit record, supervisor log) is kept
        among the sandbox's last KEEP_REPORTED reported ones, for whoever looks
        into a recent command on the host; the oldest beyond that goes once it
        was reported KEEP_REPORTED_FOR_S ago (decision 077). The log, not the
        directory, is what keeps a command from running twice once its end is
        reported; the time floor keeps the directory too while a read of the log
        from before the report may still be acted on."""
        handle = self._handles.pop((sandbox_id, command_id), None)
        if handle is not None and (supervisor := handle.give_back()) is not None:
            self._pool.give_back(supervisor)
        marker = self.layout.command(sandbox_id, command_id).reported
        try:
            marker.touch(exist_ok=False)
            again = False
        except FileExistsError:
            again = True  # followed twice: counted among the kept once
        except FileNotFoundError:
            return  # reported before, and its directory gone since
        left = self._left_cgroups.setdefault(sandbox_id, set())
        left.add(command_id)
        kept = self._reported.setdefault(sandbox_id, collections.deque())
        if not again:
            kept.append((command_id, time.time()))
        old = _evicted(kept, now=time.time())
        removed = await asyncio.to_thread(self._tidy, sandbox_id, sorted(left), old)
        left.difference_update(removed)
        # (Only this set: another end may have emptied it and a later one begun anew.)
        if not left and self._left_cgroups.get(sandbox_id) is left:
            del self._left_cgroups[sandbox_id]

    def _tidy(self, sandbox_id: str, cgroups_of: list[str], directories_of: list[str]) -> list[str]:
        """Remove those commands' cgroups (or keep them as spares, decision 079) and
        directories; the ids whose cgroups went."""
        for command_id in directories_of:
            shutil.rmtree(self.layout.command(sandbox_id, command_id).directory, ignore_errors=True)
        return self._remove_command_cgroups(sandbox_id, cgroups_of)

    def _remove_command_cgroups(self, sandbox_id: str, command_ids: list[str]) -> list[str]:
        removed = []
        for command_id in command_ids:
            try:
                if self.cgroups.remove_command(sandbox_id, command_id):
                    removed.append(command_id)
            except CgroupError as err:  # left for the sandbox's removal
                log.warning("cgroups of %s not removed: %s", command_id, err)
                removed.append(command_id)
        return removed

    def _remove_reported_cgroups(self) -> None:
        """At start: the cgroups of commands whose end an earlier agent reported
        (it died before removing them, or ran before they were removed). Only the
        cgroups still there are looked at, not every command the sandbox ran.
        A command cgroup without a directory is a reported command's whose
        directory went (`mark_reported`): the cgroup is made after the directory."""
        for sandbox_id in self.layout.sandbox_ids():
            reported = [
                command_id
                for command_id in self.cgroups.command_cgroups(sandbox_id)
                if self.layout.command(sandbox_id, command_id).reported.exists()
                or not self.layout.command(sandbox_id, command_id).directory.exists()
            ]
            left = set(reported) - set(self._remove_command_cgroups(sandbox_id, reported))
            if left:
                self._left_cgroups[sandbox_id] = left


def _more_open_files() -> int | None:
    """Raise this process's soft limit of open files to its hard one: it holds two
    descriptors per running command (its supervisor's doorbell and stdin,
    decision 088), and a soft limit of 1,024 would refuse a launch at ~500.
    The limit it had, if raised."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # (Unlimited is not a number of files: the kernel's own cap, nr_open, is.)
    wanted = 1 << 20 if hard == resource.RLIM_INFINITY else hard
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return None
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    except (ValueError, OSError) as err:
        log.warning("open files limit left at %d (hard %d): %s", soft, hard, err)
        return None
    return soft


def _evicted(kept: collections.deque[tuple[str, float]], *, now: float) -> list[str]:
    """Take from `kept` (oldest first) the commands whose directories go: beyond
    the last KEEP_REPORTED, and reported at least KEEP_REPORTED_FOR_S ago."""
    old = []
    while len(kept) > KEEP_REPORTED and now - kept[0][1] >= KEEP_REPORTED_FOR_S:
        old.append(kept.popleft()[0])
    return old


async def _disabled_tmp() -> tuple[bool, str]:
    return False, "disabled by configuration"
