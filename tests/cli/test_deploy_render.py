"""The distributed deployment's files come from the code `sandhold up` runs:
compose.yaml is what `sandhold deploy compose` prints, and the node configs that
`sandhold deploy render` writes form an authenticated JetStream cluster."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import nats
import pytest
import yaml
from sandhold.bus import credentials
from sandhold.bus.names import Names
from sandhold.bus.server import free_port
from sandhold.bus.streams import ensure_streams

from sandhold.cli import deploy
from sandhold.cli.topology import CONTROL_PLANE, instance_names
from tests.conftest import ROOT
from tests.support.bus import hello
from tests.support.nodes import running_nodes
from tests.support.waiting import wait_until


def test_the_committed_compose_file_is_the_generated_one():
    assert (ROOT / "compose.yaml").read_text() == deploy.compose(), (
        "compose.yaml is stale: `uv run sandhold deploy compose > compose.yaml`"
    )


def test_compose_runs_two_of_every_service_each_preferring_another_node():
    services = yaml.safe_load(deploy.compose())["services"]
    nodes = [f"nats://nats-{i}:4222" for i in (1, 2, 3)]
    for role in CONTROL_PLANE:
        preferred = []
        for instance in instance_names(role, 2):
            spec = services[instance]
            assert spec["command"][:3] == ["sandhold", "run", role]
            assert spec["command"][3:5] == ["--instance", instance]
            servers = spec["environment"]["SANDHOLD_NATS_URL"].split(",")
            assert sorted(servers) == nodes
            preferred.append(servers[0])
        assert len(set(preferred)) == 2, role
    for node in ("nats-1", "nats-2", "nats-3"):
        assert f"./deploy/cluster/{node}.conf:/etc/nats/nats.conf:ro" in services[node]["volumes"]


@pytest.fixture
def rendered(tmp_path: Path) -> Iterator[tuple[list[str], Path]]:
    """Three nats-servers run from rendered configs, on loopback instead of the
    compose network's names (the only difference)."""
    ports = [(free_port(), free_port()) for _ in range(3)]
    nodes = [
        deploy.NodeAddress(
            name=f"nats-{i + 1}",
            listen=f"127.0.0.1:{client}",
            cluster_listen=f"127.0.0.1:{route}",
            route=f"127.0.0.1:{route}",
            store_dir=str(tmp_path / f"store-{i + 1}"),
        )
        for i, (client, route) in enumerate(ports)
    ]
    deploy.issue_credentials(tmp_path / "credentials", ["host-1"])
    configs = deploy.render_nodes(tmp_path, nodes, Names())
    with running_nodes(configs, tmp_path):
        yield [f"nats://127.0.0.1:{client}" for client, _ in ports], tmp_path


async def test_rendered_nodes_form_an_authenticated_cluster_with_r3_streams(rendered):
    urls, out = rendered
    admin = credentials.load(out / "credentials" / "admin.json")
    nc = await nats.connect(urls, user=admin.user, password=admin.password)
    try:
        # Three servers just started: `ensure_streams` waits until their JetStream
        # meta group knows all three peers (before, an R3 stream is refused).
        await ensure_streams(nc.jetstream(), Names(), replicas=3)

        async def replicated() -> bool:
            info = await nc.jetstream().stream_info("SH_EVENTS")
            peers = (info.cluster.replicas or []) if info.cluster else []
            return info.config.num_replicas == 3 and len(peers) == 2

        await wait_until(replicated, timeout=30, what="SH_EVENTS on three nodes")
    finally:
        await nc.close()
    # No anonymous client, and the route user is no client at all.
    route = credentials.load(out / "routes" / "route.json")
    for login in ({}, {"user": route.user, "pass": route.password}):
        assert b"Authorization Violation" in await hello(urls[0], login)
