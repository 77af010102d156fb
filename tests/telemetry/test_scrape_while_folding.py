"""Prometheus scrapes `/metrics` from its own thread while the event loop folds
the log: reading the fold there must never fail on a dict that changes."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator

import pytest
from sandhold.domain import events as ev
from sandhold.telemetry.log_metrics import CATALOG, LogMetrics

from tests.telemetry.test_log_metrics import MANIFEST, Log


@pytest.fixture
def switch_often() -> Iterator[None]:
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # what a busy metrics service does, only more often
    yield
    sys.setswitchinterval(before)


def test_scraping_while_folding_never_sees_a_dict_change_size(switch_often: None):
    log = Log()
    for i in range(4000):
        tid = f"tk-{i:016x}"
        log.add(
            tid,
            float(i),
            ev.TaskSubmitted(task_id=tid, request_key=tid, request_digest="d", manifest=MANIFEST),
        )
        if i % 2:
            log.add(tid, float(i) + 0.5, ev.TaskCompleted())
    folded = LogMetrics()
    failures: list[BaseException] = []
    done = threading.Event()

    def scrape() -> None:  # what the exporter's callbacks read
        while not done.is_set():
            try:
                folded.gauges(0.0)
                for metric in CATALOG:
                    if metric.kind == "counter":
                        folded.counter_series(metric.name)
                    elif metric.kind == "histogram":
                        folded.histogram_series(metric.name)
            except RuntimeError as err:
                failures.append(err)
                return

    scraper = threading.Thread(target=scrape)
    scraper.start()
    try:
        for seq, envelope in enumerate(log.envelopes, start=1):
            folded.apply(seq, envelope)
    finally:
        done.set()
        scraper.join()
    assert not failures, failures
    assert folded.total("tasks_completed_total") == 2000
    [(_, buckets, _)] = folded.histogram_series("task_duration_seconds")
    assert buckets[-1] == 2000
