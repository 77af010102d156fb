"""Audit tools: replay a sandbox as of any point, export the log, follow it live.

Replay uses the same `fold` and `evolve` the services use, over the same
events, so what it prints is what the services believed at that point.
"""

from __future__ import annotations

import asyncio
import sqlite3
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, get_type_hints

import msgspec
from nats.aio.msg import Msg
from sandhold.bus.append import last_sequence
from sandhold.bus.follow import Follower, stream_sequence
from sandhold.bus.read import read_subjects
from sandhold.bus.records import EventRecord, record_of
from sandhold.client import Client
from sandhold.domain import asof
from sandhold.domain import sandbox as sb
from sandhold.domain.envelope import Recorded
from sandhold.domain.errors import Rejected
from sandhold.domain.fold import fold
from sandhold.domain.views import sandbox_view


def parse_point(at: str | None) -> tuple[int | None, float | None]:
    """`--at`: a stream sequence (digits) or an ISO-8601 time."""
    try:
        return asof.parse_point(at)
    except ValueError as err:
        raise SystemExit(f"sandhold: --at takes {err}") from None


async def replay(
    client: Client,
    aggregate_id: str,
    at: str | None,
    as_json: bool,
    *,
    kind: str = "sandbox",
    verify: bool = False,
    read_model: Path | None = None,
    checkpoints: Path | None = None,
) -> int:
    if verify:
        if at is not None:
            raise SystemExit("sandhold: --verify compares the current state; drop --at")
        code = await verify_read_model(client, kind, aggregate_id, read_model)
        if checkpoints is not None:
            code = max(code, await verify_checkpoints(client, kind, aggregate_id, checkpoints))
        return code
    if kind == "task":
        return await replay_task(client, aggregate_id, at, as_json)
    return await replay_sandbox(client, aggregate_id, at, as_json)


async def replay_sandbox(client: Client, sandbox_id: str, at: str | None, as_json: bool) -> int:
    seq, moment = parse_point(at)
    found = asof.state_at(sb.evolve, await client.sandbox_records(sandbox_id), seq, moment)
    if found is None or found[0].tenant != client.tenant:
        raise Rejected("sandbox_not_found", f"no sandbox {sandbox_id} at that point")
    state, as_of = found
    view = sandbox_view(state, now=moment if moment is not None else as_of.envelope.time)
    if as_json:
        out = {
            "as_of": {"seq": as_of.seq, "time": as_of.envelope.time},
            "sandbox": view,
            "commands": {c.id: c.state for c in state.commands.values()},
        }
        sys.stdout.write(msgspec.json.encode(out).decode() + "\n")
    else:
        print(
            f"{state.id} as of seq {as_of.seq} ({_iso(as_of.envelope.time)}): {state.phase}, "
            f"host {state.host or '-'}, generation {state.generation}"
        )
        for command in state.commands.values():
            print(f"  {command.id}  {command.state:<20} {' '.join(command.argv)[:60]}")
    return 0


async def replay_task(client: Client, task_id: str, at: str | None, as_json: bool) -> int:
    from sandhold.domain import task as tk

    seq, moment = parse_point(at)
    found = asof.state_at(tk.evolve, await _records(client, "task", task_id), seq, moment)
    if found is None or found[0].tenant != client.tenant:
        raise Rejected("task_not_found", f"no task {task_id} at that point")
    state, as_of = found
    if as_json:
        out = {"as_of": {"seq": as_of.seq, "time": as_of.envelope.time}, "task": state}
        sys.stdout.write(msgspec.json.encode(out).decode() + "\n")
    else:
        print(
            f"{state.id} as of seq {as_of.seq} ({_iso(as_of.envelope.time)}): {state.state}"
            + (f" ({state.reason})" if state.reason else "")
            + f", sandbox {state.sandbox_id or '-'}"
        )
        for step in state.steps.values():
            print(f"  {step.id:<20} {step.status:<11} attempt {step.attempt}  {step.reason}")
        for attempt in state.attempts:
            print(f"  failed {attempt.operation} #{attempt.attempt}: {attempt.reason}")
    return 0


async def _records(client: Client, kind: str, aggregate_id: str) -> list[Recorded]:
    read = client.task_records if kind == "task" else client.sandbox_records
    return await read(aggregate_id)


