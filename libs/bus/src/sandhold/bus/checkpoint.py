"""Checkpoints: a projection's folded state on disk, so a restart folds only
the events that came after it (decision 039).

Without one, every service start folds the whole log: ~20k events/s here, so
minutes for a log of ten million events. A store writes its states, their
sequences and trace contexts, the stream position they cover and the id of
the last event folded into them to `<dir>/<kind>.checkpoint` (msgpack, written
to a temporary file, fsynced, renamed). On start the file is believed only if

* it was written by this fold: its version is a digest of the domain
  package's source (evolve, the events, the states' shapes), so any change to
  that code makes the next start fold from zero once;
* it is for this stream and kind;
* the log still holds that very event at that sequence: a stream made anew,
  restored from elsewhere or purged does not.

Otherwise the store folds from zero, as it always did, and says why. The file
is this process's cache, never a source of truth: deleting it costs one full
fold. `sandhold replay --verify` folds from zero and compares it with each checkpoint.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import importlib
import logging
import os
import tempfile
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any, Generic, TypeVar

import msgspec
from nats.js import JetStreamContext
from sandhold.bus.codec import decode_envelope
from sandhold.bus.electing import ELECTING, patiently
from sandhold.domain import pmap

log = logging.getLogger(__name__)

S = TypeVar("S")

ENV = "SANDHOLD_CHECKPOINT_DIR"


class Checkpoint(msgspec.Struct, Generic[S], kw_only=True):
    version: str
    stream: str
    kind: str
    position: int  # every message up to this stream sequence is folded (or passed over)
    last_event_seq: int  # the last event folded in, and its id: checked against the log
    last_event_id: str
    states: dict[str, S]
    seqs: dict[str, int]
    traces: dict[str, str]
    # What the states were compacted with (`compaction_name`; "" none): a store
    # believes only a checkpoint compacted as it compacts (decision 057).
    compaction: str = ""


@cache
def fold_version() -> str:
    """A digest of the domain package's source: what folding means."""
    import sandhold.domain as domain

    digest = hashlib.sha256()
    for root in sorted(Path(p) for p in domain.__path__):
        for path in sorted(root.rglob("*.py")):
            digest.update(path.relative_to(root).as_posix().encode() + b"\0")
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Decoding makes millions of objects that all live on; the cyclic garbage
    collector, set off by the allocations, would scan them again and again
    (it tripled the decode here)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def path_for(directory: Path, kind: str) -> Path:
    return directory / f"{kind}.checkpoint"


def compaction_name(compact: Callable[[Any], Any] | None) -> str:
    """How a checkpoint names the compaction its states went through."""
    return "" if compact is None else f"{compact.__module__}.{compact.__qualname__}"


def compaction_of(name: str) -> Callable[[Any], Any] | None:
    """The domain's compaction a checkpoint names (None: none); `ValueError`
    for a name that is not one of the domain's functions."""
    if not name:
        return None
    module, _, function = name.rpartition(".")
    if not module.startswith("sandhold.domain."):
        raise ValueError(f"not a compaction of the domain: {name!r}")
    found = getattr(importlib.import_module(module), function, None)
    if not callable(found):
        raise ValueError(f"no compaction {name!r}")
    return found  # type: ignore[no-any-return]


class Checkpoints(Generic[S]):
    """The checkpoint file of one store: loaded once, written now and then."""

    def __init__(self, path: Path, state_type: Any, *, compaction: str = "") -> None:
        self.path = path
        self.compaction = compaction
        self._encoder = msgspec.msgpack.Encoder(enc_hook=pmap.enc_hook)
        # Decoded into the states' wire twins (their maps as dicts of typed
        # records), then made states: a third of the time of decoding the maps
        # as plain dicts first (`pmap.wire`).
        self._decoder = msgspec.msgpack.Decoder(Checkpoint[pmap.wire(state_type)])  # type: ignore[misc]

    def read(self) -> Checkpoint[S] | None:
        """The file as written (None: none, or unreadable, which is logged)."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as err:
            log.warning("%s: unreadable (%s): folding from zero", self.path, err)
            return None
        try:
            with _collector_paused():
                found: Checkpoint[S] = self._decoder.decode(data)
                states = {key: pmap.from_wire(state) for key, state in found.states.items()}
                found = msgspec.structs.replace(found, states=states)
        except (msgspec.DecodeError, msgspec.ValidationError) as err:
            log.warning("%s: undecodable (%s): folding from zero", self.path, err)
            return None
        return found

    async def load(self, js: JetStreamContext, stream: str, kind: str) -> Checkpoint[S] | None:
        """The checkpoint, if it is there and may be believed (see the module)."""
        found = self.read()
        if found is None:
            return None
        why = await self._stale(found, js, stream, kind)
        if why:
            log.warning("%s: %s: folding from zero", self.path, why)
            return None
        return found

    async def _stale(
        self, found: Checkpoint[S], js: JetStreamContext, stream: str, kind: str
    ) -> str:
        if found.version != fold_version():
            return "written by other domain code"
        if (found.stream, found.kind) != (stream, kind):
            return f"for {found.stream} {found.kind}, not {stream} {kind}"
        if found.compaction != self.compaction:
            return (
                f"compacted by {found.compaction or 'nothing'}, not {self.compaction or 'nothing'}"
            )
        if found.last_event_seq == 0:
            return ""  # nothing folded yet: nothing to check
        return await log_disowns(js, stream, found.last_event_seq, found.last_event_id)

    def write(self, checkpoint: Checkpoint[S]) -> int:
        """Write atomically (in a thread: a large state takes a while to encode);
        the bytes written."""
        return write_atomically(self.path, self._encoder.encode(checkpoint))


async def log_disowns(js: JetStreamContext, stream: str, seq: int, event_id: str) -> str:
    """Why the log does not bear out a fold whose last event was `event_id` at
    `seq` ("" when it does): a store's checkpoint and the metrics fold's alike.

    A read, asked again while the server does not answer (an election, a server
    a moment from ready): a restart that took a timeout for a stale checkpoint
    would fold the whole log from zero, minutes on a large one."""
    try:
        raw = await patiently(
            lambda: js.get_msg(stream, seq=seq),
            attempt_s=1.0,
            on_first_wait=lambda err: log.warning(
                "checking a checkpoint against %s: no answer (%r); asking again", stream, err
            ),
        )
        held = decode_envelope(raw.data or b"").id
    except ELECTING as err:
        return f"the log did not answer whether it holds event {seq} ({err!r})"
    except Exception as err:  # noqa: BLE001 - not there, or not an event: not believed
        return f"the log has no event at {seq} ({err!r})"
    if held != event_id:
        return f"the log holds another event at {seq}"
    return ""


def write_atomically(path: Path, data: bytes) -> int:
    """`data` as the file `path`, whole or not at all, on disk when this returns
    (a temporary file fsynced, renamed, the directory fsynced); its length."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # A name of its own: two writes at once (a periodic one still in its thread
    # when the stop writes) must not write into one temporary file.
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    temporary = Path(name)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        temporary.replace(path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
    return len(data)
