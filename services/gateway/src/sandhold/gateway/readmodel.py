"""The read model: an SQLite projection of the event log for lists and filters.

Rows and the consumer position are written in one transaction, so a batch is
either wholly applied or not at all, and an event delivered again (a
restarted consumer, a rebuild racing the live feed) is skipped by its stream
sequence: redelivery changes nothing. Every row is derived from the same
`evolve` the services fold with; the folded state itself is kept per
aggregate (column `state`), so the projection continues from where it stopped
and `sandhold replay --verify` can compare it with a fresh fold of the log.

Dropping the file loses nothing: `rebuild()` replays the log from the start
(`sandhold admin rebuild-read-model`).

One gateway writes a read model: each instance has its own file (its default
path names the instance), and a second writer opening one is refused (a lock
on `<file>.lock`) instead of interleaving positions with the first. Readers
(`sandhold replay --verify`) need no lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import sqlite3
from collections import OrderedDict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import aiosqlite
import msgspec
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from sandhold.bus.append import last_sequence
from sandhold.bus.codec import decode_envelope
from sandhold.bus.follow import pull_batches
from sandhold.bus.names import Names
from sandhold.domain import events as ev
from sandhold.domain import host as host_domain
from sandhold.domain import pmap
from sandhold.domain import sandbox as sb
from sandhold.domain import task as task_domain
from sandhold.domain.saves import SaveRecord
from sandhold.domain.views import command_view, save_view

log = logging.getLogger("sandhold.gateway.readmodel")

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS sandboxes (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    phase TEXT NOT NULL,
    host TEXT,
    generation INTEGER NOT NULL,
    created_at REAL NOT NULL,
    delete_requested INTEGER NOT NULL,
    seq INTEGER NOT NULL,
    state BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS sandboxes_by_tenant ON sandboxes (tenant, created_at, id);
CREATE TABLE IF NOT EXISTS commands (
    sandbox_id TEXT NOT NULL,
    id TEXT NOT NULL,
    tenant TEXT NOT NULL,
    state TEXT NOT NULL,
    queued_at REAL NOT NULL,
    ended_at REAL,
    view BLOB NOT NULL,
    record BLOB NOT NULL,
    PRIMARY KEY (sandbox_id, id)
);
CREATE INDEX IF NOT EXISTS commands_by_sandbox ON commands (sandbox_id, queued_at, id);
CREATE TABLE IF NOT EXISTS saves (
    sandbox_id TEXT NOT NULL,
    id TEXT NOT NULL,
    tenant TEXT NOT NULL,
    kind TEXT NOT NULL,
    state TEXT NOT NULL,
    requested_at REAL NOT NULL,
    view BLOB NOT NULL,
    record BLOB NOT NULL,
    PRIMARY KEY (sandbox_id, id)
);
CREATE INDEX IF NOT EXISTS saves_by_sandbox ON saves (sandbox_id, requested_at, id);
CREATE TABLE IF NOT EXISTS hosts (
    id TEXT PRIMARY KEY,
    status TEXT NOT NULL,
    epoch INTEGER NOT NULL,
    seq INTEGER NOT NULL,
    state BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS tasks (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    state TEXT NOT NULL,
    submitted_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    sandbox_id TEXT,
    seq INTEGER NOT NULL,
    body BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS tasks_by_tenant ON tasks (tenant, submitted_at, id);
"""

TABLES = ("sandboxes", "commands", "saves", "hosts", "tasks")
# Once caught up, what came at most this often, in one batch (decision 087): a
# list asks `wait_for` the log's end first, which fetches at once.
PACE_S = 0.25
# A read model of another version is dropped and rebuilt from the log on open.
SCHEMA_VERSION = "8"  # 3: a sandbox keeps its queued command ids; 4: a cold command its start;
# 5: its unended command ids and ended counts, without its idempotency keys; 6: its
# saves' indexes (decision 055); 7: save records in their rows, the sandbox's row
# holds only the saves its view reads; 8: its (empty) key fingerprints (decision 085)

_json = msgspec.json.Encoder(order="deterministic", enc_hook=pmap.enc_hook)
_command = msgspec.json.Decoder(sb.Command)


class Kind(msgspec.Struct, frozen=True):
    """How one aggregate kind is folded and stored."""

    evolve: Callable[[Any, Any], Any]
    decoder: msgspec.json.Decoder  # of the state's wire twin (`pmap.wire`)

    def decode(self, data: bytes) -> Any:
        return pmap.from_wire(self.decoder.decode(data))