async def verify_read_model(
    client: Client, kind: str, aggregate_id: str, path: Path | None, *, timeout: float = 20.0
) -> int:
    """Fold the aggregate from the log and compare with the gateway's read model
    once the read model has caught up with the aggregate's last event.

    The aggregate may move on while we look (a command ends, a scheduled save):
    the rows are read in one read transaction, and if they already hold an event
    newer than the fold, the log is read again, so a live aggregate is never
    reported as different."""
    from sandhold.gateway import readmodel

    if path is None or not path.exists():
        raise SystemExit(
            "sandhold: no read model found: run `sandhold up` (its gateway keeps one) "
            "or pass --read-model FILE"
        )
    evolve = readmodel.KINDS[kind].evolve
    deadline = time.monotonic() + timeout
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5, isolation_level=None)
    try:
        while True:
            records = await _records(client, kind, aggregate_id)
            state = fold(evolve, (r.envelope for r in records), None)
            if state is None or state.tenant != client.tenant:
                raise Rejected(f"{kind}_not_found", f"no {kind} {aggregate_id}")
            last = records[-1].seq
            while _position(db) < last:
                if time.monotonic() > deadline:
                    print(
                        f"sandhold: the read model is behind the log (at {_position(db)}, "
                        f"{kind} {aggregate_id} is at {last}); is the gateway running?",
                        file=sys.stderr,
                    )
                    return 1
                await asyncio.sleep(0.1)
            db.execute("BEGIN")  # one snapshot of every table
            try:
                stored = readmodel.stored_rows(db, kind, aggregate_id)
            finally:
                db.execute("COMMIT")
            if _stored_seq(kind, stored) <= last or time.monotonic() > deadline:
                break
            # The read model applied events of this aggregate we have not read yet.
    finally:
        db.close()
    found = readmodel.differences(readmodel.expected_rows(kind, state, last), stored)
    for line in found:
        print(f"DIFFERENT {line}")
    if found:
        print(
            f"sandhold: the read model differs from the log for {aggregate_id}; "
            "`sandhold admin rebuild-read-model` rebuilds it from the log",
            file=sys.stderr,
        )
        return 1
    rows = sum(len(v) for v in stored.values())
    print(f"{aggregate_id}: the read model matches the log ({len(records)} events, {rows} rows)")
    return 0


async def verify_checkpoints(client: Client, kind: str, aggregate_id: str, directory: Path) -> int:
    """Fold the aggregate from zero up to where each service's checkpoint has it
    (`<data-dir>/checkpoints/<instance>/<kind>.checkpoint`) and compare: a
    checkpoint is a cache a restart believes, so it must be what the log says."""
    from sandhold.bus.checkpoint import Checkpoint, Checkpoints, compaction_of, path_for
    from sandhold.gateway import readmodel

    evolve = readmodel.KINDS[kind].evolve
    state_type = get_type_hints(evolve)["return"]
    records = await _records(client, kind, aggregate_id)
    different = 0
    for instance in sorted(p for p in directory.iterdir() if p.is_dir()):
        path = path_for(instance, kind)
        if not path.exists():
            continue
        kept: Checkpoint[Any] | None = Checkpoints(path, state_type).read()
        if kept is None or aggregate_id not in kept.seqs:
            continue  # unreadable (a restart folds from zero), or not there yet
        seq = kept.seqs[aggregate_id]
        state = fold(evolve, (r.envelope for r in records if r.seq <= seq), None)
        compact = compaction_of(kept.compaction)  # what the service keeps (decision 057)
        if compact is not None and state is not None:
            state = compact(state)
        if state == kept.states.get(aggregate_id):
            print(f"{aggregate_id}: {instance.name}'s checkpoint matches the log (as of seq {seq})")
        else:
            different += 1
            print(f"DIFFERENT {instance.name}'s checkpoint of {aggregate_id} (as of seq {seq})")
    if different:
        print(
            f"sandhold: {different} checkpoint(s) differ from the log; delete them "
            f"({directory}) and restart: the services fold from zero",
            file=sys.stderr,
        )
    return 1 if different else 0


def _stored_seq(kind: str, stored: dict[str, list[tuple]]) -> int:
    """The sequence of the aggregate's last event the stored rows reflect."""
    table, column = ("sandboxes", 7) if kind == "sandbox" else ("tasks", 6)
    rows = stored.get(table) or []
    return int(rows[0][column]) if rows else 0


