"""Schemathesis hooks (`SCHEMATHESIS_HOOKS=tests.support.schemathesis_hooks`).

A task manifest has rules across fields that JSON Schema cannot state (the
document says them in words): `hang.cancel_after` longer than `hang.warn_after`,
`sandbox.keep_stopped` longer than `retry.max_delay`, unique step names, not
both `repository` and `sandbox.from_snapshot`; and a
command may not name a variable both in `env` and in `secrets`. A body
that breaks one is refused with 422, as documented, so the fuzzer must not
count it as "schema-valid yet rejected": such bodies are left out. Every other
body, malformed ones included, is still sent.
"""

from __future__ import annotations

from typing import Any

import schemathesis
from sandhold.domain.task_manifest import TaskManifest
from sandhold.gateway.bodies import convert
from sandhold.gateway.problems import ProblemError

# The domain's own messages for the rules across fields (task_manifest.py).
_CROSS_FIELD = (
    "`cancel_after` must be longer than `warn_after`",
    "`sandbox.keep_stopped` must be longer than `retry.max_delay`",
    "step names must be unique",
    "both name the starting files",
    "also set in an `env` or by sandhold",
)


def breaks_a_cross_field_rule(body: Any) -> bool:
    """Whether the gateway refuses the manifest for one of the rules across fields
    (through its own conversion: it takes 3.0 as an integer, as JSON does)."""
    try:
        manifest = convert(body, TaskManifest)
    except ProblemError as err:
        return any(rule in str(err) for rule in _CROSS_FIELD)
    return bool(manifest.secrets)  # refused over HTTP, as documented: no values


# Both: the coverage phase applies case hooks only, the fuzzing and stateful
# phases draw bodies through body hooks.
@schemathesis.hook.apply_to(method="POST", path="/api/v1/tasks")
def filter_case(ctx: Any, case: Any) -> bool:
    return not breaks_a_cross_field_rule(case.body)


@schemathesis.hook.apply_to(method="POST", path="/api/v1/tasks")
def filter_body(ctx: Any, body: Any) -> bool:
    return not breaks_a_cross_field_rule(body)


def shares_a_name(body: Any) -> bool:
    """Whether a command body names a variable both in `env` and in `secrets`."""
    if not isinstance(body, dict):
        return False
    env, secrets = body.get("env"), body.get("secrets")
    return isinstance(env, dict) and isinstance(secrets, dict) and bool(set(env) & set(secrets))


_COMMANDS = "/api/v1/sandboxes/{sandbox_id}/commands"


@schemathesis.hook.apply_to(method="POST", path=_COMMANDS)
def filter_case(ctx: Any, case: Any) -> bool:  # noqa: F811 - one per operation
    return not shares_a_name(case.body)


@schemathesis.hook.apply_to(method="POST", path=_COMMANDS)
def filter_body(ctx: Any, body: Any) -> bool:  # noqa: F811
    return not shares_a_name(body)
