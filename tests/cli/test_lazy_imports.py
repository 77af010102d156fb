"""The CLI's start-up imports only its parser: `sandhold --help` and a mistyped
command never load nats-py, msgspec or the services' code (bench/cli.py
measures the time; this keeps the property)."""

from __future__ import annotations

import subprocess
import sys
from typing import get_args

from sandhold.domain import task as tk

from sandhold.cli.task_args import TASK_STATES

HEAVY = ["nats", "msgspec", "asyncio", "sandhold.client", "sandhold.domain", "sandhold.telemetry"]


def test_parsing_the_command_line_imports_nothing_that_talks_to_nats() -> None:
    probe = (
        "import sys\n"
        "from sandhold.cli import main\n"
        "main._parser().parse_args(['sandbox', 'ls'])\n"
        f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ""


def test_the_task_states_offered_are_the_domains() -> None:
    assert sorted(get_args(tk.TaskState)) == TASK_STATES
