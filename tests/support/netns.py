"""A host as a separate machine: its own network namespace, joined to this one
by a veth pair, so that `ip link set … down` is a real partition — its
processes keep running, and nothing they send arrives.

The host reaches NATS (on 127.0.0.1 here) through a forwarder on this side of
its link (`forward.py`), as it would through a router. Processes enter only the
network namespace (`nsenter --net`), so cgroups and mounts stay the machine's.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[2]  # the project, where `tests` imports from


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


class HostNet:
    """Network namespace `sh-<name>`: 10.231.<index>.2 inside, .1 on this side."""

    def __init__(self, name: str, index: int) -> None:
        self.namespace = f"sh-{name}"[:15]
        self.outside = f"vh-{name}"[:15]  # this side's end of the link
        self.inside = f"vn-{name}"[:15]
        self.gateway = f"10.231.{index}.1"
        self.address = f"10.231.{index}.2"
        self._forwarder: subprocess.Popen[bytes] | None = None

    def create(self, ports: list[int]) -> HostNet:
        """Make the namespace and its link; forward `ports` on this side's address
        to the same ports on this machine's loopback (NATS's)."""
        self.destroy()  # a namespace a crashed run left behind
        _ip("netns", "add", self.namespace)
        _ip("link", "add", self.outside, "type", "veth", "peer", "name", self.inside)
        _ip("link", "set", self.inside, "netns", self.namespace)
        _ip("addr", "add", f"{self.gateway}/30", "dev", self.outside)
        _ip("link", "set", self.outside, "up")
        inside = ["-n", self.namespace]
        _ip(*inside, "addr", "add", f"{self.address}/30", "dev", self.inside)
        _ip(*inside, "link", "set", self.inside, "up")
        _ip(*inside, "link", "set", "lo", "up")
        self._ports = ports
        self._forwarder = subprocess.Popen(
            [sys.executable, "-m", "tests.support.forward", self.gateway,
             *(str(p) for p in self._ports)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
        )  # fmt: skip
        assert self._forwarder.stdout is not None
        assert self._forwarder.stdout.readline() == b"forwarding\n"
        return self

    @staticmethod
    def ports_of(nats_url: str) -> list[int]:
        return [urlsplit(u).port or 4222 for u in nats_url.split(",")]

    @property
    def nats_url(self) -> str:
        """The NATS URL(s) as the host sees them from inside its namespace."""
        return ",".join(f"nats://{self.gateway}:{p}" for p in self._ports)

    def enter(self, argv: list[str]) -> list[str]:
        """`argv` run inside the namespace (its network only)."""
        return ["nsenter", f"--net=/run/netns/{self.namespace}", "--", *argv]

    def cut(self) -> None:
        _ip("link", "set", self.outside, "down")

    def heal(self) -> None:
        _ip("link", "set", self.outside, "up")

    def destroy(self) -> None:
        if self._forwarder is not None:
            self._forwarder.kill()
            self._forwarder.wait()
            if self._forwarder.stdout is not None:
                self._forwarder.stdout.close()
            self._forwarder = None
        if Path(f"/run/netns/{self.namespace}").exists():
            # Deleting the namespace deletes the link's inside end, and so the pair.
            subprocess.run(["ip", "netns", "del", self.namespace], capture_output=True)
        subprocess.run(["ip", "link", "del", self.outside], capture_output=True)
