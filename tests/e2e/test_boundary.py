"""The boundary through `sandhold up`: from inside a sandbox the control plane is out of reach."""

from __future__ import annotations

import asyncio
from urllib.parse import urlparse

import pytest
from sandhold.client import Client

from tests.e2e.conftest import running_sandbox
from tests.e2e.harness import Up

# Tries to open a TCP connection to each port given; prints one word per port.
PROBE = (
    "import socket, sys\n"
    "for port in sys.argv[1:]:\n"
    "    for host in ('127.0.0.1', '10.0.2.2'):\n"
    "        try:\n"
    "            s = socket.socket(); s.settimeout(5); s.connect((host, int(port)))\n"
    "            print('reached', host, port)\n"
    "        except OSError:\n"
    "            pass\n"
    "print('done')\n"
)


@pytest.mark.parametrize("network", ["none", "egress"])
async def test_nats_the_gateway_and_metrics_are_unreachable_from_inside(
    up: Up, client: Client, network: str
):
    view = await client.show_sandbox(await running_sandbox(client))
    if network == "egress" and "egress" not in view.capabilities.get("network_modes", ""):
        pytest.skip("network egress needs slirp4netns: apt install slirp4netns")
    created = await client.create_sandbox(network=network)
    sandbox_id = (await client.wait_for_phase(created.id, {"running"}, timeout=60)).id
    ports = [urlparse(up.url).port, urlparse(up.gateway_url).port]
    ports += _metrics_ports(up)
    assert len(ports) >= 4 and all(ports)
    for port in ports:  # reachable from the host: the refusal below is the sandbox's
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.close()
    result = await client.exec(sandbox_id, ["python3", "-c", PROBE, *map(str, ports)])
    assert result.stdout == b"done\n", result.stdout  # nothing reached, in either mode
    shown = await client.show_sandbox(sandbox_id)
    assert shown.isolation["network"] == network
    assert shown.isolation["driver"] == "namespaces" and shown.isolation["seccomp"] is True


def _metrics_ports(up: Up) -> list[int]:
    """Every service's /metrics port, from runtime.json."""
    return [urlparse(url).port or 0 for url in up.runtime["metrics"].values()]
