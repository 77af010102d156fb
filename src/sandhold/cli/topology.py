"""What runs where: the control-plane services, their instances' names, and the
order in which an instance tries the nodes. `sandhold up` and the compose
deployment (`sandhold deploy compose`) both take them from here (decision 035)."""

from __future__ import annotations

# Every control-plane service; host-agents run one per host, never twice.
CONTROL_PLANE = ("scheduler", "saver", "recovery", "metrics", "orchestrator", "gateway")


def instance_names(service: str, count: int) -> list[str]:
    """`scheduler` when it runs once; `scheduler-1`, `scheduler-2`, … otherwise."""
    return [service] if count == 1 else [f"{service}-{i + 1}" for i in range(count)]


def servers_for(urls: list[str], index: int) -> list[str]:
    """Every node's URL, starting with the one the `index`-th process prefers:
    instances of one service spread over the nodes, and each still reaches the
    others when its own node is gone."""
    first = index % len(urls)
    return urls[first:] + urls[:first]
