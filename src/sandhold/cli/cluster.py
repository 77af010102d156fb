"""`sandhold cluster status`: the nodes, where each stream's leader and replicas
are, every service instance and the leases held — what an operator looks at
when a control-plane machine is in doubt (docs/deploy.md)."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import msgspec
from sandhold.bus import leases
from sandhold.client import Client


async def status(client: Client, runtime: dict[str, Any], *, as_json: bool) -> int:
    report = {
        "nodes": _nodes(runtime),
        "streams": await _streams(client),
        "services": await _services(client, runtime),
        "hosts": await _hosts(client),
        "leases": await _instance_leases(client),
    }
    if as_json:
        sys.stdout.write(msgspec.json.encode(report).decode() + "\n")
    else:
        _print(report)
    # Unhealthy when a node this runtime started is gone or a stream has no leader.
    healthy = all(n["alive"] for n in report["nodes"]) and all(
        s["leader"] for s in report["streams"]
    )
    return 0 if healthy else 1


def _nodes(runtime: dict[str, Any]) -> list[dict[str, Any]]:
    """The nodes `sandhold up` started (a deployment of its own has no runtime.json:
    its nodes show as the streams' peers)."""
    return [{**node, "alive": _alive(node.get("pid"))} for node in runtime.get("nats_nodes", [])]


async def _streams(client: Client) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    for name in client.names.all_streams:
        try:
            info = await client.js.stream_info(name)
        except Exception as err:  # noqa: BLE001 - reported, the rest still shown
            found.append({"stream": name, "error": str(err), "leader": None, "replicas": []})
            continue
        cluster = info.cluster
        found.append(
            {
                "stream": name,
                "messages": info.state.messages,
                "replicas_configured": info.config.num_replicas or 1,
                # A single node has no cluster block: it leads what it holds.
                "leader": (cluster.leader if cluster else None) or "(single node)",
                "replicas": [
                    {"node": r.name, "current": bool(r.current), "lag": r.lag or 0}
                    for r in ((cluster.replicas or []) if cluster else [])
                ],
            }
        )
    return found


async def _services(client: Client, runtime: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {"instance": name, "pid": pid, "alive": _alive(pid)}
        for name, pid in sorted(runtime.get("services", {}).items())
    ]


async def _hosts(client: Client) -> list[dict[str, Any]]:
    kv = await leases.lease_bucket(client.js, client.names)
    now = time.time()
    found = []
    try:
        keys = await kv.keys()
    except Exception:  # noqa: BLE001 - an empty bucket answers with an error
        keys = []
    for key in sorted(k for k in keys if k != leases.SETTINGS_KEY):
        age, interval = await leases.lease_age(kv, key, now=now)
        found.append({"host": key, "renewed_s_ago": age, "interval_s": interval})
    return found


async def _instance_leases(client: Client) -> list[dict[str, Any]]:
    """Every key of the instance bucket: instances' leases (`orchestrator.orchestrator-2`)
    and duties' claims (`saver.claim.store`), with who holds each and how long ago
    it was renewed by the holder's clock (decisions 036, 037)."""
    try:
        kv = await client.js.key_value(client.names.instance_bucket)
        keys = await kv.keys()
    except Exception:  # noqa: BLE001 - no bucket (an older deployment) or no key yet
        return []
    now, found = time.time(), []
    for key in sorted(keys):
        try:
            entry = await kv.get(key)
            value = msgspec.json.decode(entry.value or b"{}")
        except Exception:  # noqa: BLE001 - gone since listed, or not ours to read
            continue
        renewed = value.get("renewed_at")
        found.append(
            {
                "key": key,
                "holder": value.get("holder") or value.get("instance"),
                "pid": value.get("pid"),
                "renewed_s_ago": None if renewed is None else max(0.0, now - renewed),
                "ttl_s": value.get("ttl_s"),
            }
        )
    return found


def _alive(pid: object) -> bool:
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _print(report: dict[str, Any]) -> None:
    if report["nodes"]:
        print("nodes")
        for n in report["nodes"]:
            state = "up" if n["alive"] else "DOWN"
            print(f"  {n['name']}  {n['url']}  pid {n['pid']}  {state}")
    print("streams")
    for s in report["streams"]:
        if "error" in s:
            print(f"  {s['stream']}  UNAVAILABLE: {s['error']}")
            continue
        peers = ", ".join(
            f"{r['node']} ({'current' if r['current'] else 'behind ' + str(r['lag'])})"
            for r in s["replicas"]
        )
        print(
            f"  {s['stream']}  R{s['replicas_configured']}  leader {s['leader'] or 'NONE'}"
            + (f"  followers {peers}" if peers else "")
        )
    print("services")
    for i in report["services"]:
        print(f"  {i['instance']}  pid {i['pid']}  {'up' if i['alive'] else 'DOWN'}")
    print("hosts")
    for h in report["hosts"]:
        age = h["renewed_s_ago"]
        print(f"  {h['host']}  lease renewed {'-' if age is None else f'{age:.1f}s ago'}")
    if report["leases"]:
        print("leases and claims")
    for lease in report["leases"]:
        age = lease["renewed_s_ago"]
        print(
            f"  {lease['key']}  held by {lease['holder']} (pid {lease['pid']})  "
            f"renewed {'-' if age is None else f'{age:.1f}s ago'}, ttl {lease['ttl_s']}s"
        )
