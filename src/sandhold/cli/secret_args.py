"""`--secret NAME=VALUE` and `--secret-file NAME=PATH`, the same for `exec`
and `task submit`. A value on the command line is seen by `ps` and kept in
shell history; one read from a file is not."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_secret_option(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--secret",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help=f"in {what} environment, never recorded (events name it only)",
    )
    parser.add_argument(
        "--secret-file",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="the same, the value read from a file (one final newline dropped): "
        "kept out of `ps` and shell history",
    )


def secrets_of(pairs: list[str], files: list[str] | None = None) -> dict[str, str]:
    """The secrets given; raises ValueError for one that is not NAME=VALUE
    (NAME=PATH), a file that cannot be read, or a name given twice."""
    secrets: dict[str, str] = {}

    def add(name: str, value: str) -> None:
        if name in secrets:
            raise ValueError(f"secret {name} given twice")
        secrets[name] = value

    for pair in pairs:
        name, is_pair, value = pair.partition("=")
        if not is_pair or not name:
            raise ValueError("--secret takes NAME=VALUE")
        add(name, value)
    for pair in files or []:
        name, is_pair, path = pair.partition("=")
        if not is_pair or not name or not path:
            raise ValueError("--secret-file takes NAME=PATH")
        try:
            text = Path(path).read_text()
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"--secret-file {name}: {err}") from None
        add(name, text.removesuffix("\n"))
    return secrets