KINDS = {
    "sandbox": Kind(sb.evolve, msgspec.json.Decoder(pmap.wire(sb.Sandbox))),
    "host": Kind(host_domain.evolve, msgspec.json.Decoder(host_domain.Host)),
    "task": Kind(task_domain.evolve, msgspec.json.Decoder(task_domain.Task)),
}


async def connect(path: Path) -> aiosqlite.Connection:
    db = await aiosqlite.connect(path, isolation_level=None)
    await db.execute("PRAGMA journal_mode=WAL")
    await db.execute("PRAGMA synchronous=NORMAL")
    await db.execute("PRAGMA busy_timeout=5000")
    return db


class ReadModelInUse(RuntimeError):
    """Another gateway writes this read model."""


def lock_writer(path: Path) -> int:
    """Hold `<path>.lock` for this process's writer (a descriptor to close to let
    go; the lock also goes with the process). `ReadModelInUse` when another holds it."""
    fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise ReadModelInUse(
            f"{path} is the read model of another gateway (pid {holder}): give each gateway "
            "its own (--read-model, or --instance: the default path names the instance)"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


class ReadModel:
    """The projection, its writer (one connection) and its reader (another).

    WAL mode gives readers the last committed batch while a new one is written.
    """

    def __init__(
        self, path: Path, names: Names, *, cache_size: int = 2048, pace_s: float = PACE_S
    ) -> None:
        self.path = path
        self.names = names
        self.position = 0
        self._writer: aiosqlite.Connection | None = None
        self._reader: aiosqlite.Connection | None = None
        # Folded states of recently changed aggregates (least recently used first),
        # so a busy sandbox is not read back for every batch. Bounded: the rows
        # hold every aggregate, and a gateway must not keep the whole log in memory.
        # A sandbox's is kept compacted (`sb.compact`, decision 072), without
        # its request keys: its ended commands and the saves nothing names are
        # in the rows, never again changed, so a long-lived sandbox costs what a
        # new one does.
        self._cache: OrderedDict[tuple[str, str], tuple[Any, int]] = OrderedDict()
        self._cache_size = cache_size
        self._write_lock = asyncio.Lock()
        self._advanced = asyncio.Condition()
        self._lock_fd: int | None = None
        self._pace_s = pace_s
        self._hurry = asyncio.Event()  # a reader waits in `wait_for`: fetch now

    async def open(self) -> ReadModel:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock_fd = lock_writer(self.path)
        self._writer = await connect(self.path)
        await self._writer.executescript(SCHEMA)
        if await self._meta("schema") != SCHEMA_VERSION:
            await self._writer.executescript(
                "".join(f"DROP TABLE IF EXISTS {t};" for t in (*TABLES, "meta")) + SCHEMA
            )
            await self._writer.execute("INSERT INTO meta VALUES ('schema', ?)", (SCHEMA_VERSION,))
        prefix = await self._meta("prefix")
        if prefix is not None and prefix != self.names.prefix:
            raise ValueError(
                f"{self.path} holds the read model of prefix {prefix!r}, not {self.names.prefix!r}"
            )
        await self._writer.execute(
            "INSERT OR IGNORE INTO meta VALUES ('prefix', ?)", (self.names.prefix,)
        )
        self.position = int(await self._meta("position") or 0)
        self._reader = await connect(self.path)
        return self

    async def close(self) -> None:
        for db in (self._reader, self._writer):
            if db is not None:
                with contextlib.suppress(Exception):
                    await db.close()
        self._reader = self._writer = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # and with it the lock
            self._lock_fd = None

    async def _meta(self, key: str) -> str | None:
        assert self._writer is not None
        async with self._writer.execute("SELECT value FROM meta WHERE key = ?", (key,)) as cur:
            row = await cur.fetchone()
        return None if row is None else row[0]

    # --- applying events -----------------------------------------------------

    async def apply(self, messages: Iterable[tuple[int, str, bytes]]) -> int:
        """Apply (stream sequence, subject, data) in one transaction; returns how
        many were new. Messages at or below the position are skipped."""
        async with self._write_lock:
            return await self._apply_locked(messages)

    async def _apply_locked(self, messages: Iterable[tuple[int, str, bytes]]) -> int:
        try:
            applied, position, writes = await self._apply_in_transaction(messages, self.position)
            await self._in_writer(_committed, writes)
        except BaseException:
            self._cache.clear()  # it may hold states the rollback undid
            raise
        await self._advance(position)
        return applied

    async def _in_writer(
        self, fn: Callable[[sqlite3.Connection, Writes], None], writes: Writes
    ) -> None:
        """`fn(connection, writes)` on the writer's own thread, in one call: a
        batch's rows cost one hand-over to that thread, not one per statement
        (per event on the live path, where a batch is mostly one event)."""
        assert self._writer is not None
        writer = self._writer
        # (aiosqlite runs every call of a connection on its thread through `_execute`.)
        await writer._execute(lambda: fn(writer._conn, writes))

    def _trim_cache(self) -> None:
        # Only once a batch's states are written (`_write` needs each of them); an
        # evicted state is read back from the rows, the transaction's own included.
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)

    async def _apply_in_transaction(
        self, messages: Iterable[tuple[int, str, bytes]], position: int
    ) -> tuple[int, int, Writes]:
        """Fold `messages`; the rows they change, as statements to run (`_in_writer`)."""
        assert self._writer is not None
        writes: Writes = []
        before: dict[tuple[str, str], Any] = {}
        touched: dict[tuple[str, str], set[str]] = {}  # the commands and saves its events named
        applied = 0
        for seq, subject, data in messages:
            if seq <= position:
                continue  # delivered again: already in the rows
            position = seq
            tokens = subject.split(".")
            if len(tokens) != 4 or tokens[1] != "ev" or tokens[2] not in KINDS:
                continue
            kind, aggregate_id = tokens[2], tokens[3]
            try:
                envelope = decode_envelope(data)
            except msgspec.DecodeError:
                log.error("undecodable event at %s seq %d: skipped", subject, seq)
                continue
            key = (kind, aggregate_id)
            state, _ = await self._load(key)
            if key not in before:
                before[key] = state
            named = named_ids(envelope.event)
            if named:
                touched.setdefault(key, set()).update(named)
            try:
                new_state = KINDS[kind].evolve(state, envelope)
            except Exception:  # a poison event must not stall every list: skip it, loudly
                log.exception("event at %s seq %d could not be applied: skipped", subject, seq)
                continue
            self._cache[key] = (new_state, seq)
            self._cache.move_to_end(key)
            applied += 1
        for key, old in before.items():
            self._write(writes, key, old, touched.get(key, set()))
            state, seq = self._cache[key]
            if key[0] == "sandbox" and state is not None:
                self._cache[key] = (kept_in_cache(state), seq)
        # (An evicted state is read back from its rows: this batch's are written
        # before the next batch is folded. Within a batch no state is evicted.)
        self._trim_cache()
        writes.append(
            (
                "INSERT INTO meta VALUES ('position', ?) "
                "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                (str(position),),
            )
        )
        return applied, position, writes

    async def _load(self, key: tuple[str, str]) -> tuple[Any, int]:
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        assert self._writer is not None
        kind, aggregate_id = key
        table = {"sandbox": "sandboxes", "host": "hosts", "task": "tasks"}[kind]
        column = "body" if kind == "task" else "state"
        async with self._writer.execute(
            f"SELECT {column}, seq FROM {table} WHERE id = ?", (aggregate_id,)
        ) as cur:
            row = await cur.fetchone()
        if row is None:
            found: tuple[Any, int] = (None, 0)
        else:
            decoded = KINDS[kind].decode(row[0])
            if kind == "sandbox":
                # As the cache keeps it: the body holds the saves something names
                # (see sandbox_row); of the commands (rows of their own), the unended.
                decoded = msgspec.structs.replace(
                    decoded, commands=await self._unended_commands(decoded)
                )
            found = (decoded, int(row[1]))
        self._cache[key] = found
        return found

    async def _unended_commands(self, s: sb.Sandbox) -> pmap.PMap[str, sb.Command]:
        assert self._writer is not None
        if not s.unended_ids:
            return pmap.EMPTY
        # By primary key, one lookup each (an ORDER BY would take the sandbox's
        # index and walk every command it ever ran).
        async with self._writer.execute(
            "SELECT queued_at, id, record FROM commands WHERE sandbox_id = ? "
            "AND id IN (SELECT value FROM json_each(?))",
            (s.id, _json.encode(s.unended_ids)),
        ) as cur:
            rows = sorted(await cur.fetchall())
        return pmap.PMap((r[1], _command.decode(r[2])) for r in rows)

    def _write(self, writes: Writes, key: tuple[str, str], old: Any, touched: set[str]) -> None:
        state, seq = self._cache[key]
        if state is None:
            return
        kind = key[0]
        if kind == "sandbox":
            _write_sandbox(writes, state, seq, old, touched)
        elif kind == "host":
            writes.append(
                (
                    "INSERT OR REPLACE INTO hosts VALUES (?, ?, ?, ?, ?)",
                    (state.host, state.status, state.epoch, seq, _json.encode(state)),
                )
            )
        else:
            writes.append(
                (
                    "INSERT OR REPLACE INTO tasks VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    task_row(state, seq),
                )
            )

    async def _advance(self, position: int) -> None:
        async with self._advanced:
            self.position = position
            self._advanced.notify_all()

    async def wait_for(self, seq: int, timeout: float) -> bool:
        """Wait until every event up to `seq` is in the rows (False on timeout),
        without waiting for the pace."""
        if self.position < seq:
            self._hurry.set()
        async with self._advanced:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    self._advanced.wait_for(lambda: self.position >= seq), timeout
                )
        return self.position >= seq

    # --- following the log ---------------------------------------------------

    async def follow(self, js: JetStreamContext, *, batch: int = 256) -> None:
        """Apply the log from the position on, forever. A consumer that goes away
        (server restart, idle cleanup) is made again from the committed position."""
        while True:
            try:
                await self._follow_once(js, batch)
            except asyncio.CancelledError:
                raise
            except Exception as err:  # noqa: BLE001 - keep projecting whatever happens
                log.warning("read model consumer failed (%s); resuming from %d", err, self.position)
                await asyncio.sleep(1.0)

    async def _follow_once(self, js: JetStreamContext, batch: int) -> None:
        batches = self._batches(js, self.position, batch, idle_s=5.0)
        try:
            async for msgs in batches:
                if msgs:
                    await self.apply(_triples(msgs))
                if msgs and len(msgs) < batch:  # all there was: let the next ones gather
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(self._pace_s):
                            await self._hurry.wait()
                    self._hurry.clear()
        finally:
            await batches.aclose()

    def _batches(self, js: JetStreamContext, after: int, batch: int, *, idle_s: float):
        return pull_batches(
            js, self.names.events_stream, f"{self.names.prefix}.ev.>",
            after=after, batch=batch, idle_s=idle_s, what="the read model's events",
        )  # fmt: skip

    async def log_end(self, js: JetStreamContext) -> int:
        return await last_sequence(js, self.names.events_stream, f"{self.names.prefix}.ev.>")

    async def rebuild(self, js: JetStreamContext, *, batch: int = 512) -> dict[str, int]:
        """Drop every row and replay the log from the start, in one transaction:
        readers see the old rows until the new ones are complete."""
        async with self._write_lock:
            assert self._writer is not None
            target = await self.log_end(js)
            self._cache.clear()
            await self._writer.execute("BEGIN IMMEDIATE")
            try:
                for table in TABLES:
                    await self._writer.execute(f"DELETE FROM {table}")
                position = 0
                if target > 0:
                    batches = self._batches(js, 0, batch, idle_s=10.0)
                    try:
                        async for msgs in batches:
                            if not msgs:
                                raise TimeoutError(f"rebuild: the log stopped short of {target}")
                            _, position, writes = await self._apply_in_transaction(
                                _triples(msgs), position
                            )
                            await self._in_writer(_written, writes)
                            if position >= target:
                                break
                    finally:
                        await batches.aclose()
                else:
                    _, _, writes = await self._apply_in_transaction([], 0)
                    await self._in_writer(_written, writes)
                await self._writer.execute("COMMIT")
            except BaseException:
                with contextlib.suppress(Exception):
                    await self._writer.execute("ROLLBACK")
                self._cache.clear()
                raise
            await self._advance(position)
            return {"position": position, **await self.counts()}

    # --- reading -------------------------------------------------------------

    async def counts(self) -> dict[str, int]:
        out = {}
        for table in TABLES:
            rows = await self.query(f"SELECT count(*) FROM {table}")
            out[table] = int(rows[0][0])
        return out

    async def query(self, sql: str, params: tuple = ()) -> list[tuple]:
        assert self._reader is not None
        async with self._reader.execute(sql, params) as cur:
            # aiosqlite says sqlite3.Row; without a row_factory sqlite3 gives plain tuples.
            return list(await cur.fetchall())  # type: ignore[arg-type]


