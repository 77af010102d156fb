"""`python -m sandhold.recovery --nats URL [--lease-ttl S] [--fence-margin S]`"""

from __future__ import annotations

import argparse

from sandhold.bus.names import Names
from sandhold.bus.service import common_arguments, run_service
from sandhold.recovery.service import Recovery


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sandhold run recovery")
    common_arguments(p)
    p.add_argument(
        "--lease-ttl",
        type=float,
        default=5.0,
        help="seconds without a renewal before a host is lost (default 5)",
    )
    p.add_argument(
        "--fence-margin",
        type=float,
        default=2.0,
        help="extra seconds before a lost host counts as unable to write (default 2)",
    )
    return p


def main(argv: list[str] | None = None) -> None:
    run_service(
        lambda a: Recovery(
            a.nats,
            Names(a.prefix),
            lease_ttl=a.lease_ttl,
            fence_margin=a.fence_margin,
        ),
        parser(),
        argv,
    )


if __name__ == "__main__":
    main()
