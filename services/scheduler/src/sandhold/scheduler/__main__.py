"""`python -m sandhold.scheduler --nats URL [--prefix P]`"""

from __future__ import annotations

import argparse

from sandhold.bus.names import Names
from sandhold.bus.service import common_arguments, run_service
from sandhold.domain.sandbox import DEFAULT_IDLE_TIMEOUT_S, Defaults
from sandhold.scheduler.service import Scheduler


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sandhold run scheduler")
    common_arguments(p)
    p.add_argument("--lease-ttl", type=float, default=5.0)
    p.add_argument(
        "--save-interval",
        type=float,
        default=30.0,
        help="seconds between saves of a running sandbox, unless it sets its own",
    )
    p.add_argument(
        "--stop-deadline",
        type=float,
        default=60.0,
        help="seconds a stop may take, final save included, unless a sandbox sets one",
    )
    p.add_argument(
        "--idle-timeout",
        type=float,
        default=DEFAULT_IDLE_TIMEOUT_S,
        help="seconds without activity before a sandbox is stopped with its final save, "
        f"unless it sets its own; 0: never (default {DEFAULT_IDLE_TIMEOUT_S:.0f})",
    )
    p.add_argument(
        "--claim-ttl",
        type=float,
        default=5.0,
        help="where schedulers run twice: seconds before one takes placement over from "
        "a twin that stopped renewing its claim (default 5)",
    )
    return p


def main(argv: list[str] | None = None) -> None:
    run_service(
        lambda a: Scheduler(
            a.nats,
            Names(a.prefix),
            lease_ttl=a.lease_ttl,
            defaults=Defaults(
                save_interval_s=a.save_interval,
                stop_deadline_s=a.stop_deadline,
                idle_timeout_s=a.idle_timeout,
            ),
            claim_ttl=a.claim_ttl,
        ),
        parser(),
        argv,
    )


if __name__ == "__main__":
    main()