# A batch's rows: (SQL, parameters), run in order on the writer's thread.
Writes = list[tuple[str, tuple]]


def _written(db: sqlite3.Connection, writes: Writes) -> None:
    """Inside a transaction already open (a rebuild's)."""
    for sql, params in writes:
        db.execute(sql, params)


def _committed(db: sqlite3.Connection, writes: Writes) -> None:
    """In a transaction of their own: all of them, or none."""
    db.execute("BEGIN IMMEDIATE")
    try:
        _written(db, writes)
        db.execute("COMMIT")
    except BaseException:
        with contextlib.suppress(Exception):
            db.execute("ROLLBACK")
        raise


def _write_sandbox(
    writes: Writes, s: sb.Sandbox, seq: int, old: sb.Sandbox | None, touched: set[str]
) -> None:
    writes.append(
        ("INSERT OR REPLACE INTO sandboxes VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", sandbox_row(s, seq))
    )
    for command in changed_commands(old, s, touched):
        writes.append(
            (
                "INSERT OR REPLACE INTO commands VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                command_row(s, command),
            )
        )
    for record in changed_saves(old, s, touched):
        writes.append(
            ("INSERT OR REPLACE INTO saves VALUES (?, ?, ?, ?, ?, ?, ?, ?)", save_row(s, record))
        )


