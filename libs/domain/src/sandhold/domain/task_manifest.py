"""A task manifest: what a user submits (YAML or JSON), validated strictly.

Two layers of the same shape. The `Recorded…` structs are the manifest as
`task.submitted` keeps it: no value constraints, unknown fields ignored, so a
log stays readable after the rules for *new* manifests tighten or a newer
writer adds a field (events never become undecodable). Their strict
subclasses (`TaskManifest`, `Step`, …) are what a request is decoded into:
unknown fields are refused and every error names the field it is about
(msgspec reports the path, e.g. ``at `$.timeouts```, and our own checks name
the key inside it). Durations are seconds or strings like ``"90s"``,
``"10m"``, ``"2h"``, ``"1h30m"``; they are normalised to seconds on decode, so
a recorded manifest holds plain numbers.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar, Literal

import msgspec
from sandhold.domain.requests import Argv, MemoryLimit, SaveId, SecretName

DurationInput = float | str

_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_MAX_DURATION = 30 * 86400.0
# A task's sandbox, once stopped, is kept this long by default (decision 074),
# and at least an hour: the task's own stop and retries must still find it.
DEFAULT_KEEP_STOPPED_S = 7 * 86400.0
MIN_KEEP_STOPPED_S = 3600.0
# Python's `\s` spelt out: the schema's ECMAScript `\s` is a different set (it
# leaves out \x1c-\x1f and \x85), and the document must allow exactly what we do.
_SPACE = r"\t\n\v\f\r\x1c-\x20\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"


def parse_duration(value: DurationInput, field: str, *, check_range: bool = True) -> float:
    """Seconds from a number or a string like "1h30m"; raises ValueError naming `field`."""
    if isinstance(value, bool):
        raise ValueError(f"`{field}`: expected seconds or a duration like '30m', got {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        text = value.strip()
        parts = _DURATION_PART.findall(text)
        if not parts or "".join(n + u for n, u in parts) != text:
            raise ValueError(
                f"`{field}`: expected seconds or a duration like '90s', '10m', '2h', "
                f"'1h30m', got {value!r}"
            )
        seconds = sum(float(n) * _UNIT[u] for n, u in parts)
    if check_range and not 0 < seconds <= _MAX_DURATION:
        raise ValueError(f"`{field}`: must be more than 0 and at most 30 days, got {value!r}")
    return seconds


class _Recorded(msgspec.Struct, frozen=True, kw_only=True):
    """Base of every manifest part as recorded: lenient, durations as seconds."""

    _durations: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        for name in self._durations:
            value = getattr(self, name)
            if isinstance(value, str):  # recorded manifests hold numbers already
                with contextlib.suppress(ValueError):
                    seconds = parse_duration(value, name, check_range=False)
                    msgspec.structs.force_setattr(self, name, seconds)


def _strict_durations(part: _Recorded) -> None:
    """What a new manifest must meet on top of its shape: durations in range."""
    for name in part._durations:
        value = getattr(part, name)
        if value is not None:
            msgspec.structs.force_setattr(part, name, parse_duration(value, name))


# --- as recorded -----------------------------------------------------------------


class RecordedRepository(_Recorded, frozen=True):
    url: str
    ref: str = "main"


class RecordedSandboxSpec(_Recorded, frozen=True):
    memory_limit_bytes: int | None = None
    from_snapshot: str | None = None
    # Recorded before it existed: None, the sandbox kept until deleted.
    keep_stopped: DurationInput | None = None
    _durations = ("keep_stopped",)


class RecordedAgentCommand(_Recorded, frozen=True):
    command: list[str]
    cwd: str | None = None
    env: dict[str, str] = {}
    timeout: DurationInput | None = None
    _durations = ("timeout",)


class RecordedHttpCall(_Recorded, frozen=True):
    url: str
    method: str = "POST"
    headers: dict[str, str] = {}
    body: str | None = None
    timeout: DurationInput = 30.0
    _durations = ("timeout",)


class RecordedStep(_Recorded, frozen=True):
    name: str
    agent: RecordedAgentCommand | None = None
    http: RecordedHttpCall | None = None
    delivery: str = "at_least_once"
    for_each: list[str] | None = None

    @property
    def kind(self) -> Literal["agent", "http"]:
        return "agent" if self.agent is not None else "http"


class RecordedTimeouts(_Recorded, frozen=True):
    clone: DurationInput = 600.0
    stage: DurationInput = 900.0
    running: DurationInput | None = None
    task: DurationInput = 86400.0
    _durations = ("clone", "stage", "running", "task")


class RecordedRetryPolicy(_Recorded, frozen=True):
    network: int = 3
    placement: int = 2
    base_delay: DurationInput = 1.0
    max_delay: DurationInput = 60.0
    _durations = ("base_delay", "max_delay")


class RecordedHangPolicy(_Recorded, frozen=True):
    warn_after: DurationInput = 1800.0
    cancel_after: DurationInput = 7200.0
    _durations = ("warn_after", "cancel_after")


class RecordedManifest(_Recorded, frozen=True):
    name: str
    agent: RecordedAgentCommand | None = None
    # A Sequence (read-only; decoded as a list): TaskManifest narrows it to its strict Step.
    pipeline: Sequence[RecordedStep] = []
    repository: RecordedRepository | None = None
    sandbox: RecordedSandboxSpec = RecordedSandboxSpec()
    environment: dict[str, str] = {}
    secrets: Sequence[str] = []  # names; the values come with the submit request
    timeouts: RecordedTimeouts = RecordedTimeouts()
    retry: RecordedRetryPolicy = RecordedRetryPolicy()
    hang: RecordedHangPolicy = RecordedHangPolicy()
    artifacts: list[str] = []
    on_infrastructure_lost: str = "fail"

    @property
    def steps(self) -> Sequence[RecordedStep]:
        if self.agent is not None:
            return [RecordedStep(name="agent", agent=self.agent)]
        return self.pipeline


# --- as requested: the same shape, strictly ------------------------------------------

Name = Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[a-z0-9][a-z0-9_-]*$")]
# Neither a URL nor a ref may start with "-": git would read it as an option.
RepositoryUrl = Annotated[
    str,
    msgspec.Meta(
        min_length=1,
        max_length=2048,
        pattern=rf"^(git|https?|ssh)://[^{_SPACE}]+$|^[^{_SPACE}:-][^{_SPACE}:]*@[^{_SPACE}]+:",
    ),
]
GitRef = Annotated[
    str, msgspec.Meta(min_length=1, max_length=255, pattern=r"^[A-Za-z0-9._/@+][A-Za-z0-9._/@+-]*$")
]
Glob = Annotated[str, msgspec.Meta(min_length=1, max_length=512, pattern=r"^[^/\x00][^\x00]*$")]
Retries = Annotated[int, msgspec.Meta(ge=0, le=10)]
Env = dict[Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")], str]


class Repository(RecordedRepository, frozen=True, forbid_unknown_fields=True):
    # git://, http(s)://, ssh:// or user@host:path. Not file:// or a path: a
    # manifest must not read repositories on the orchestrator's own disk.
    url: RepositoryUrl
    ref: GitRef = "main"


class SandboxSpec(RecordedSandboxSpec, frozen=True, forbid_unknown_fields=True):
    memory_limit_bytes: MemoryLimit | None = None
    from_snapshot: SaveId | None = None  # start from a Snapshot instead of a clone
    # How long the task's sandbox is kept once stopped (its files inspectable),
    # then deleted; its Snapshots, so the artifacts, stay (decision 074).
    # null: kept until someone deletes it.
    keep_stopped: DurationInput | None = DEFAULT_KEEP_STOPPED_S

    def __post_init__(self) -> None:
        _strict_durations(self)
        if self.keep_stopped is not None and float(self.keep_stopped) < MIN_KEEP_STOPPED_S:
            raise ValueError(
                "`keep_stopped`: at least 1h (the task's own stop and retries use its "
                f"sandbox), got {self.keep_stopped!r}"
            )


class AgentCommand(RecordedAgentCommand, frozen=True, forbid_unknown_fields=True):
    """A command in the task's sandbox: the agent is any program of the user's."""

    command: Argv
    env: Env = {}
    timeout: DurationInput | None = None  # the operation limit for this command

    def __post_init__(self) -> None:
        _strict_durations(self)


class HttpCall(RecordedHttpCall, frozen=True, forbid_unknown_fields=True):
    """A tool step the orchestrator performs itself: one HTTP request."""

    url: Annotated[str, msgspec.Meta(pattern=rf"^https?://[^{_SPACE}]+$", max_length=2048)]
    method: Literal["GET", "POST", "PUT", "PATCH", "DELETE"] = "POST"

    def __post_init__(self) -> None:
        _strict_durations(self)


class Step(RecordedStep, frozen=True, forbid_unknown_fields=True):
    """One pipeline step: exactly one of `agent` (a command in the sandbox) or
    `http` (a tool step). `for_each` runs it once per item, one at a time."""

    name: Name
    agent: AgentCommand | None = None
    http: HttpCall | None = None
    delivery: Literal["at_least_once", "at_most_once"] = "at_least_once"
    for_each: Annotated[list[str], msgspec.Meta(min_length=1, max_length=1000)] | None = None

    def __post_init__(self) -> None:
        if (self.agent is None) == (self.http is None):
            raise ValueError(f"step `{self.name}`: give exactly one of `agent` or `http`")
        if self.agent is not None and self.delivery != "at_least_once":
            raise ValueError(
                f"step `{self.name}`: `delivery` is for tool (http) steps; an agent step is "
                "never dispatched twice"
            )


class Timeouts(RecordedTimeouts, frozen=True, forbid_unknown_fields=True):
    def __post_init__(self) -> None:
        _strict_durations(self)


class RetryPolicy(RecordedRetryPolicy, frozen=True, forbid_unknown_fields=True):
    network: Retries = 3  # clone connection refused/reset/timed out, tool step errors
    placement: Retries = 2  # the sandbox could not be placed or started

    def __post_init__(self) -> None:
        _strict_durations(self)


class HangPolicy(RecordedHangPolicy, frozen=True, forbid_unknown_fields=True):
    def __post_init__(self) -> None:
        _strict_durations(self)
        if float(self.cancel_after) <= float(self.warn_after):  # floats once parsed above
            raise ValueError("`cancel_after` must be longer than `warn_after`")


class TaskManifest(RecordedManifest, frozen=True, forbid_unknown_fields=True):
    name: Name
    agent: AgentCommand | None = None  # shorthand for a one-step pipeline named "agent"
    pipeline: Annotated[list[Step], msgspec.Meta(max_length=100)] = []
    repository: Repository | None = None
    sandbox: SandboxSpec = SandboxSpec()
    environment: Env = {}
    # The secrets every agent step's command gets, by name: their values are
    # given with the submit (`task submit --secret NAME=VALUE`), never recorded.
    secrets: Annotated[list[SecretName], msgspec.Meta(max_length=64)] = []
    timeouts: Timeouts = Timeouts()
    retry: RetryPolicy = RetryPolicy()
    hang: HangPolicy = HangPolicy()
    artifacts: Annotated[list[Glob], msgspec.Meta(max_length=100)] = []
    on_infrastructure_lost: Literal["fail", "recover_and_retry"] = "fail"

    def __post_init__(self) -> None:
        if (self.agent is None) == (not self.pipeline):
            raise ValueError("give exactly one of `agent` (one command) or `pipeline` (steps)")
        names = [step.name for step in self.pipeline]
        if len(set(names)) != len(names):
            raise ValueError("`pipeline`: step names must be unique")
        keep = self.sandbox.keep_stopped
        if keep is not None and float(keep) <= float(self.retry.max_delay):
            raise ValueError(
                "`sandbox.keep_stopped` must be longer than `retry.max_delay`: a failed "
                "sandbox is started again by the next attempt"
            )
        if self.repository is not None and self.sandbox.from_snapshot is not None:
            raise ValueError(
                "`repository` and `sandbox.from_snapshot` both name the starting files; give one"
            )
        agents = [self.agent] + [step.agent for step in self.pipeline]
        recorded = set(self.environment).union(*(a.env for a in agents if a is not None))
        both = sorted(set(self.secrets) & (recorded | _STEP_VARIABLES))
        if both:
            raise ValueError(f"`secrets`: {', '.join(both)} also set in an `env` or by sandhold")


# Set in every agent step's environment by sandhold (task_policy.run_request).
_STEP_VARIABLES = frozenset(
    {"SANDHOLD_TASK_ID", "SANDHOLD_STEP", "SANDHOLD_STEP_KEY", "SANDHOLD_ITEM"}
)


class ManifestError(ValueError):
    """A manifest that cannot be accepted; the message names the field."""


def load_manifest(data: Any) -> TaskManifest:
    """A manifest from already-parsed YAML/JSON data; raises ManifestError."""
    try:
        return msgspec.convert(data, TaskManifest)
    except msgspec.ValidationError as err:
        raise ManifestError(f"invalid task manifest: {err}") from None


def parse_manifest(text: str | bytes) -> TaskManifest:
    """Parse YAML (a superset of JSON) and validate it; raises ManifestError."""
    import yaml  # only the edges parse YAML; the domain stays importable without it

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ManifestError(f"invalid task manifest: not valid YAML or JSON: {err}") from None
    if not isinstance(data, dict):
        raise ManifestError("invalid task manifest: expected a mapping at the top level")
    return load_manifest(data)
