"""nats-server nodes run from rendered configs (`sandhold deploy render`), as
the deployment runs them: started, and stopped by PID whatever happens."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

from sandhold.bus.server import nats_server_binary

from tests.support.procs import stop_all


@contextlib.contextmanager
def running_nodes(
    configs: list[Path], logs: Path, *, wrap: Callable[[int, list[str]], list[str]] | None = None
) -> Iterator[list[subprocess.Popen[bytes]]]:
    """One nats-server per config, its log in `logs/<config stem>.log`; `wrap(i, argv)`
    may run the i-th elsewhere (in a network namespace)."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for i, config in enumerate(configs):
            argv = [str(nats_server_binary()), "-c", str(config)]
            with (logs / f"{config.stem}.log").open("wb") as log:
                procs.append(subprocess.Popen(wrap(i, argv) if wrap else argv, stderr=log))
        yield procs
    finally:
        stop_all(procs, grace_s=10)
