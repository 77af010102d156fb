"""`python -m sandhold.saver --nats URL [--prefix P]`"""

from __future__ import annotations

import argparse

from sandhold.bus.names import Names
from sandhold.bus.service import common_arguments, run_service
from sandhold.saver.service import Saver


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sandhold run saver")
    common_arguments(p)
    p.add_argument(
        "--save-timeout",
        type=float,
        default=600.0,
        help="a save not completed within this many seconds fails",
    )
    p.add_argument("--keep-last", type=int, default=5, help="completed saves kept per sandbox")
    p.add_argument("--gc-interval", type=float, default=600.0)
    p.add_argument(
        "--gc-grace",
        type=float,
        default=3600.0,
        help="never collect a chunk younger than this (saves in flight)",
    )
    p.add_argument(
        "--claim-ttl",
        type=float,
        default=5.0,
        help="where savers run twice: seconds before one takes verification and "
        "garbage collection over from a twin that stopped renewing its claim (default 5)",
    )
    return p


def main(argv: list[str] | None = None) -> None:
    run_service(
        lambda a: Saver(
            a.nats,
            Names(a.prefix),
            save_timeout_s=a.save_timeout,
            keep_last=a.keep_last,
            gc_interval_s=a.gc_interval,
            gc_grace_s=a.gc_grace,
            claim_ttl=a.claim_ttl,
        ),
        parser(),
        argv,
    )


if __name__ == "__main__":
    main()