def _position(db: sqlite3.Connection) -> int:
    row = db.execute("SELECT value FROM meta WHERE key = 'position'").fetchone()
    return int(row[0]) if row else 0


async def rebuild_read_model(client: Client, *, timeout: float, gateways: int = 1) -> int:
    """Ask every gateway to drop its read model and rebuild it from the log (each
    keeps its own): one answer per gateway, `gateways` of them expected."""
    from sandhold.gateway.service import rebuild_subject

    inbox = client.nc.new_inbox()
    answers: asyncio.Queue[bytes] = asyncio.Queue()

    async def on_answer(msg) -> None:
        await answers.put(msg.data)

    sub = await client.nc.subscribe(inbox, cb=on_answer)
    results: list[dict[str, Any]] = []
    try:
        await client.nc.publish(rebuild_subject(client.names), b"{}", reply=inbox)
        deadline = asyncio.get_running_loop().time() + timeout
        while len(results) < gateways:
            left = deadline - asyncio.get_running_loop().time()
            try:
                results.append(msgspec.json.decode(await asyncio.wait_for(answers.get(), left)))
            except TimeoutError:
                break
    finally:
        await sub.unsubscribe()
    for result in results:
        sys.stdout.write(msgspec.json.encode(result).decode() + "\n")
    if len(results) < gateways:
        print(
            f"sandhold: {len(results)} of {gateways} gateway(s) answered within {timeout}s; "
            "is every one running?",
            file=sys.stderr,
        )
        return 1
    return 0 if all(r.get("ok") for r in results) else 1


async def export(client: Client, sandbox_id: str | None, since: str | None) -> int:
    _, moment = parse_point(since) if since else (None, None)
    subject = (
        client.names.events("sandbox", sandbox_id) if sandbox_id else f"{client.names.prefix}.ev.>"
    )
    for msg in await read_subjects(
        client.js, client.names.events_stream, subject, raw=True, bulk=True
    ):
        try:  # any event, of a type this version knows or not, is exported as it is
            line = record_of(stream_sequence(msg), msg.subject, msg.data)
        except msgspec.DecodeError:
            print(f"sandhold: skipped an unreadable event at {msg.subject}", file=sys.stderr)
            continue
        if moment is not None and line.time < moment:
            continue
        sys.stdout.write(msgspec.json.encode(line).decode() + "\n")
    sys.stdout.flush()
    return 0


async def history(client: Client, aggregate_id: str, *, kind: str = "sandbox") -> int:
    """A readable timeline: who asked, what was decided, what happened on the host."""
    records = await _records(client, kind, aggregate_id)
    if not records:
        raise Rejected(f"{kind}_not_found", f"no {kind} {aggregate_id}")
    for record in records:
        e = record.envelope
        fields = msgspec.to_builtins(e.event)
        fields.pop("type", None)
        detail = ", ".join(
            f"{k}={v}"
            for k, v in fields.items()
            if v not in (None, "", [], {}) and k != "request_digest"
        )
        cause = e.causation_id if len(e.causation_id) <= 40 else e.causation_id[:37] + "..."
        print(
            f"{record.seq:>6}  {_iso(e.time)}  {e.actor:<22} {e.type:<26} "
            f"cause={cause}  {detail[:120]}"
        )
    return 0


async def tail(client: Client, sandbox_id: str | None, count: int | None) -> int:
    """Follow new events as the stream stores them (never a publish it refused;
    events of types this version does not know are shown by their tag)."""
    seen = 0
    done = asyncio.Event()

    def on_record(seq: int, msg: Msg, e: EventRecord) -> None:
        nonlocal seen
        print(f"{_iso(e.time)}  {e.aggregate_id}  {e.actor:<22} {e.type}", flush=True)
        seen += 1
        if count is not None and seen >= count:
            done.set()

    stream = client.names.events_stream
    subject = client.names.events("sandbox", sandbox_id or "*")
    after = await last_sequence(client.js, stream, subject)
    follower = Follower(
        client.js, stream, subject, lambda data: record_of(0, subject, data), on_record,
        start_seq=after + 1, what="events",
    )  # fmt: skip
    await follower.start(timeout=None, target=after)
    print(f"following {subject}", file=sys.stderr, flush=True)
    try:
        await done.wait()
    finally:
        await follower.stop()
    return 0


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")[:-4] + "Z"
