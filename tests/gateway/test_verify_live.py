"""`replay --verify` on an aggregate that moves on while it is being verified."""

from __future__ import annotations

import pytest

from sandhold.cli import audit
from tests.gateway.conftest import Gw, nats_client, running_sandbox
from tests.support.waiting import wait_until


async def test_verify_of_a_sandbox_that_moved_on_is_not_a_difference(
    gw: Gw, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    async with gw.http("default") as http:
        sandbox_id = await running_sandbox(http)
    async with nats_client(gw, "default") as client:
        records = await client.sandbox_records(sandbox_id)
        end = records[-1].seq
        await wait_until(lambda: gw.position() >= end, timeout=30, what="the read model")

        # The race, made certain: the log is read before its last event landed,
        # the read model is looked at after it was applied.
        real = audit._records
        calls = 0

        async def read_then_event_lands(*args):
            nonlocal calls
            calls += 1
            found = await real(*args)
            return found[:-1] if calls == 1 else found

        monkeypatch.setattr(audit, "_records", read_then_event_lands)
        code = await audit.verify_read_model(client, "sandbox", sandbox_id, gw.read_model)
    out = capsys.readouterr().out
    assert code == 0, out
    assert "matches the log" in out
