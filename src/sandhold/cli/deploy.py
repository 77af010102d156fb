"""The distributed deployment's files, from the code `sandhold up` runs.

`sandhold deploy render --out deploy/cluster` writes what the nodes and the
services need: every user's credential, the route user, and each nats-server
node's configuration (`server.render_config`, the one `up --nodes 3` writes,
with the compose network's addresses instead of loopback). `sandhold deploy
compose` prints `compose.yaml`: three nodes and two instances of every
control-plane service, named and spread over the nodes as `up --nodes 3` does
(`topology.py`). The committed `compose.yaml` is checked against it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec
import yaml
from sandhold.bus import credentials, permissions
from sandhold.bus.names import Names
from sandhold.bus.server import ClusterConfig, render_config, store_key

from sandhold.cli.topology import CONTROL_PLANE, instance_names, servers_for

CLIENT_PORT, ROUTE_PORT, METRICS_PORT = 4222, 6222, 9464
CREDENTIALS = "/etc/sandhold/credentials"  # where compose mounts <out>/credentials


class NodeAddress(msgspec.Struct, frozen=True, kw_only=True):
    name: str  # the server's name
    listen: str  # host:port for clients
    cluster_listen: str  # host:port for routes
    route: str  # host:port where the other nodes reach its routes
    store_dir: str


def compose_nodes(count: int) -> list[NodeAddress]:
    return [
        NodeAddress(
            name=f"nats-{i + 1}",
            listen=f"0.0.0.0:{CLIENT_PORT}",
            cluster_listen=f"0.0.0.0:{ROUTE_PORT}",
            route=f"nats-{i + 1}:{ROUTE_PORT}",
            store_dir="/data/jetstream",
        )
        for i in range(count)
    ]


def issue_credentials(directory: Path, hosts: list[str]) -> None:
    """The admin, the operator, one user per control-plane service and per host."""
    for role in ("admin", "operator", *CONTROL_PLANE):
        credentials.issue(directory, role)
    for host in hosts:
        credentials.issue(directory, "host-agent", host=host)


def render_nodes(out: Path, nodes: list[NodeAddress], names: Names) -> list[Path]:
    """Each node's configuration (`<out>/<node>.conf`, 0600: it holds passwords
    and the store's key), with the users of `<out>/credentials`."""
    route_user = credentials.issue(out / "routes", "route")
    authorization = permissions.authorization(names, credentials.every(out / "credentials"))
    written = []
    for node in nodes:
        text = render_config(
            name=node.name,
            listen=node.listen,
            store_dir=node.store_dir,
            key=store_key(out / f"{node.name}.key"),
            authorization=authorization,
            cluster=ClusterConfig(
                name="sandhold",
                listen=node.cluster_listen,
                routes=[other.route for other in nodes if other.name != node.name],
                user=route_user,
            ),
        )
        path = out / f"{node.name}.conf"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        written.append(path)
    return written


def render(
    out: Path, *, nodes: int = 3, hosts: list[str] | None = None, prefix: str = "sh"
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    issue_credentials(out / "credentials", hosts or ["host-1"])
    render_nodes(out, compose_nodes(nodes), Names(prefix))


def compose(*, nodes: int = 3, instances: int = 2, hosts: list[str] | None = None) -> str:
    """compose.yaml for `nodes` nodes and `instances` of every service."""
    urls = [f"nats://nats-{i + 1}:{CLIENT_PORT}" for i in range(nodes)]
    node_names = [f"nats-{i + 1}" for i in range(nodes)]
    services: dict[str, Any] = {}
    for node in node_names:
        services[node] = {
            "image": "nats:2.12",
            "command": ["-c", "/etc/nats/nats.conf"],
            "volumes": [f"./deploy/cluster/{node}.conf:/etc/nats/nats.conf:ro", f"{node}:/data"],
        }
    # The admin makes the streams once; no service may (docs/security.md).
    services["streams"] = {
        "build": ".",
        "environment": {"SANDHOLD_NATS_URL": ",".join(urls)},
        "volumes": [f"./deploy/cluster/credentials:{CREDENTIALS}:ro"],
        "depends_on": node_names,
        "command": [
            "sandhold",
            "streams",
            "ensure",
            "--replicas",
            str(min(3, nodes)),
            "--credentials",
            f"{CREDENTIALS}/admin.json",
        ],  # fmt: skip
    }

    def service(index: int, command: list[str]) -> dict[str, Any]:
        """A sandhold process preferring node `index`, as its own user."""
        return {
            "build": ".",
            "environment": {
                "SANDHOLD_NATS_URL": ",".join(servers_for(urls, index)),
                "SANDHOLD_METRICS_PORT": str(METRICS_PORT),
                "SANDHOLD_METRICS_ADDR": "0.0.0.0",
            },
            "volumes": [f"./deploy/cluster/credentials:{CREDENTIALS}:ro"],
            "depends_on": ["streams"],
            "restart": "unless-stopped",
            "command": ["sandhold", "run", *command],
        }

    own: dict[str, list[str]] = {
        "orchestrator": ["--work-dir", "/var/lib/sandhold-orchestrator"],
        # tokens in /var/lib/sandhold-gateway/tokens.json, shared by the instances
        "gateway": [
            "--host",
            "0.0.0.0",
            "--port",
            "8080",
            "--data-dir",
            "/var/lib/sandhold-gateway",
        ],
    }
    for role in CONTROL_PLANE:
        for index, instance in enumerate(instance_names(role, instances)):
            spec = service(index, [
                role,
                *(["--instance", instance] if instance != role else []),
                "--credentials", f"{CREDENTIALS}/{role}.json",
                *own.get(role, []),
            ])  # fmt: skip
            if role == "gateway":  # behind a load balancer of yours, one port each here
                spec["volumes"].append("gateway-data:/var/lib/sandhold-gateway")
                spec["ports"] = [f"127.0.0.1:{8080 + index}:8080"]
            services[instance] = spec
    for index, host in enumerate(hosts or ["host-1"]):
        user = credentials.user_for("host-agent", host)
        spec = service(index, [
            "host-agent", "--host-id", host, "--credentials", f"{CREDENTIALS}/{user}.json",
            "--root", "/var/lib/sandhold",
        ])  # fmt: skip
        spec["privileged"] = True  # cgroups and namespaces for sandboxes
        services[host] = spec
    services["prometheus"] = {
        "image": "prom/prometheus:v2.53.0",
        "volumes": ["./deploy/prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro"],
        "ports": ["9090:9090"],
    }
    services["grafana"] = {
        "image": "grafana/grafana:11.1.0",
        "environment": {"GF_AUTH_ANONYMOUS_ENABLED": "true"},
        "volumes": [
            "./deploy/grafana/provisioning:/etc/grafana/provisioning:ro",
            "./deploy/grafana/dashboards:/var/lib/grafana/dashboards:ro",
        ],
        "ports": ["3000:3000"],
        "depends_on": ["prometheus"],
    }
    volumes: dict[str, Any] = {node: {} for node in node_names} | {"gateway-data": {}}
    header = (
        "# The distributed deployment: what `sandhold up --nodes 3` runs on one machine,\n"
        "# as containers (docs/deploy.md). GENERATED by `sandhold deploy compose`; the\n"
        "# nodes' configs and every credential by `sandhold deploy render --out\n"
        "# deploy/cluster` (not committed: it holds passwords and the stores' keys).\n"
        "# Requires a Docker engine; the embedded default (`uv run sandhold up`) needs none.\n"
    )
    body = yaml.safe_dump({"services": services, "volumes": volumes}, sort_keys=False, width=100)
    return header + body
