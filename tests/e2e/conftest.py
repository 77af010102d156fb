from __future__ import annotations

from collections.abc import Iterator

import pytest
from sandhold.client import Client

from tests.e2e.harness import Up


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory, topology: tuple[str, ...]) -> Iterator[Up]:
    """One `sandhold up` for a module's tests (each test makes its own sandboxes)."""
    running = Up(tmp_path_factory.mktemp("up") / "data", *topology).start()
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture
def own_up(tmp_path, topology: tuple[str, ...]) -> Iterator[Up]:
    """A `sandhold up` of this test alone, for tests that kill or pause parts of it."""
    running = Up(tmp_path / "data", *topology).start()
    try:
        yield running
    finally:
        running.stop()


async def running_sandbox(client: Client, **kwargs) -> str:
    view = await client.create_sandbox(**kwargs)
    await client.wait_for_phase(view.id, {"running"}, timeout=30)
    return view.id
