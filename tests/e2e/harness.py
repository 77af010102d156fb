"""Running `sandhold up` as a real subprocess, and the CLI against it."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
from sandhold.bus import credentials
from sandhold.hostagent.driver.cgroups import detect_cgroups, parse_mounts
from sandhold.hostagent.driver.connections import default_root
from sandhold.hostagent.driver.process_identity import ProcessIdentity
from sandhold.hostagent.driver.rootfs import SandboxFs

from tests.support.netns import HostNet

SANDHOLD = str(Path(sys.executable).parent / "sandhold")

# Every log a started `up` or host writes to: when a test fails, the root
# conftest shows the end of each one written during it (CI keeps nothing else).
LOGS: list[Path] = []


class Up:
    """`sandhold up --data-dir DIR` in its own process group; stopped by PID."""

    def __init__(
        self,
        data_dir: Path,
        *extra: str,
        env: dict[str, str] | None = None,
        umask: int = -1,  # the umask `sandhold up` starts with (-1: this process's)
    ) -> None:
        self.data_dir = data_dir
        self.umask = umask
        self.extra = list(extra)
        self.env = env  # added to this process's environment, for every service
        self.process: subprocess.Popen[str] | None = None
        self.nats_url = ""  # as printed, no credential in it
        self.url = ""  # as the operator (the CLI's user on this machine)
        self.admin_url = ""  # as the admin: for tests that forge or plant what no service may
        self.gateway_url = ""
        self.lines: queue.Queue[str] = queue.Queue()

    def start(self, timeout: float | None = None) -> Up:
        if timeout is None:  # three nodes and two of every service take longer
            timeout = 150.0 if "--nodes" in self.extra else 70.0
        LOGS.append(self.data_dir / "logs")
        self.process = subprocess.Popen(
            [SANDHOLD, "--data-dir", str(self.data_dir), "up", *self.extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            process_group=0,
            env={**os.environ, **self.env} if self.env else None,
            umask=self.umask,
        )
        self._pump_thread = threading.Thread(target=self._pump, daemon=True)
        self._pump_thread.start()
        deadline = time.monotonic() + timeout
        seen: list[str] = []
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.2)
            except queue.Empty:
                if self.process.poll() is not None:
                    break
                continue
            seen.append(line)
            if line.startswith("sandhold is up: "):
                # sandhold is up: nats://127.0.0.1:P gateway http://127.0.0.1:Q
                words = line.split(": ", 1)[1].split()
                self.nats_url = words[0]
                self.url = self.url_as("operator")
                self.admin_url = self.url_as("admin")
                self.gateway_url = words[-1] if "gateway" in words else ""
                return self
        self.stop()
        raise AssertionError(f"sandhold up did not become ready: {seen}")

    def url_as(self, user: str) -> str:
        """The NATS URL with `user`'s credential from the data dir."""
        path = credentials.path_of(self.data_dir / "credentials", user)
        return credentials.in_url(self.nats_url, credentials.load(path))

    def _pump(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line)

    @property
    def runtime(self) -> dict:
        return json.loads((self.data_dir / "runtime.json").read_text())

    def service_pid(self, name: str) -> int:
        return int(self.runtime["services"][name])

    def workspace(self, sandbox_id: str, host: str = "local") -> Path:
        sandbox_dir = self.data_dir / "hosts" / host / "sandboxes" / sandbox_id
        return SandboxFs(sandbox_dir / "fs").workspace  # the namespaced driver's

    def touch_inside(self, sandbox_id: str, name: str, host: str = "local") -> None:
        """Make /workspace/<name> from inside the running sandbox, as its user.

        From inside (util-linux's nsenter into the box's namespaces), not into
        the upper layer from the host: overlayfs may keep a lookup it cached
        and never see a file put there behind its back.
        """
        box = self.data_dir / "hosts" / host / "sandboxes" / sandbox_id / "box.json"
        pid = json.loads(box.read_text())["init"]["pid"]
        subprocess.run(
            ["nsenter", "-t", str(pid), "-U", "-m", "-S", "1000", "-G", "1000",
             "touch", f"/workspace/{name}"],
            check=True,
            timeout=30,
        )  # fmt: skip

    def cli(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "SANDHOLD_NATS_URL": ""}
        return subprocess.run(
            [SANDHOLD, "--data-dir", str(self.data_dir), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )

    def cli_json(self, *args: str) -> dict:
        done = self.cli(*args, "--json") if "--" not in args else self.cli(*args)
        assert done.returncode == 0, done.stderr
        return msgspec.json.decode(done.stdout)

    def stop(self, timeout: float = 60.0) -> int | None:
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        _kill_leftovers(self.data_dir)
        self._pump_thread.join(timeout=10)
        if self.process.stdout is not None:
            self.process.stdout.close()
        return self.process.returncode


def _box_files(directory: Path) -> list[Path]:
    """Every sandbox's box.json under a host root (or a data dir's hosts/*), listed
    without descending into the sandboxes' files, which an agent may be deleting."""
    roots = [directory]
    with contextlib.suppress(OSError):
        roots += [directory / "hosts" / name for name in os.listdir(directory / "hosts")]
    found = []
    for root in roots:
        with contextlib.suppress(OSError):
            for name in os.listdir(root / "sandboxes"):
                found.append(root / "sandboxes" / name / "box.json")
    return found


def box_inits(directory: Path) -> list[int]:
    """The pids of the sandbox boxes' inits under a data dir or host root, still running.

    Killing a box's init (pid 1 of its namespace) ends everything in the box;
    its bubblewrap parent then exits by itself. A box an agent froze for a save
    and never thawed (killed mid-capture) would hold the kill pending, so the
    sandbox is thawed first.
    """
    found = []
    for box in _box_files(directory):
        if not box.exists():
            continue
        host_id = box.parent.parent.parent.name
        with contextlib.suppress(OSError, ValueError):
            detect_cgroups(host_id).thaw(box.parent.name)
        with contextlib.suppress(OSError, ValueError, KeyError):
            identity = ProcessIdentity.from_json(json.loads(box.read_text())["init"])
            if identity.is_alive():
                found.append(identity.pid)
    return found


def unmount_under(root: Path) -> None:
    """Sandboxes' own disks (driver/disk.py) left mounted under ``root``."""
    inside = f"{root.resolve()}/"
    for mount in parse_mounts(Path("/proc/self/mounts").read_text()):
        if str(mount.target).startswith(inside):
            subprocess.run(["umount", "-l", str(mount.target)], capture_output=True, check=False)


def forget_connections(host_root: Path) -> None:
    """A host's Connection files, which a killed agent leaves on the tmpfs."""
    root, on_tmpfs = default_root(host_root)
    if on_tmpfs:
        shutil.rmtree(root, ignore_errors=True)


def _kill_leftovers(data_dir: Path) -> None:
    """Any process still running from this data dir (a test that failed midway)."""
    for pid in box_inits(data_dir):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    marker = str(data_dir.resolve())
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit() or int(pid_dir.name) == os.getpid():
            continue
        try:
            cmdline = (pid_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            cwd = os.readlink(pid_dir / "cwd")
        except OSError:
            continue
        if marker in cmdline or cwd.startswith(marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid_dir.name), signal.SIGKILL)
    unmount_under(data_dir)
    for hosts in (data_dir / "hosts", data_dir.parent / "hosts"):
        with contextlib.suppress(OSError):
            for host_id in os.listdir(hosts):
                forget_connections(hosts / host_id)


class RunLog:
    """Lines commands append to a file in their sandbox's workspace, read from the hosts.

    The ground truth of how often a command ran: a command can write nothing
    outside its sandbox, so the file lives inside (``/workspace/<name>``), and
    the test reads every host's copy of it from the sandboxes' upper layers.
    """

    def __init__(self, data_dir: Path, name: str) -> None:
        self.data_dir = data_dir
        self.name = name

    def inside(self, suffix: str = "") -> str:
        return f"/workspace/{self.name}{suffix}"

    def lines(self, suffix: str = "") -> list[str]:
        pattern = f"hosts/*/sandboxes/*/fs/upper/root/workspace/{self.name}{suffix}"
        return [
            line for path in sorted(self.data_dir.glob(pattern))
            for line in path.read_text().splitlines()
        ]  # fmt: skip


class _gone:
    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, *_: object) -> bool:
        return kind is ProcessLookupError