def _triples(msgs: list[tuple[int, Msg]]) -> list[tuple[int, str, bytes]]:
    return [(seq, m.subject, m.data) for seq, m in msgs]


# Row shapes, shared with `sandhold replay --verify` (which rebuilds them from a
# fresh fold and compares).


def kept_in_cache(s: sb.Sandbox) -> sb.Sandbox:
    """What the cache keeps of a sandbox once its rows are written (decision
    072): compacted, and without its request keys (no row holds them and
    `evolve` reads none; a state read back from the rows has none either)."""
    return msgspec.structs.replace(sb.compact(s), requests=pmap.EMPTY, forgotten_keys=())


def sandbox_row(s: sb.Sandbox, seq: int) -> tuple:
    # The state without its commands and with only the saves its view reads
    # (commands and saves have rows of their own; lists render views from this
    # state alone), and without the idempotency keys it has seen (the
    # scheduler's business, not a reader's): a sandbox that ran many commands,
    # or saved every interval for months, is not rewritten whole on every event.
    # The same whether the cache held it compacted or whole (`compacted` is a
    # service's note to itself).
    return (
        s.id,
        s.tenant,
        s.phase,
        s.host,
        s.generation,
        s.created_at,
        int(s.delete_requested),
        seq,
        _json.encode(
            msgspec.structs.replace(
                s,
                commands=pmap.EMPTY,
                saves=s.named_saves(),
                requests=pmap.EMPTY,
                forgotten_keys=(),
                compacted=False,
            )
        ),
    )


