"""A consumer's own metrics on a real server: a message whose handler failed is
redelivered and counted, a poison message is a dead letter, and latency is
measured for every message handled."""

from __future__ import annotations

import asyncio
import contextlib
import urllib.request
import uuid
from collections.abc import Iterator

import pytest
from nats.js.api import AckPolicy, ConsumerConfig
from prometheus_client.parser import text_string_to_metric_families
from sandhold.bus.names import Names
from sandhold.bus.reconciler import consume, dead_letter, delivery
from sandhold.telemetry import metrics

from tests.support.waiting import wait_until


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    """This process's /metrics (the instruments stay on for the session)."""
    port = metrics.port or metrics.serve("test", 0, addr="127.0.0.1")
    yield f"http://127.0.0.1:{port}/metrics"


def scrape(url: str, name: str, **labels: str) -> float:
    with urllib.request.urlopen(url, timeout=10) as answer:
        text = answer.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


async def test_redeliveries_dead_letters_and_latency(nc, names: Names, endpoint: str) -> None:
    js = nc.jetstream()
    consumer = f"work-{uuid.uuid4().hex[:6]}"
    await js.publish(names.work("h1"), b"good", stream=names.hostwork_stream)
    await js.publish(names.work("h1"), b"poison", stream=names.hostwork_stream)
    sub = await js.pull_subscribe(
        names.work("h1"),
        durable=consumer,
        stream=names.hostwork_stream,
        config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=30, max_deliver=5),
    )
    deliveries: list[tuple[bytes, int]] = []
    done = asyncio.Event()

    async def handle(msg) -> None:
        deliveries.append((msg.data, delivery(msg)[0]))
        if msg.data == b"poison":
            await dead_letter(msg, consumer)
        elif len([d for d in deliveries if d[0] == b"good"]) == 1:
            raise RuntimeError("the first try fails")
        else:
            await msg.ack()
            done.set()

    consuming = asyncio.create_task(consume(sub, handle, what=consumer))
    try:
        await asyncio.wait_for(done.wait(), 30)
    finally:
        consuming.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await consuming
    assert (b"good", 1) in deliveries and (b"good", 2) in deliveries
    assert [d for d in deliveries if d[0] == b"poison"] == [(b"poison", 1)]

    def counted() -> bool:
        return (
            scrape(endpoint, "sandhold_redeliveries_total", consumer=consumer) == 1
            and scrape(endpoint, "sandhold_dead_letters_total", consumer=consumer) == 1
            and scrape(
                endpoint, "sandhold_messages_handled_total", consumer=consumer, outcome="failed"
            )
            == 1
            and scrape(
                endpoint, "sandhold_messages_handled_total", consumer=consumer, outcome="handled"
            )
            == 2
            and scrape(endpoint, "sandhold_message_latency_seconds_count", consumer=consumer) == 3
        )

    await wait_until(counted, timeout=10, interval=0.1, what="the consumer's counts")
