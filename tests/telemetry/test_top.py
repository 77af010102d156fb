"""`sandhold top` shows the numbers folded from the log, through the CLI."""

from __future__ import annotations

import json

import pytest
from sandhold.bus import checkpoint
from sandhold.client import connect
from sandhold.metrics.service import MetricsService, follow_log

from tests.e2e.harness import Up


async def test_top_shows_what_the_log_holds(plain_up: Up, monkeypatch: pytest.MonkeyPatch) -> None:
    client = await connect(plain_up.url)
    try:
        sandbox = await client.create_sandbox()
        await client.wait_for_phase(sandbox.id, {"running"}, timeout=30)
        before = json.loads(plain_up.cli("top", "--once", "--json").stdout)
        ended = await client.exec(sandbox.id, ["sh", "-c", "exit 3"])
        assert ended.command.state == "exited"
        timed_out = await client.exec(sandbox.id, ["sleep", "10"], timeout_s=0.3)
        assert timed_out.command.state == "timed_out"
        # A metrics service's checkpoint where `sandhold up` keeps them, folded
        # up to here: `top` starts from it (a long log is not folded from zero).
        probe = plain_up.data_dir / "checkpoints" / "zz-probe"
        probe.mkdir(parents=True)
        monkeypatch.setenv(checkpoint.ENV, str(probe))
        kept = MetricsService(plain_up.url, client.names)
        follower = await follow_log(client.js, client.names, kept.folded)
        await follower.stop()
        assert await kept.checkpoint() > 0
    finally:
        await client.close()
    done = plain_up.cli("top", "--once", "--json")
    assert done.returncode == 0, done.stderr
    after = json.loads(done.stdout)
    commands_before = before["commands"]
    assert after["commands"]["exited"] == commands_before.get("exited", 0) + 1
    assert after["commands"]["timed_out"] == commands_before.get("timed_out", 0) + 1
    assert after["sandboxes"]["running"] >= 1
    assert after["hosts"]["registered"] == 1
    assert after["log"]["position"] > before["log"]["position"]
    assert after["log"]["folded_from"] == kept.folded.position > before["log"]["position"]
    (probe / "metrics.checkpoint").unlink()
    from_zero = json.loads(plain_up.cli("top", "--once", "--json").stdout)
    assert from_zero["log"]["folded_from"] == 0
    for group in ("commands", "sandboxes", "hosts", "tasks"):
        assert from_zero[group] == after[group], group
    assert after["saves"]["max_lag_s"] is not None
    # The terminal form, once.
    text = plain_up.cli("top", "--once")
    assert text.returncode == 0, text.stderr
    assert text.stdout.startswith("sandhold top")
    assert "COMMANDS" in text.stdout and "timed_out" in text.stdout