def changed_commands(
    old: sb.Sandbox | None, new: sb.Sandbox, touched: Iterable[str] = ()
) -> list[sb.Command]:
    """The commands `new` holds that differ from `old`'s, where `touched` names
    those the events between them were about. An ended command never changes
    again, so only those unended before or after, or named by an event (one
    queued and ended in between: a batch), can have: a sandbox that ran 10,000
    commands is not gone through on every event."""
    if old is None:
        return list(new.commands.values())
    ids = dict.fromkeys((*old.unended_ids, *new.unended_ids, *sorted(touched)))
    return [
        command
        for cid in ids
        if (command := new.commands.get(cid)) is not None
        and old.commands.get(cid) is not command  # frozen: changed = replaced
    ]


def named_ids(event: Any) -> tuple[str, ...]:
    """The commands and saves an event is about (a stop: its final save)."""
    if isinstance(event, ev.SavesExpired):
        return tuple(event.save_ids)
    return tuple(
        i
        for i in (
            getattr(event, "command_id", None),
            getattr(event, "save_id", None),
            getattr(event, "final_save_id", None),
        )
        if i is not None
    )


def changed_saves(
    old: sb.Sandbox | None, new: sb.Sandbox, touched: Iterable[str] = ()
) -> list[SaveRecord]:
    """The saves `new` holds that differ from `old`'s, where `touched` names
    those the events between them were about. Only a save under way moves on,
    only a completed one expires or is confirmed by an unchanged capture
    (decision 067), and only one requested since the sandbox's activity last
    moved is stamped (`_changed`); a new one is named by its event: a sandbox
    with 10,000 saves behind it is not gone through per event."""
    if old is None:
        return list(new.saves.values())
    ids = dict.fromkeys(
        (
            *old.saves_in_flight,
            *old.saves_completed,
            *old.requested_since_activity,
            *sorted(touched),
        )
    )
    return [
        record
        for i in ids
        if (record := new.saves.get(i)) is not None and old.saves.get(i) is not record
    ]


