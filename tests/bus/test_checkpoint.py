"""Checkpoints: a store that starts from one folds only the events after it, and
one the log does not bear out (another stream, other domain code, garbage) is
not believed: the store folds from zero, as without one."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import nats
import pytest
from sandhold.bus import checkpoint
from sandhold.bus.names import Names
from sandhold.bus.store import AggregateStore
from sandhold.bus.streams import ensure_streams
from sandhold.domain import sandbox as sb

from tests.support.bus import not_answering, own_server, waiting_unanswered
from tests.twins.support import running_sandbox


def _store(nc: nats.NATS, names: Names, directory: Path | None) -> AggregateStore[sb.Sandbox]:
    return AggregateStore(
        nc.jetstream(), names, "sandbox", sb.evolve, actor="test", checkpoint_dir=directory
    )


async def _started(
    nc: nats.NATS, names: Names, directory: Path | None, announced: list[str] | None = None
) -> AggregateStore[sb.Sandbox]:
    store = _store(nc, names, directory)
    if announced is not None:
        store.listen(announced.append)
    await store.start()
    return store


async def _same_as_a_fold_from_zero(nc: nats.NATS, names: Names, store: AggregateStore) -> None:
    fresh = await _started(nc, names, None)
    try:
        assert sorted(store.ids()) == sorted(fresh.ids())
        for aggregate_id in fresh.ids():
            assert store.get(aggregate_id) == fresh.get(aggregate_id)
    finally:
        await fresh.stop()


async def test_a_restart_folds_only_the_events_after_its_checkpoint(
    nc: nats.NATS, names: Names, tmp_path: Path
):
    before = [await running_sandbox(nc, names, f"before-{i}", "h1") for i in range(5)]
    first = await _started(nc, names, tmp_path)
    assert first.folded == 20
    assert await first.checkpoint() > 0
    assert await first.checkpoint() == 0  # nothing new to write
    await first.stop()
    after = await running_sandbox(nc, names, "after", "h1")

    announced: list[str] = []
    second = await _started(nc, names, tmp_path, announced)
    try:
        assert second.folded == 4  # the four events of `after`, nothing before them
        assert sorted(set(announced)) == sorted([*before, after])  # every aggregate, once at least
        await _same_as_a_fold_from_zero(nc, names, second)
    finally:
        await second.stop()


async def test_a_checkpoint_of_another_log_is_not_believed(
    nc: nats.NATS, names: Names, tmp_path: Path
):
    for i in range(3):
        await running_sandbox(nc, names, f"old-{i}", "h1")
    first = await _started(nc, names, tmp_path)
    await first.checkpoint()
    await first.stop()
    js = nc.jetstream()
    await js.delete_stream(names.events_stream)  # made anew: same sequences, other events
    await ensure_streams(js, names)
    for i in range(4):
        await running_sandbox(nc, names, f"new-{i}", "h1")

    second = await _started(nc, names, tmp_path)
    try:
        assert second.folded == 16
        await _same_as_a_fold_from_zero(nc, names, second)
    finally:
        await second.stop()


async def test_a_checkpoint_of_other_domain_code_or_garbage_is_not_believed(
    nc: nats.NATS, names: Names, tmp_path: Path
):
    for i in range(2):
        await running_sandbox(nc, names, f"sb-{i}", "h1")
    first = await _started(nc, names, tmp_path)
    await first.checkpoint()
    await first.stop()
    path = checkpoint.path_for(tmp_path, "sandbox")
    written = msgspec.msgpack.decode(path.read_bytes())

    path.write_bytes(msgspec.msgpack.encode({**written, "version": "other-code"}))
    second = await _started(nc, names, tmp_path)
    assert second.folded == 8
    await _same_as_a_fold_from_zero(nc, names, second)
    await second.stop()  # its stop writes a good one again

    path.write_bytes(b"\x00not a checkpoint")
    third = await _started(nc, names, tmp_path)
    try:
        assert third.folded == 8
        await _same_as_a_fold_from_zero(nc, names, third)
    finally:
        await third.stop()


async def test_a_checkpoint_checked_while_the_server_does_not_answer_is_believed_once_it_does(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    # A restart through an election (or a server a moment from answering) must
    # not take a timed-out check for a stale checkpoint and fold the whole log.
    names = Names("sh")
    async with own_server(tmp_path / "nats", names) as (server, conn):
        for i in range(3):
            await running_sandbox(conn, names, f"sb-{i}", "h1")
        first = await _started(conn, names, tmp_path / "checkpoints")
        await first.stop()  # (writes its checkpoint)
        second = _store(conn, names, tmp_path / "checkpoints")
        async with not_answering(server):
            starting = await waiting_unanswered(
                second.start(), caplog, "sandhold.bus.checkpoint", "the check asked again"
            )
        await asyncio.wait_for(starting, 60)
        try:
            assert second.folded == 0  # all from the checkpoint, nothing from zero
            assert "folding from zero" not in caplog.text
            await _same_as_a_fold_from_zero(conn, names, second)
        finally:
            await second.stop()
