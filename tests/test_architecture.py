"""The rooms of the code and what each may import (docs/architecture.md).

A pure domain (no IO, no clock, no randomness), libraries on top of it, and
services that never import one another: the CLI alone puts everything
together. Read from the source's import statements, so a change that breaks
a rule fails here, before it is a habit.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LIBS = ["domain", "telemetry", "bus", "saves", "client"]
SERVICES = {
    "scheduler": "scheduler",
    "host-agent": "hostagent",
    "saver": "saver",
    "recovery": "recovery",
    "orchestrator": "orchestrator",
    "gateway": "gateway",
    "metrics": "metrics",
}
ALLOWED = {
    "domain": {"domain"},
    "telemetry": {"domain", "telemetry"},
    "bus": {"domain", "telemetry", "bus"},
    "saves": {"domain", "telemetry", "bus", "saves"},
    "client": {"domain", "telemetry", "bus", "client"},
}
# What would let the domain reach the world or depend on when it runs.
NOT_IN_DOMAIN = {
    "asyncio", "time", "random", "os", "socket", "subprocess", "threading", "pathlib",
    "uuid", "nats", "aiosqlite", "sqlite3", "urllib", "http", "shutil", "logging",
}  # fmt: skip


def _package_dir(room: str) -> Path:
    if room in LIBS:
        return ROOT / "libs" / room / "src" / "sandhold" / room
    directory = next(d for d, package in SERVICES.items() if package == room)
    return ROOT / "services" / directory / "src" / "sandhold" / room


def _imports(directory: Path) -> list[tuple[Path, str]]:
    found = []
    for path in sorted(directory.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found += [(path, alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.append((path, node.module))
    return found


def _rooms_used(directory: Path) -> dict[str, list[str]]:
    used: dict[str, list[str]] = {}
    for path, module in _imports(directory):
        parts = module.split(".")
        if parts[0] == "sandhold" and len(parts) > 1:
            used.setdefault(parts[1], []).append(str(path.relative_to(ROOT)))
    return used


@pytest.mark.parametrize("room", LIBS)
def test_a_library_imports_only_the_libraries_below_it(room: str) -> None:
    used = _rooms_used(_package_dir(room))
    wrong = {other: files for other, files in used.items() if other not in ALLOWED[room]}
    assert not wrong, f"sandhold.{room} must not import {wrong}"


def test_the_domain_does_no_io_and_reads_no_clock() -> None:
    wrong = [
        (str(path.relative_to(ROOT)), module)
        for path, module in _imports(_package_dir("domain"))
        if module.split(".")[0] in NOT_IN_DOMAIN
    ]
    assert not wrong, f"the domain must stay pure: {wrong}"


@pytest.mark.parametrize("room", sorted(SERVICES.values()))
def test_a_service_imports_libraries_never_another_service(room: str) -> None:
    used = _rooms_used(_package_dir(room))
    wrong = {other: files for other, files in used.items() if other not in {*LIBS, room}}
    assert not wrong, f"sandhold.{room} must not import {wrong}"


def test_every_package_is_in_a_room() -> None:
    packages = {p.name for p in ROOT.glob("libs/*/src/sandhold/*") if p.is_dir()}
    packages |= {p.name for p in ROOT.glob("services/*/src/sandhold/*") if p.is_dir()}
    assert packages == {*LIBS, *SERVICES.values()}