def command_row(s: sb.Sandbox, command: sb.Command) -> tuple:
    return (
        s.id,
        command.id,
        s.tenant,
        command.state,
        command.queued_at,
        command.ended_at,
        _json.encode(command_view(s.id, command, s)),
        _json.encode(command),
    )


def save_row(s: sb.Sandbox, record: SaveRecord) -> tuple:
    return (
        s.id,
        record.id,
        s.tenant,
        record.kind,
        record.state,
        record.requested_at,
        _json.encode(save_view(s.id, record)),
        _json.encode(record),
    )


def task_row(t: task_domain.Task, seq: int) -> tuple:
    return (
        t.id,
        t.tenant,
        t.state,
        t.submitted_at,
        t.updated_at,
        t.sandbox_id,
        seq,
        _json.encode(t),
    )


# --- verifying: the rows a fresh fold gives, against the stored ones -----------------

_COLUMNS = {
    "sandboxes": (
        "id",
        "tenant",
        "phase",
        "host",
        "generation",
        "created_at",
        "delete_requested",
        "seq",
        "state",
    ),
    "commands": (
        "sandbox_id",
        "id",
        "tenant",
        "state",
        "queued_at",
        "ended_at",
        "view",
        "record",
    ),
    "saves": ("sandbox_id", "id", "tenant", "kind", "state", "requested_at", "view", "record"),
    "tasks": (
        "id",
        "tenant",
        "state",
        "submitted_at",
        "updated_at",
        "sandbox_id",
        "seq",
        "body",
    ),
}


def expected_rows(kind: str, state: Any, seq: int) -> dict[str, list[tuple]]:
    """What the read model must hold for an aggregate folded up to `seq`."""
    if kind == "sandbox":
        return {
            "sandboxes": [sandbox_row(state, seq)],
            "commands": sorted(command_row(state, c) for c in state.commands.values()),
            "saves": sorted(save_row(state, r) for r in state.saves.values()),
        }
    return {"tasks": [task_row(state, seq)]}


def stored_rows(db: Any, kind: str, aggregate_id: str) -> dict[str, list[tuple]]:
    """The read model's rows for one aggregate (`db`: a sqlite3 connection)."""
    if kind == "sandbox":
        where = {"sandboxes": "id", "commands": "sandbox_id", "saves": "sandbox_id"}
    else:
        where = {"tasks": "id"}
    out = {}
    for table, key in where.items():
        columns = ", ".join(_COLUMNS[table])
        rows = db.execute(
            f"SELECT {columns} FROM {table} WHERE {key} = ?", (aggregate_id,)
        ).fetchall()
        out[table] = sorted(tuple(r) for r in rows)
    return out


def differences(expected: dict[str, list[tuple]], stored: dict[str, list[tuple]]) -> list[str]:
    """Human-readable differences, one per differing column or missing row."""
    found = []
    for table, rows in expected.items():
        columns = _COLUMNS[table]
        want = {row[:2]: row for row in rows}
        have = {row[:2]: row for row in stored.get(table, [])}
        for key in sorted(want.keys() | have.keys()):
            name = "/".join(str(k) for k in key)
            if key not in have:
                found.append(f"{table} {name}: missing from the read model")
            elif key not in want:
                found.append(f"{table} {name}: in the read model, not in the log")
            else:
                for column, a, b in zip(columns, want[key], have[key], strict=True):
                    if a != b:
                        shown_a, shown_b = _short(a), _short(b)
                        found.append(
                            f"{table} {name} {column}: log {shown_a}, read model {shown_b}"
                        )
    return found


def _short(value: Any) -> str:
    text = value.decode(errors="replace") if isinstance(value, bytes) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
