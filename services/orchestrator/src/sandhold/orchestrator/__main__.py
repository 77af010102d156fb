"""`python -m sandhold.orchestrator --nats URL --work-dir DIR [--prefix P] [--instance NAME]
[--lease-ttl S] [--fence-margin S]`"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from sandhold.bus.names import Names
from sandhold.bus.service import common_arguments, run_service
from sandhold.orchestrator.service import Orchestrator


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sandhold run orchestrator")
    common_arguments(p)
    p.add_argument(
        "--work-dir", type=Path, required=True, help="where repositories are checked out"
    )
    p.add_argument(
        "--proof-window",
        type=float,
        default=float(os.environ.get("SANDHOLD_PROOF_WINDOW", "100")),
        help="after a restart, how old a claimed agent step may be for a re-send to "
        "prove whether its request had left (below the streams' 120 s duplicate window)",
    )
    p.add_argument(
        "--decision-wait",
        type=float,
        default=float(os.environ.get("SANDHOLD_DECISION_WAIT", "60")),
        help="after a restart, how long to wait for a request known to have left to be decided",
    )
    p.add_argument(
        "--http-egress",
        choices=["public", "any"],
        default=os.environ.get("SANDHOLD_HTTP_EGRESS", "public"),
        help="where http tool steps may go: public addresses only (default), or any",
    )
    p.add_argument(
        "--lease-ttl",
        type=float,
        default=float(os.environ.get("SANDHOLD_ORCHESTRATOR_LEASE_TTL", "5")),
        help="seconds this instance holds its lease without a renewal: past it, its "
        "runners stop until it renews (default 5; renewed every min(1, ttl/4) s)",
    )
    p.add_argument(
        "--fence-margin",
        type=float,
        default=float(os.environ.get("SANDHOLD_ORCHESTRATOR_FENCE_MARGIN", "2")),
        help="extra seconds, past --lease-ttl, without a renewal seen before a twin "
        "instance's tasks are taken over (default 2)",
    )
    return p


def main(argv: list[str] | None = None) -> None:
    run_service(
        lambda a: Orchestrator(
            a.nats,
            Names(a.prefix),
            work_dir=a.work_dir,
            proof_window_s=a.proof_window,
            decision_wait_s=a.decision_wait,
            http_egress=a.http_egress,
            lease_ttl_s=a.lease_ttl,
            fence_margin_s=a.fence_margin,
        ),
        parser(),
        argv,
    )


if __name__ == "__main__":
    main()
