"""The boundary through `sandhold up`: from inside a sandbox the control plane is out of reach."""

from __future__ import annotations

import asyncio
import os
import socket
from urllib.parse import urlparse

import pytest
from sandhold.client import Client

from tests.e2e.conftest import running_sandbox
from tests.e2e.harness import Up

# Tries to open a TCP connection to each port given; prints one word per port.
# A blocking connect (its timeout is SO_SNDTIMEO): the kernel returns success only
# once the handshake completed. Not settimeout(): that polls and reads SO_ERROR,
# and Linux queues an ICMP error (slirp's answer for 10.0.2.2, host loopback being
# disabled) on the socket's error queue just before it sets the socket's error, so
# a poll landing in between sees POLLERR, SO_ERROR 0, and "connects" to nothing.
# A socket connected to itself (127.0.0.1, source port == port) reached nothing.
PROBE = (
    "import socket, struct, sys\n"
    "for port in sys.argv[1:]:\n"
    "    for host in ('127.0.0.1', '10.0.2.2'):\n"
    "        s = socket.socket()\n"
    "        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack('ll', 5, 0))\n"
    "        try:\n"
    "            s.connect((host, int(port)))\n"
    "            if s.getsockname() != s.getpeername():\n"
    "                print('reached', host, port)\n"
    "        except OSError:\n"
    "            pass\n"
    "        s.close()\n"
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
    # And a listener of the test's own on the host's loopback: what arrives there
    # is known, whatever the probe inside believes. A connection that completed
    # waits in its accept queue, so after the probe a non-blocking accept finds it.
    with socket.create_server(("127.0.0.1", 0)) as canary:
        ports.append(canary.getsockname()[1])
        result = await client.exec(sandbox_id, ["python3", "-c", PROBE, *map(str, ports)])
        canary.setblocking(False)
        with pytest.raises(BlockingIOError):
            canary.accept()  # nothing from inside arrived on the host's loopback
    assert result.stdout == b"done\n", result.stdout  # nothing reached, in either mode
    shown = await client.show_sandbox(sandbox_id)
    assert shown.isolation["network"] == network
    assert shown.isolation["driver"] == "namespaces" and shown.isolation["seccomp"] is True


def _metrics_ports(up: Up) -> list[int]:
    """Every service's /metrics port, from runtime.json."""
    return [urlparse(url).port or 0 for url in up.runtime["metrics"].values()]


async def test_a_disk_quota_holds_through_a_snapshot_and_a_restore(up: Up, client: Client):
    shown = await client.show_sandbox(await running_sandbox(client))
    if shown.capabilities.get("disk_quota") != "True":
        assert not os.environ.get("SANDHOLD_REQUIRE_DISK_QUOTA"), shown.capabilities
        pytest.skip(f"no disk quota on this host: {shown.capabilities.get('message')}")
    quota = 64 * 1024 * 1024
    first = await client.create_sandbox(disk_limit_bytes=quota)
    first = await client.wait_for_phase(first.id, {"running"}, timeout=60)
    assert first.disk_limit_bytes == quota
    assert first.capabilities["disk_limit_bytes"] == str(quota)
    await client.exec(first.id, ["sh", "-c", "echo mine > /workspace/kept"])
    snapshot = await client.snapshot(first.id, "before-fill")
    snapshot = await client.wait_for_save(first.id, snapshot.id, timeout=60)
    assert snapshot.state == "completed", snapshot
    # Restored into a new sandbox: onto its own disk, which is its quota again.
    second = await client.create_sandbox(disk_limit_bytes=quota, from_snapshot=snapshot.id)
    second = await client.wait_for_phase(second.id, {"running"}, timeout=120)
    kept = await client.exec(second.id, ["cat", "/workspace/kept"])
    assert kept.stdout == b"mine\n"
    fill = await client.exec(second.id, ["dd", "if=/dev/zero", "of=/workspace/big", "bs=1M"])
    assert fill.command.state == "resource_exhausted", fill.command
    assert "disk quota reached" in fill.command.reason
    assert up.cli_json("sandbox", "show", second.id)["disk_limit_bytes"] == quota
    # Each sandbox has a disk of its own: the first still has room.
    room = ["dd", "if=/dev/zero", "of=/workspace/ok", "bs=1M", "count=8"]
    done = (await client.exec(first.id, room)).command
    assert (done.state, done.exit_code) == ("exited", 0), done


async def test_by_default_a_tasks_http_step_may_not_reach_this_machine(client: Client):
    """`sandhold up` allows http steps public addresses only unless asked
    (`--http-egress any`): a manifest cannot call the control plane's loopback."""
    from sandhold.domain.task_manifest import load_manifest

    with socket.create_server(("127.0.0.1", 0)) as local:
        url = f"http://127.0.0.1:{local.getsockname()[1]}/hook"
        manifest = {"name": "call-home", "pipeline": [{"name": "call", "http": {"url": url}}]}
        view = await client.submit_task(load_manifest(manifest))
        task = await client.wait_for_task(
            view.id, lambda s: s if s.terminal else None, timeout=60, what="the task's end"
        )
        local.setblocking(False)
        with pytest.raises(BlockingIOError):
            local.accept()  # nothing came
    assert task.state == "failed", (task.state, task.reason, task.detail)
    step = task.steps["call"]
    assert "(public) does not allow" in step.detail, step
