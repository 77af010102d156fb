"""`python -m sandhold.scheduler --nats URL [--prefix P]`"""

from __future__ import annotations

import argparse

from sandhold.bus.names import Names
from sandhold.bus.service import common_arguments, run_service
from sandhold.scheduler.service import Scheduler


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sandhold run scheduler")
    common_arguments(p)
    p.add_argument("--lease-ttl", type=float, default=5.0)
    return p


def main(argv: list[str] | None = None) -> None:
    run_service(
        lambda a: Scheduler(a.nats, Names(a.prefix), replicas=a.replicas, lease_ttl=a.lease_ttl),
        parser(),
        argv,
    )


if __name__ == "__main__":
    main()
