"""`python -m sandhold.metrics --nats URL [--metrics-port 9464]`"""

from __future__ import annotations

import argparse

from sandhold.bus.names import Names
from sandhold.bus.service import common_arguments, run_service
from sandhold.metrics.service import DEFAULT_PORT, MetricsService


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sandhold run metrics")
    common_arguments(p)
    return p


def main(argv: list[str] | None = None) -> None:
    p = parser()
    if p.get_default("metrics_port") is None:  # neither --metrics-port nor its env var
        p.set_defaults(metrics_port=DEFAULT_PORT)
    run_service(lambda a: MetricsService(a.nats, Names(a.prefix)), p, argv)


if __name__ == "__main__":
    main()
