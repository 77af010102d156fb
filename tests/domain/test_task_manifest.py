"""Task manifests: strict validation whose every message names the field, and
durations normalised to seconds."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st
from sandhold.domain.task_manifest import (
    ManifestError,
    TaskManifest,
    load_manifest,
    parse_duration,
    parse_manifest,
)

from tests.conftest import ROOT

AGENT = {"command": ["sh", "-c", "echo hi"]}


def minimal(**fields: object) -> dict[str, object]:
    return {"name": "demo", "agent": AGENT, **fields}


# --- durations ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given_value", "seconds"),
    [
        (90, 90.0),
        (0.5, 0.5),
        ("90s", 90.0),
        ("10m", 600.0),
        ("2h", 7200.0),
        ("1h30m", 5400.0),
        ("250ms", 0.25),
        ("1d", 86400.0),
        ("1.5s", 1.5),
        (" 3s ", 3.0),
    ],
)
def test_a_duration_is_seconds_or_a_string_with_units(given_value: object, seconds: float):
    assert parse_duration(given_value, "x") == seconds  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "bad", ["", "10", "10 m", "ten minutes", "1h 30m", "5x", "-5s", 0, -1, "0s", True, "31d"]
)
def test_a_bad_duration_is_refused_naming_the_field(bad: object):
    with pytest.raises(ValueError, match="`timeouts.clone`"):
        parse_duration(bad, "timeouts.clone")  # type: ignore[arg-type]


@given(st.integers(min_value=0, max_value=23), st.integers(min_value=0, max_value=59))
def test_hours_and_minutes_add_up(hours: int, minutes: int):
    text = (f"{hours}h" if hours else "") + (f"{minutes}m" if minutes else "")
    if not text:
        return
    assert parse_duration(text, "x") == hours * 3600 + minutes * 60


def test_durations_are_normalised_to_seconds_everywhere_on_decode():
    manifest = load_manifest(
        minimal(
            agent={**AGENT, "timeout": "2m"},
            timeouts={"clone": "10m", "stage": 90, "running": "1h", "task": "1h30m"},
            retry={"base_delay": "250ms", "max_delay": "1m"},
            hang={"warn_after": "1s", "cancel_after": "3s"},
        )
    )
    assert manifest.agent is not None and manifest.agent.timeout == 120.0
    assert (manifest.timeouts.clone, manifest.timeouts.stage) == (600.0, 90.0)
    assert (manifest.timeouts.running, manifest.timeouts.task) == (3600.0, 5400.0)
    assert (manifest.retry.base_delay, manifest.retry.max_delay) == (0.25, 60.0)
    assert (manifest.hang.warn_after, manifest.hang.cancel_after) == (1.0, 3.0)
    # The recorded manifest holds plain numbers, and reads back the same.
    encoded = msgspec.json.encode(manifest)
    assert b'"10m"' not in encoded
    assert msgspec.json.decode(encoded, type=TaskManifest) == manifest


def test_the_defaults_are_the_seeds():
    manifest = load_manifest(minimal())
    assert manifest.timeouts.clone == 600.0  # 10 minutes
    assert manifest.timeouts.stage == 900.0  # 15 minutes
    assert manifest.timeouts.task == 86400.0  # 24 hours
    assert manifest.timeouts.running is None
    assert (manifest.retry.network, manifest.retry.placement) == (3, 2)
    assert (manifest.hang.warn_after, manifest.hang.cancel_after) == (1800.0, 7200.0)
    assert manifest.on_infrastructure_lost == "fail"
    assert manifest.repository is None and manifest.artifacts == []
    assert manifest.sandbox.keep_stopped == 7 * 86400.0  # decision 074


def test_a_task_sandbox_may_be_kept_shorter_longer_or_until_deleted():
    assert load_manifest(minimal(sandbox={"keep_stopped": "1h"})).sandbox.keep_stopped == 3600.0
    assert load_manifest(minimal(sandbox={"keep_stopped": "30d"})).sandbox.keep_stopped == 2592000.0
    assert load_manifest(minimal(sandbox={"keep_stopped": None})).sandbox.keep_stopped is None


def test_a_manifest_recorded_before_keep_stopped_keeps_its_sandbox_until_deleted():
    from sandhold.domain.task_manifest import RecordedManifest

    recorded = msgspec.json.decode(json.dumps(minimal(sandbox={})), type=RecordedManifest)
    assert recorded.sandbox.keep_stopped is None


# --- shapes ----------------------------------------------------------------------------


def test_agent_is_shorthand_for_a_one_step_pipeline_named_agent():
    [step] = load_manifest(minimal()).steps
    assert step.name == "agent" and step.kind == "agent" and step.agent is not None


def test_a_pipeline_keeps_its_steps_in_order_with_their_kinds():
    manifest = load_manifest(
        {
            "name": "p",
            "pipeline": [
                {"name": "build", "agent": AGENT},
                {"name": "each", "agent": AGENT, "for_each": ["a", "b"]},
                {"name": "notify", "http": {"url": "https://example.invalid/hook"}},
            ],
        }
    )
    assert [(s.name, s.kind) for s in manifest.steps] == [
        ("build", "agent"),
        ("each", "agent"),
        ("notify", "http"),
    ]
    notify = manifest.steps[2]
    assert notify.delivery == "at_least_once" and notify.http is not None
    assert notify.http.method == "POST" and notify.http.timeout == 30.0


@pytest.mark.parametrize(
    "url",
    [
        "git://127.0.0.1:9418/project.git",
        "https://github.com/example/project.git",
        "http://localhost/x.git",
        "ssh://git@example.com/project.git",
        "git@github.com:example/project.git",
    ],
)
def test_repository_urls_git_understands_are_accepted(url: str):
    manifest = load_manifest(minimal(repository={"url": url}))
    assert manifest.repository is not None
    assert manifest.repository.url == url and manifest.repository.ref == "main"


# --- refusals: each names its field ------------------------------------------------------


REFUSED = {
    "unknown top-level field": (minimal(bogus=1), "`bogus`"),
    "unknown nested field": (minimal(timeouts={"clonee": "1s"}), "`clonee`"),
    "bad duration": (minimal(timeouts={"clone": "10 minutes"}), "`clone`"),
    "zero duration": (minimal(timeouts={"task": 0}), "`task`"),
    "agent and pipeline": (
        minimal(pipeline=[{"name": "a", "agent": AGENT}]),
        "`pipeline`",
    ),
    "neither agent nor pipeline": ({"name": "x"}, "`agent`"),
    "no name": ({"agent": AGENT}, "`name`"),
    "bad name": (minimal(name="Has Spaces"), "$.name"),
    "bad url": (minimal(repository={"url": "not a url"}), "$.repository.url"),
    "file url": (minimal(repository={"url": "file:///etc"}), "$.repository.url"),
    "a path as url": (minimal(repository={"url": "/srv/git/project.git"}), "$.repository.url"),
    "bad ref": (minimal(repository={"url": "git://h/p.git", "ref": "a b"}), "$.repository.ref"),
    "a ref like an option": (
        minimal(repository={"url": "git://h/p.git", "ref": "-x"}),
        "$.repository.ref",
    ),
    "a url like an option": (
        minimal(repository={"url": "-oProxyCommand=x@h:p"}),
        "$.repository.url",
    ),
    "cancel_after equal to warn_after": (
        minimal(hang={"warn_after": "10s", "cancel_after": "10s"}),
        "`cancel_after`",
    ),
    "cancel_after before the default warn_after": (
        minimal(hang={"cancel_after": "10s"}),
        "`cancel_after`",
    ),
    "empty command": (minimal(agent={"command": []}), "$.agent.command"),
    "not a string in the command": (minimal(agent={"command": ["echo", 1]}), "$.agent.command"),
    "bad env name": (minimal(environment={"1BAD": "x"}), "$.environment"),
    "too many network retries": (minimal(retry={"network": 11}), "$.retry.network"),
    "a step with both kinds": (
        {
            "name": "x",
            "pipeline": [{"name": "s", "agent": AGENT, "http": {"url": "http://h/"}}],
        },
        "$.pipeline[0]",
    ),
    "a step with neither kind": ({"name": "x", "pipeline": [{"name": "s"}]}, "`agent`"),
    "duplicate step names": (
        {"name": "x", "pipeline": [{"name": "s", "agent": AGENT}, {"name": "s", "agent": AGENT}]},
        "step names must be unique",
    ),
    "delivery on an agent step": (
        {"name": "x", "pipeline": [{"name": "s", "agent": AGENT, "delivery": "at_most_once"}]},
        "`delivery`",
    ),
    "bad delivery": (
        {
            "name": "x",
            "pipeline": [{"name": "s", "http": {"url": "http://h/"}, "delivery": "exactly_once"}],
        },
        "$.pipeline[0].delivery",
    ),
    "empty for_each": (
        {"name": "x", "pipeline": [{"name": "s", "agent": AGENT, "for_each": []}]},
        "$.pipeline[0].for_each",
    ),
    "http url not http": (
        {"name": "x", "pipeline": [{"name": "s", "http": {"url": "ftp://h/"}}]},
        "$.pipeline[0].http.url",
    ),
    "bad http method": (
        {"name": "x", "pipeline": [{"name": "s", "http": {"url": "http://h/", "method": "GO"}}]},
        "$.pipeline[0].http.method",
    ),
    "absolute artifact glob": (minimal(artifacts=["/etc/*"]), "$.artifacts[0]"),
    "repository and snapshot": (
        minimal(
            repository={"url": "git://h/p.git"},
            sandbox={"from_snapshot": "sv-0123456789abcdef"},
        ),
        "`sandbox.from_snapshot`",
    ),
    "keep_stopped past 30 days": (minimal(sandbox={"keep_stopped": "40d"}), "`keep_stopped`"),
    "keep_stopped of 0": (minimal(sandbox={"keep_stopped": 0}), "`keep_stopped`"),
    "keep_stopped under an hour": (minimal(sandbox={"keep_stopped": "10m"}), "at least 1h"),
    "keep_stopped within the retry delay": (
        minimal(sandbox={"keep_stopped": "2h"}, retry={"max_delay": "3h"}),
        "`sandbox.keep_stopped` must be longer than `retry.max_delay`",
    ),
    "keep_stopped not a duration": (minimal(sandbox={"keep_stopped": "a week"}), "`keep_stopped`"),
    "bad on_infrastructure_lost": (
        minimal(on_infrastructure_lost="ignore"),
        "$.on_infrastructure_lost",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_refused_manifest_names_its_field(case: str):
    data, names_the_field = REFUSED[case]
    with pytest.raises(ManifestError) as caught:
        load_manifest(data)
    assert names_the_field in str(caught.value)
    assert str(caught.value).startswith("invalid task manifest: ")


def test_yaml_and_json_give_the_same_manifest():
    as_json = json.dumps(minimal(timeouts={"clone": "1m"}))
    as_yaml = "name: demo\nagent:\n  command: [sh, -c, echo hi]\ntimeouts:\n  clone: 1m\n"
    assert parse_manifest(as_json) == parse_manifest(as_yaml) == load_manifest(json.loads(as_json))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{{{: [\n", "not valid YAML or JSON"),
        ("- a\n- b\n", "expected a mapping at the top level"),
        ("", "expected a mapping at the top level"),
        ("just a string", "expected a mapping at the top level"),
        ("name: x\nagent: {command: [true]}\n", "$.agent.command[0]"),  # YAML's true is a bool
    ],
)
def test_text_that_is_no_manifest_is_refused_clearly(text: str, message: str):
    with pytest.raises(ManifestError) as caught:
        parse_manifest(text)
    assert message in str(caught.value)


@pytest.mark.parametrize("name", ["task.yaml", "pipeline.yaml"])
def test_the_examples_are_valid_manifests(name: str):
    manifest = parse_manifest((ROOT / "examples" / name).read_text())
    assert manifest.repository is not None
    assert manifest.steps


def test_the_pipeline_example_has_a_loop_and_a_tool_step():
    manifest = parse_manifest(Path(ROOT / "examples" / "pipeline.yaml").read_text())
    kinds = {step.kind for step in manifest.steps}
    assert kinds == {"agent", "http"}
    assert any(step.for_each for step in manifest.steps)
