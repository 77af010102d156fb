"""`sandhold task`'s arguments: light to import, as every start of the CLI
builds its whole parser (`tasks.py` does the work)."""

from __future__ import annotations

import argparse

from sandhold.cli.secret_args import add_secret_option

# The domain's `task.TaskState`, sorted (a test keeps them the same): the
# domain's import would cost the CLI's start-up msgspec's.
TASK_STATES = [
    "cancelled",
    "completed",
    "completing",
    "failed",
    "pending",
    "provisioning",
    "running",
    "staging",
    "timed_out",
]


def add_parser(sub: argparse._SubParsersAction) -> None:
    task = sub.add_parser("task", help="submit, list, show, watch and cancel tasks")
    actions = task.add_subparsers(dest="action", required=True)
    submit = actions.add_parser("submit", help="submit a manifest (YAML or JSON; - for stdin)")
    submit.add_argument("manifest")
    submit.add_argument("--key", help="idempotency key (default: a new one)")
    submit.add_argument("--watch", action="store_true", help="then watch it until it ends")
    add_secret_option(submit, "each agent step's (the manifest's `secrets:` names them)")
    ls = actions.add_parser("ls")
    ls.add_argument("--state", choices=TASK_STATES)
    for name in ("show", "watch", "cancel"):
        actions.add_parser(name).add_argument("id")
    artifact = actions.add_parser("artifact", help="write one of a task's artifacts to stdout")
    artifact.add_argument("id")
    artifact.add_argument("path", help="as listed by `task show`")
    artifact.add_argument("-o", "--output", help="write to this file instead")
    actions.choices["cancel"].add_argument("--key", help="idempotency key")
    for action in actions.choices.values():
        action.add_argument("--json", action="store_true")