class Host:
    """One host-agent process with its own workspace root, stopped by PID."""

    def __init__(
        self, up: Up, host_id: str, *extra: str, lease_ttl: float = 2.0, net: HostNet | None = None
    ) -> None:
        """`net`: the host runs in its own network namespace (a partition is real)."""
        self.up, self.host_id, self.extra = up, host_id, list(extra)
        self.lease_ttl = lease_ttl
        self.net = net
        self.root = up.data_dir.parent / "hosts" / host_id
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> Host:
        if self.net is not None:  # issued from here: inside, the server is not on loopback
            made = self.up.cli(
                "credentials", "create", "--role", "host-agent", "--host", self.host_id
            )
            assert made.returncode == 0, made.stderr
        LOGS.append(self.up.data_dir.parent / f"{self.host_id}.log")
        with LOGS[-1].open("ab") as log:
            argv = [
                SANDHOLD,
                "--data-dir",  # where `sandhold run` finds (or makes) this host's credential
                str(self.up.data_dir),
                "run",
                "host-agent",
                "--nats",
                self.net.nats_url if self.net else self.up.nats_url,
                "--host-id",
                self.host_id,
                "--root",
                str(self.root),
                "--lease-ttl",
                str(self.lease_ttl),
                *self.extra,
            ]
            self.process = subprocess.Popen(
                self.net.enter(argv) if self.net else argv,
                stdout=log,
                stderr=log,
                process_group=0,
            )
        return self

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def sandbox_pids(self) -> list[int]:
        """The sandboxes' boxes (and so the commands in them), anything working in the root."""
        marker, found = str(self.root.resolve()), box_inits(self.root)
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    if os.readlink(d / "cwd").startswith(marker):
                        found.append(int(d.name))
                except OSError:
                    continue
        return found

    def fail(self) -> None:
        """The machine is gone: the agent and its sandboxes' processes die at once."""
        os.kill(self.pid, signal.SIGKILL)
        for pid in self.sandbox_pids():
            with _gone():
                os.kill(pid, signal.SIGKILL)
        assert self.process is not None
        self.process.wait()
        forget_connections(self.root)  # its memory went with it, the tmpfs included

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            with _gone():
                os.kill(self.pid, signal.SIGCONT)
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for pid in self.sandbox_pids():
            with _gone():
                os.kill(pid, signal.SIGKILL)
        forget_connections(self.root)
