"""The quick exec's exchange on a real nats-server: whatever order the answers,
the end and the output arrive in, each is found where it is looked for
(decision 058). The messages are published on the exchange's own connection,
in the order each test chooses, after its subscriptions (one connection's
operations are handled in order)."""

from __future__ import annotations

import time

import pytest
from sandhold.bus.codec import FENCE_HEADER, OFFSET_HEADER, STREAM_HEADER, encode_envelope
from sandhold.domain import events as ev
from sandhold.domain.envelope import wrap

from sandhold.cli.quick_exec import Exchange, HandOver, Printed, Wire, _login


def _ended(command_id: str) -> bytes:
    event = ev.CommandEnded(command_id=command_id, state="exited", exit_code=0)
    (envelope,) = wrap(
        [event], aggregate_id="sb-1", id_base="t", actor="test", causation_id="t",
        correlation_id="t", time=12.5,
    )  # fmt: skip
    return encode_envelope(envelope)


def _exchange(nats_url: str) -> tuple[Wire, Exchange, Printed]:
    wire = Wire(nats_url, *_login(nats_url, None))
    wire.subscribe("q.*")
    events = wire.subscribe("q.ev")
    wire.subscribe("q.out.*")
    printed = Printed()
    return wire, Exchange(wire, events, "cmd-1", printed, as_json=True), printed


def _soon() -> float:
    return time.monotonic() + 10


def test_answers_the_end_and_output_are_found_in_any_order(nats_url: str):
    wire, exchange, printed = _exchange(nats_url)
    try:
        wire.publish("q.ev", _ended("cmd-other"), headers={FENCE_HEADER: "1"})
        wire.publish("q.ev", _ended("cmd-1"), headers={FENCE_HEADER: "2"})
        wire.publish("q.reply", b"R")  # the scheduler's answer before the ack
        wire.publish("q.ack", b"A")
        for offset, data in ((0, b"he"), (2, b"llo")):
            headers = {STREAM_HEADER: "stdout", OFFSET_HEADER: str(offset)}
            wire.publish("q.out.stdout", data, headers=headers)
        assert exchange.answer("q.ack", _soon()) == b"A"
        assert exchange.answer("q.reply", _soon()) == b"R", "kept while the ack was awaited"
        at, end = exchange.ended(_soon())
        assert (at, end.command_id, end.exit_code) == (12.5, "cmd-1", 0), "not another's end"
        assert exchange.output_settled({"stdout": 5}, _soon()), "chunks after the end, waited for"
        assert bytes(printed.kept["stdout"]) == b"hello"
    finally:
        wire.close()


def test_an_event_without_the_fence_is_no_end(nats_url: str):
    wire, exchange, _ = _exchange(nats_url)
    try:
        wire.publish("q.ev", _ended("cmd-1"), headers={"Sh-Type": "command.ended"})
        with pytest.raises(HandOver):
            exchange.ended(time.monotonic() + 0.5)
    finally:
        wire.close()


def test_output_that_never_comes_is_the_full_clients_to_read(nats_url: str):
    wire, exchange, _ = _exchange(nats_url)
    try:
        assert not exchange.output_settled({"stdout": 3}, time.monotonic() + 0.3)
    finally:
        wire.close()
