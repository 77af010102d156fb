"""`python -m sandhold.hostagent --nats URL --host-id H --root DIR`"""

from __future__ import annotations

import argparse
import socket
from pathlib import Path

from sandhold.bus.names import Names
from sandhold.bus.service import common_arguments, run_service
from sandhold.hostagent.service import HostAgent
from sandhold.saves import DEFAULT_CACHE_BYTES

MiB = 1024 * 1024


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 (none) or more, got {text!r}")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sandhold run host-agent")
    common_arguments(p)
    p.add_argument(
        "--host-id",
        default=socket.gethostname().split(".")[0].lower(),
        help="this host's name (default: the hostname)",
    )
    p.add_argument(
        "--root",
        type=Path,
        default=None,
        help="where sandboxes live (default ./.sandhold/hosts/<host-id>)",
    )
    p.add_argument(
        "--driver",
        choices=["namespaces", "process"],
        default="namespaces",
        help="namespaces (default): each sandbox in its own user, pid, mount, net, ipc and "
        "uts namespaces; process: UNISOLATED, commands run as this host's root — "
        "development only",
    )
    p.add_argument(
        "--image-root",
        action="append",
        type=Path,
        default=None,
        help="a directory of root file systems sandboxes may name as --image "
        "(repeatable; default <root>/../../images, i.e. .sandhold/images)",
    )
    p.add_argument("--capacity", type=int, default=64, help="how many sandboxes fit")
    p.add_argument(
        "--warm-supervisors",
        type=_count,
        default=2,
        help="idle command supervisors kept ready for the next launch; never more are kept "
        "(default 2)",
    )
    p.add_argument(
        "--chunk-cache-mb",
        type=_count,
        default=DEFAULT_CACHE_BYTES // MiB,
        help="MiB of restored chunks kept under <root>/chunk-cache for the next restores, "
        f"least recently used evicted first; 0: none (default {DEFAULT_CACHE_BYTES // MiB})",
    )
    p.add_argument(
        "--lease-interval",
        type=float,
        default=1.0,
        help="seconds between lease renewals (default 1)",
    )
    p.add_argument(
        "--lease-ttl",
        type=float,
        default=5.0,
        help="fence itself after this many seconds without a renewal (default 5)",
    )
    p.add_argument(
        "--stale-copies",
        choices=["destroy", "quarantine"],
        default="destroy",
        help="what to do with copies of sandboxes recovered elsewhere",
    )
    p.add_argument(
        "--on-exit",
        choices=["keep", "interrupt"],
        default="keep",
        help="keep commands running for the next agent to adopt (default), or interrupt them",
    )
    return p


def main(argv: list[str] | None = None) -> None:
    def make(a: argparse.Namespace) -> HostAgent:
        return HostAgent(
            a.nats,
            Names(a.prefix),
            host_id=a.host_id,
            root=a.root or Path(".sandhold") / "hosts" / a.host_id,
            capacity_sandboxes=a.capacity,
            chunk_cache_bytes=a.chunk_cache_mb * MiB,
            warm_supervisors=a.warm_supervisors,
            lease_interval=a.lease_interval,
            lease_ttl=a.lease_ttl,
            stale_copies=a.stale_copies,
            interrupt_on_exit=a.on_exit == "interrupt",
            isolation=a.driver,
            image_roots=a.image_root,
        )

    run_service(make, parser(), argv, private_files=False)


if __name__ == "__main__":
    main()
