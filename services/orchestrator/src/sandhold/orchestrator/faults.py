"""Fault injection points, for tests: inert unless `SANDHOLD_FAULT` is set.

`SANDHOLD_FAULT=<point>[:<step id>]` makes the orchestrator kill itself with
SIGKILL when it reaches that point (for that step instance only, if given),
exactly as a crash would. `SANDHOLD_FAULT_MARKER=<path>` makes it fire once:
the file is created just before the kill, and a point whose marker exists is
passed silently, so the restarted orchestrator carries on.

Points: `after_claim` (the step is claimed in the ledger, nothing sent),
`after_send` (the agent step's request is stored, `step_dispatched` not yet
written), `before_output_recorded` (the step's work finished, its result not
yet written), `during_command` (an agent step's command runs).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

POINTS = frozenset({"after_claim", "after_send", "before_output_recorded", "during_command"})


def fault(point: str, step_id: str | None = None) -> None:
    """Die here if the environment asks for it."""
    wanted = os.environ.get("SANDHOLD_FAULT")
    if not wanted:
        return
    name, _, step = wanted.partition(":")
    if name != point or (step and step != step_id):
        return
    marker = os.environ.get("SANDHOLD_FAULT_MARKER")
    if marker:
        path = Path(marker)
        if path.exists():
            return
        path.write_text(f"{point} {step_id or ''}\n")
    print(f"fault injection: killing the orchestrator at {point} {step_id or ''}", file=sys.stderr)
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def check_configuration() -> None:
    """Refuse a misspelled point at start-up rather than never firing."""
    wanted = os.environ.get("SANDHOLD_FAULT")
    if wanted and wanted.partition(":")[0] not in POINTS:
        raise SystemExit(f"SANDHOLD_FAULT={wanted!r}: the point must be one of {sorted(POINTS)}")
