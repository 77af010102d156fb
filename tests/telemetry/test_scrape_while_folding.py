"""Prometheus scrapes `/metrics` from its own thread while the event loop folds
the log: reading the fold there must never fail on a dict that changes."""

from __future__ import annotations

import gc
import sys
import threading
import time
from collections.abc import Iterator

import pytest
from sandhold.domain import events as ev
from sandhold.telemetry.log_metrics import CATALOG, LogMetrics

from tests.telemetry.test_log_metrics import MANIFEST, Log


@pytest.fixture
def switch_often() -> Iterator[None]:
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # what a busy metrics service does, only more often
    # A garbage collection that runs Python code (a finalizer of some earlier
    # test's leftovers, here a callback) lets the other thread in, even in the
    # middle of a C-level copy of a dict: the way this once failed in CI.
    threshold = gc.get_threshold()

    def collected(_phase: str, _info: dict[str, int]) -> None:
        time.sleep(0)  # (gives up the GIL)

    gc.callbacks.append(collected)
    gc.set_threshold(1)
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(collected)
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
