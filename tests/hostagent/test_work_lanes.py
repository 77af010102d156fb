"""The host-agent's work queue runs in lanes, one per sandbox (the lane
mechanics on a real server: tests/bus/test_lanes.py)."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
from sandhold.domain import work as wk
from sandhold.hostagent.service import _work_lane


def _msg(data: bytes) -> SimpleNamespace:
    return SimpleNamespace(data=data)


def test_work_is_laned_by_its_sandbox_and_what_does_not_decode_shares_one_lane() -> None:
    run = wk.RunCommandWork(sandbox_id="sb-1", generation=3, command_id="c-1", argv=["true"])
    stop = wk.StopSandboxWork(sandbox_id="sb-2", generation=1)
    encode = msgspec.json.Encoder().encode
    assert _work_lane(_msg(encode(run))) == "sb-1"  # type: ignore[arg-type]
    assert _work_lane(_msg(encode(stop))) == "sb-2"  # type: ignore[arg-type]
    assert _work_lane(_msg(b"not json")) == ""  # type: ignore[arg-type]
    assert _work_lane(_msg(b'{"sandbox_id": 7}')) == ""  # type: ignore[arg-type]
