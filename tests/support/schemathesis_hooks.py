"""Schemathesis hooks (`SCHEMATHESIS_HOOKS=tests.support.schemathesis_hooks`).

A task manifest has rules across fields that JSON Schema cannot state (the
document says them in words): `hang.cancel_after` longer than `hang.warn_after`,
unique step names, not both `repository` and `sandbox.from_snapshot`. A body
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
    "step names must be unique",
    "both name the starting files",
)


def breaks_a_cross_field_rule(body: Any) -> bool:
    """Whether the gateway refuses the manifest for one of the rules across fields
    (through its own conversion: it takes 3.0 as an integer, as JSON does)."""
    try:
        convert(body, TaskManifest)
    except ProblemError as err:
        return any(rule in str(err) for rule in _CROSS_FIELD)
    return False


# Both: the coverage phase applies case hooks only, the fuzzing and stateful
# phases draw bodies through body hooks.
@schemathesis.hook.apply_to(method="POST", path="/api/v1/tasks")
def filter_case(ctx: Any, case: Any) -> bool:
    return not breaks_a_cross_field_rule(case.body)


@schemathesis.hook.apply_to(method="POST", path="/api/v1/tasks")
def filter_body(ctx: Any, body: Any) -> bool:
    return not breaks_a_cross_field_rule(body)
