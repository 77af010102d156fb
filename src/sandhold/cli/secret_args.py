"""`--secret NAME=VALUE`, the same for `exec` and `task submit`."""

from __future__ import annotations

import argparse


def add_secret_option(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--secret",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help=f"in {what} environment, never recorded (events name it only)",
    )


def secrets_of(pairs: list[str]) -> dict[str, str]:
    """The secrets given; raises ValueError for one that is not NAME=VALUE."""
    secrets = {}
    for pair in pairs:
        name, is_pair, value = pair.partition("=")
        if not is_pair or not name:
            raise ValueError("--secret takes NAME=VALUE")
        secrets[name] = value
    return secrets
