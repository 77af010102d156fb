"""`sandhold sandbox show` without --json: the status block, from a view."""

from __future__ import annotations

import re

from sandhold.domain.saves import SaveHealth
from sandhold.domain.views import SandboxView, SaveView

from sandhold.cli.status import status_block

NOW = 1_800_000_000.0


def _save(**fields: object) -> SaveView:
    base = dict(id="sv-00000000000000a1", kind="scheduled", state="completed",
                sandbox_id="sb-1", requested_at=NOW - 130, completed_at=NOW - 125,
                bytes=3 * 1024 * 1024, files=12)  # fmt: skip
    return SaveView(**{**base, **fields})  # type: ignore[arg-type]


def test_the_block_says_what_a_user_asks_first() -> None:
    view = SandboxView(
        id="sb-1", tenant="acme", phase="running", host="h1", generation=2, created_at=NOW - 900,
        memory_limit_bytes=512 * 1024 * 1024, disk_limit_bytes=2048 * 1024 * 1024,
        isolation={"driver": "namespaces", "user": "mapped", "network": "none", "seccomp": True,
                   "base": "host"},
        commands={"exited": 3, "running": 1},
        last_completed_save=_save(), save_health=SaveHealth(state="ok"), rpo_s=125.0,
        recoverable_from="save sv-00000000000000a1",
        snapshots=[_save(id="sv-00000000000000b2", kind="snapshot", name="before-migration")],
        storage={"kind": "jetstream", "replicas": 1},
    )  # fmt: skip
    lines = _rows(status_block(view, now=NOW))
    assert lines["phase"] == "running"
    assert lines["host"] == "h1  generation 2"
    assert lines["isolation"] == "namespaces, user mapped, network none, seccomp, base host"
    assert lines["limits"] == "memory 512 MiB, pids host default, cpus -, disk 2048 MiB"
    assert lines["last save"].startswith("sv-00000000000000a1 scheduled completed, 2m ago")
    assert lines["save health"] == "ok"
    assert lines["rpo"] == "2m of work at risk"
    assert lines["snapshots"] == "before-migration (completed)"
    assert lines["storage"] == "kind jetstream, replicas 1"
    assert lines["commands"] == "3 exited, 1 running"


def test_a_sandbox_unchanged_since_its_save_has_nothing_at_risk() -> None:
    view = SandboxView(
        id="sb-3", tenant="t", phase="running", host="h1", generation=1, created_at=NOW - 900,
        last_completed_save=_save(), save_health=SaveHealth(state="ok"), rpo_s=0.0,
        unchanged_since_save="sv-00000000000000a1",
    )  # fmt: skip
    lines = _rows(status_block(view, now=NOW))
    assert lines["rpo"] == "nothing at risk: unchanged since sv-00000000000000a1"


def test_an_unisolated_sandbox_says_so() -> None:
    view = SandboxView(
        id="sb-2", tenant="t", phase="running", host="h1", generation=1, created_at=NOW,
        isolation={"driver": "process", "unisolated": True, "network": "none"},
    )  # fmt: skip
    lines = _rows(status_block(view, now=NOW))
    assert lines["isolation"].startswith("UNISOLATED")
    assert (lines["commands"], lines["last save"]) == ("none", "none")


def test_a_sandbox_kept_stopped_says_when_it_is_deleted() -> None:
    view = SandboxView(
        id="sb-4", tenant="t", phase="stopped", host="h1", generation=1, created_at=NOW - 900,
        keep_stopped_s=7 * 86400.0, deletes_at=NOW + 2 * 86400,
    )  # fmt: skip
    lines = _rows(status_block(view, now=NOW))
    assert lines["kept stopped"] == "7.0d, then deleted (its Snapshots stay); deleted in 2.0d"
    running = SandboxView(
        id="sb-5", tenant="t", phase="running", host="h1", generation=1, created_at=NOW,
        keep_stopped_s=3600.0,
    )  # fmt: skip
    assert _rows(status_block(running, now=NOW))["kept stopped"] == (
        "60m, then deleted (its Snapshots stay)"
    )
    late = SandboxView(
        id="sb-7", tenant="t", phase="stopped", host="h1", generation=1, created_at=NOW,
        keep_stopped_s=3600.0, deletes_at=NOW - 3,
    )  # fmt: skip
    assert _rows(status_block(late, now=NOW))["kept stopped"].endswith("; deletion due now")
    assert "kept stopped" not in _rows(status_block(SandboxView(
        id="sb-6", tenant="t", phase="stopped", host=None, generation=0, created_at=NOW,
    ), now=NOW))  # fmt: skip


def _rows(block: str) -> dict[str, str]:
    """label -> value: labels are padded to one width, then two spaces."""
    return dict(re.match(r"^(.+?)\s{2,}(.*)$", line).groups() for line in block.splitlines())
