"""The metrics service starts from its checkpoint (decision 062): on a real
server, a restart folds only the events after it and ends with the numbers of
a fold from zero, histograms included; a checkpoint it cannot trust is not
believed."""

from __future__ import annotations

from pathlib import Path

import nats
import pytest
from sandhold.bus import checkpoint
from sandhold.bus.names import Names
from sandhold.domain import events as ev
from sandhold.metrics.service import MetricsService, follow_log
from sandhold.telemetry.log_metrics import BOUNDS, LogMetrics

from tests.twins.support import append, running_sandbox

HOST = "h1"


def _captured(save_id: str, freeze_ms: float) -> list[ev.AnyEvent]:
    return [
        ev.SaveRequested(save_id=save_id, kind="scheduled", host=HOST, generation=1),
        ev.SaveCaptured(
            save_id=save_id, host=HOST, generation=1, freeze_ms=freeze_ms, freeze_method="cgroup"
        ),
    ]


async def _folded(nc: nats.NATS, names: Names, folded: LogMetrics) -> list[int]:
    """Fold what the log holds into `folded`; the sequences it was handed."""
    handed: list[int] = []
    apply = folded.apply

    def counting(seq: int, envelope) -> None:
        handed.append(seq)
        apply(seq, envelope)

    folded.apply = counting  # type: ignore[method-assign]
    follower = await follow_log(nc.jetstream(), names, folded)
    await follower.stop()
    folded.apply = apply  # type: ignore[method-assign]
    return handed


@pytest.fixture
def kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(checkpoint.ENV, str(tmp_path))  # as `--checkpoint-dir` sets it
    return tmp_path


async def test_a_restart_folds_only_what_came_after_its_checkpoint(
    nc: nats.NATS, nats_url: str, names: Names, kept: Path
):
    sandbox_id = await running_sandbox(nc, names, "measured", HOST)
    await append(nc, names, "sandbox", sandbox_id, _captured("sv-1", 20.0))
    first = MetricsService(nats_url, names)
    await _folded(nc, names, first.folded)
    assert await first.checkpoint() > 0 and (kept / "metrics.checkpoint").exists()
    before = first.folded.position

    await append(nc, names, "sandbox", sandbox_id, _captured("sv-2", 70.0))
    again = MetricsService(nats_url, names)
    await again._load(nc.jetstream(), kept / "metrics.checkpoint")
    assert again.from_checkpoint == before
    handed = await _folded(nc, names, again.folded)
    assert handed and min(handed) > before, "only the events after the checkpoint"

    whole = LogMetrics()
    await _folded(nc, names, whole)
    assert again.folded.counters == whole.counters
    assert {n: again.folded.histogram_series(n) for n in BOUNDS} == {
        n: whole.histogram_series(n) for n in BOUNDS
    }
    [(_, freezes, total)] = whole.histogram_series("sandhold_save_freeze_seconds")
    assert freezes[-1] == 2 and total == pytest.approx(0.09), "both freezes, in one series"


async def test_a_checkpoint_of_another_log_or_garbage_is_not_believed(
    nc: nats.NATS, nats_url: str, names: Names, kept: Path
):
    sandbox_id = await running_sandbox(nc, names, "elsewhere", HOST)
    first = MetricsService(nats_url, names)
    await _folded(nc, names, first.folded)
    await first.checkpoint()
    other = Names(names.prefix + "x")  # the same file, read against another stream
    mistaken = MetricsService(nats_url, other)
    await mistaken._load(nc.jetstream(), kept / "metrics.checkpoint")
    assert mistaken.from_checkpoint == 0 and mistaken.folded.position == 0

    (kept / "metrics.checkpoint").write_bytes(b"not a checkpoint")
    garbled = MetricsService(nats_url, names)
    await garbled._load(nc.jetstream(), kept / "metrics.checkpoint")
    assert garbled.from_checkpoint == 0 and garbled.folded.position == 0
    assert sandbox_id not in garbled.folded.sandboxes
