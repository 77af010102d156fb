"""The save store: content-addressed chunks and immutable manifests in one stream.

Layout (NATS-NOTES, "Storing file chunks"): each chunk is one message on
`<p>.chunk.<sha256>`, each manifest on `<p>.manifest.<save_id>`, in the SAVES
stream (`max_msgs_per_subject=1`, `allow_direct`). Every write expects the
subject to be empty (expected last subject sequence 0), so a chunk already
stored is refused by the server (err 10071) instead of stored twice, and a
manifest can never be overwritten.

A manifest larger than one message is split: the head message on the save's
subject carries the part count and the sha256 of the whole encoding, parts
1..n-1 go on `<p>.manifest.<save_id>~<i>`. The head is written first and
deleted last, so deleting always finds every part, and a head whose parts
are not all there reads as an incomplete (missing) manifest.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Mapping,
)
from pathlib import Path

import msgspec
from nats.aio.client import Client as NATS
from nats.js.api import RawStreamMsg
from sandhold.bus.names import Names
from sandhold.saves._bounded import all_or_none, for_each, for_each_sized
from sandhold.saves._stream import SavesStream
from sandhold.saves.errors import (
    CorruptChunk,
    CorruptManifest,
    ManifestConflict,
    MissingChunk,
    MissingManifest,
    SaveStoreError,
)
from sandhold.saves.manifest import (
    Manifest,
    chunk_lengths,
    decode_manifest,
    encode_manifest,
    entry_problems,
)

Progress = Callable[[int, int], None]

MANIFEST_PART_BYTES = 512 * 1024  # well under the default 1 MiB max payload
PARTS_HEADER = "Sandhold-Manifest-Parts"
DIGEST_HEADER = "Sandhold-Manifest-Sha256"

_DIGEST = re.compile(r"^[0-9a-f]{64}$")
_SAVE_ID = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
# Asking the server per digest costs about as much as listing ~75 stored
# subjects (measured: 4.9k probes/s vs 375k listed subjects/s): probe when the
# question is small next to the store, list otherwise.
_PROBE_AT_MOST = 16
_LIST_PER_PROBE = 50
_MAX_LISTED_PROBLEMS = 50


class UploadStats(msgspec.Struct, frozen=True, kw_only=True):
    uploaded_chunks: int
    uploaded_bytes: int
    skipped_chunks: int  # already stored: neither read nor sent
    skipped_bytes: int


def check_chunk(digest: str, data: bytes) -> None:
    """Raise `CorruptChunk` unless `data` hashes to `digest`."""
    actual = hashlib.sha256(data).hexdigest()
    if actual != digest:
        raise CorruptChunk(digest, f"the stored content ({len(data)} bytes) hashes to {actual}")


def check_digest(digest: str) -> str:
    """A chunk name must be 64 lowercase hex digits (it becomes a subject token)."""
    if not _DIGEST.match(digest):
        raise ValueError(f"{digest!r} is not a sha256 hex digest")
    return digest


def check_save_id(save_id: str) -> str:
    if not _SAVE_ID.match(save_id):
        raise ValueError(f"save id {save_id!r} must be 1-128 of A-Z a-z 0-9 _ -")
    return save_id


class SaveStore:
    """Chunks and manifests of every sandbox's saves, on the SAVES stream."""

    def __init__(
        self, nc: NATS, names: Names, *, timeout: float = 10.0, leader_reads: bool = True
    ) -> None:
        # `leader_reads`: a miss is asked again of the stream's leader (SavesStream.get).
        self._s = SavesStream(nc, names.saves_stream, timeout=timeout, leader_reads=leader_reads)
        self._names = names
        self._chunk_prefix = names.chunk("")

    # --- chunks ---------------------------------------------------------------

    async def put_chunk(self, digest: str, data: bytes) -> bool:
        """Store one chunk; False when it was already stored (nothing stored twice).

        Raises:
            CorruptChunk: `data` does not hash to `digest`.
            SaveStoreError: the server refused or did not answer.
        """
        check_digest(digest)
        actual = hashlib.sha256(data).hexdigest()
        if actual != digest:
            raise CorruptChunk(digest, f"the data to store hashes to {actual}")
        return await self._s.put_new(self._names.chunk(digest), data, msg_id=digest, headers={})

    async def get_chunk(self, digest: str, *, verify: bool = True) -> bytes:
        """A chunk's content, checked against its digest (unless the caller checks
        it itself, e.g. in a worker thread: see `check_chunk`).

        Raises:
            MissingChunk: not stored.
            CorruptChunk: the stored content does not hash to `digest`.
        """
        check_digest(digest)
        msg = await self._s.get(self._names.chunk(digest))
        if msg is None:
            raise MissingChunk(digest)
        data = msg.data or b""
        if verify:
            check_chunk(digest, data)
        return data

    async def get_chunks(
        self,
        digests: list[str],
        *,
        take: Callable[[int, bytes], None],
        before: Callable[[int], Awaitable[None]] | None = None,
        in_flight: int = 32,
    ) -> list[int]:
        """Many chunks' contents, unchecked (the caller checks them, as with
        `get_chunk(verify=False)`), `take(i, data)` for each as it comes, in any
        order; `before(i)` awaited before chunk `i` is asked for. Returns the
        indexes of those not handed over (not found, or the read stopped
        early): the caller gets them one by one, which says which is missing."""
        for digest in digests:
            check_digest(digest)
        return await self._s.get_many(
            [self._names.chunk(d) for d in digests], take=take, before=before,
            in_flight=in_flight,
        )  # fmt: skip

    async def missing(self, digests: Iterable[str]) -> set[str]:
        """The digests among `digests` that are not stored.

        Small questions probe each subject; large ones list the stored chunk
        subjects (paginated by the server, 100k per page) and compare.
        """
        wanted = {check_digest(d) for d in digests}
        if not wanted:
            return set()
        stored = await self._stored_if_cheaper(len(wanted))
        if stored is not None:
            return wanted - stored
        absent: set[str] = set()

        async def probe(digest: str) -> None:
            if not await self._s.has(self._names.chunk(digest)):
                absent.add(digest)

        await for_each(sorted(wanted), probe, concurrency=32)
        return absent

    async def upload(
        self,
        chunks: Mapping[str, Path],
        *,
        concurrency: int = 32,
        progress: Progress | None = None,
        sent: Callable[[str, bytes], None] | None = None,
    ) -> UploadStats:
        """Store the spooled chunks the store lacks; the others are neither read nor sent.

        Args:
            chunks: digest -> file holding exactly that chunk (the capture's spool).
            concurrency: chunks in flight (chunks under 64 KiB: eight times as many).
            progress: called as `progress(done_bytes, total_bytes)` after each chunk.
            sent: called with each chunk read and stored (the host's cache offer).
        """
        absent = await self.missing(chunks)
        present = [d for d in chunks if d not in absent]
        sizes = {d: file_size(chunks[d]) for d in absent}
        total = sum(sizes.values())
        done = uploaded_chunks = uploaded_bytes = raced_chunks = raced_bytes = 0

        async def send(digest: str) -> None:
            nonlocal done, uploaded_chunks, uploaded_bytes, raced_chunks, raced_bytes
            try:
                data = chunks[digest].read_bytes()
            except OSError as err:
                raise SaveStoreError(f"chunk {digest} is not readable in the spool: {err}") from err
            # Not hashed again: the spool file is named by the digest capture computed,
            # and the saver re-hashes every chunk new in a save before it counts.
            if await self._s.put_new(self._names.chunk(digest), data, msg_id=digest, headers={}):
                uploaded_chunks += 1
                uploaded_bytes += len(data)
            else:  # stored meanwhile by another save
                raced_chunks += 1
                raced_bytes += len(data)
            if sent is not None:
                sent(digest, data)
            done += sizes[digest]
            if progress is not None:
                progress(done, total)

        await for_each_sized(sorted(sizes.items()), send, concurrency=concurrency)
        return UploadStats(
            uploaded_chunks=uploaded_chunks,
            uploaded_bytes=uploaded_bytes,
            skipped_chunks=len(present) + raced_chunks,
            skipped_bytes=sum(file_size(chunks[d]) for d in present) + raced_bytes,
        )

    async def upload_stream(
        self,
        chunks: AsyncIterator[tuple[str, bytes]],
        *,
        at_most: int,
        total_bytes: int = 0,
        concurrency: int = 32,
        progress: Progress | None = None,
    ) -> UploadStats:
        """Store chunks as a producer cuts and hashes them: each distinct one once,
        none the store already has, `concurrency` in flight and no more than that
        waiting, so memory stays bounded however far the producer could run ahead.

        Args:
            chunks: (sha256 hex, content) pairs; the producer hashed them, so
                they are not hashed again here (the saver re-hashes what a save
                uploaded before it counts).
            at_most: how many chunks may come: whether the store is listed once
                or asked about each chunk is decided on it, as in `missing`.
            total_bytes: what the chunks add up to, for `progress`.
        """
        stored = await self._stored_if_cheaper(at_most)
        queue: asyncio.Queue[tuple[str, bytes] | None] = asyncio.Queue(concurrency)
        seen: set[str] = set()
        done = uploaded_chunks = uploaded_bytes = skipped_chunks = skipped_bytes = 0

        async def feed() -> None:
            try:
                async for item in chunks:
                    await queue.put(item)
            finally:  # a producer's files are closed now, not when it is collected
                if isinstance(chunks, AsyncGenerator):
                    await chunks.aclose()
            for _ in range(concurrency):
                await queue.put(None)

        async def send() -> None:
            nonlocal done, uploaded_chunks, uploaded_bytes, skipped_chunks, skipped_bytes
            while (item := await queue.get()) is not None:
                digest, data = item
                subject = self._names.chunk(check_digest(digest))
                if digest not in seen:  # a repeat within this save counts where it came first
                    seen.add(digest)
                    if stored is not None:
                        known = digest in stored
                    else:
                        known = await self._s.has(subject)
                    # put_new is False when another save stored it meanwhile
                    put = self._s.put_new
                    if not known and await put(subject, data, msg_id=digest, headers={}):
                        uploaded_chunks += 1
                        uploaded_bytes += len(data)
                    else:
                        skipped_chunks += 1
                        skipped_bytes += len(data)
                done += len(data)
                if progress is not None:
                    progress(done, max(total_bytes, done))

        await all_or_none([feed()] + [send() for _ in range(concurrency)])
        return UploadStats(
            uploaded_chunks=uploaded_chunks,
            uploaded_bytes=uploaded_bytes,
            skipped_chunks=skipped_chunks,
            skipped_bytes=skipped_bytes,
        )

    async def _stored_if_cheaper(self, at_most: int) -> set[str] | None:
        """Every stored chunk's digest when listing them costs less than asking about
        `at_most` chunks one by one; None when asking is cheaper."""
        if at_most <= _PROBE_AT_MOST or at_most * _LIST_PER_PROBE < await self._s.subject_count():
            return None
        cut = len(self._chunk_prefix)
        return {subject[cut:] for subject in await self._s.subjects(self._names.chunk("*"))}

    async def delete_chunks(self, digests: Iterable[str]) -> int:
        """Purge these chunks; returns how many were stored. Names are all checked first."""
        subjects = [self._names.chunk(check_digest(d)) for d in set(digests)]
        purged = 0

        async def purge(subject: str) -> None:
            nonlocal purged
            count = await self._s.purge(subject)  # awaited first: `purged +=` would read it stale
            purged += count

        await for_each(subjects, purge, concurrency=16)
        return purged

    async def stored_chunks(self) -> dict[str, float]:
        """Every stored chunk with the unix time it was stored at (for GC)."""
        cut = len(self._chunk_prefix)
        times = await self._s.stored_times(self._names.chunk("*"))
        return {subject[cut:]: at for subject, at in times.items()}

    # --- manifests ------------------------------------------------------------

    async def put_manifest(self, manifest: Manifest) -> tuple[int, str]:
        """Store a manifest; returns its encoded size and SHA-256 (hex), which the
        save records. Storing the same one again is fine.

        Raises:
            ManifestConflict: a different manifest is stored under this save id.
        """
        save_id = check_save_id(manifest.save_id)
        encoded = encode_manifest(manifest)
        digest = hashlib.sha256(encoded).hexdigest()
        size = MANIFEST_PART_BYTES
        parts = [encoded[i : i + size] for i in range(0, len(encoded), size)]
        head_headers = {PARTS_HEADER: str(len(parts)), DIGEST_HEADER: digest}
        await self._put_immutable(save_id, self._names.manifest(save_id), parts[0], head_headers)
        for i, part in enumerate(parts[1:], start=1):
            await self._put_immutable(save_id, self._part_subject(save_id, i), part, {})
        return len(encoded), digest

    async def get_manifest(self, save_id: str, *, digest: str = "") -> Manifest:
        """The stored manifest of a save (the one with SHA-256 `digest`, when given:
        what the save recorded, so a manifest written over by anyone is refused).

        Raises:
            MissingManifest: not stored, or not completely.
            CorruptManifest: stored but not decodable, not this save's, or not the
                one recorded.
        """
        check_save_id(save_id)
        head = await self._s.get(self._names.manifest(save_id))
        if head is None:
            raise MissingManifest(save_id)
        count, stored_digest = _head_fields(save_id, head)
        if digest and stored_digest != digest:
            raise CorruptManifest(
                f"manifest of save {save_id} is not the one its save recorded "
                f"(stored {stored_digest[:12]}…, recorded {digest[:12]}…)"
            )
        digest = stored_digest
        rest = await asyncio.gather(
            *(self._s.get(self._part_subject(save_id, i)) for i in range(1, count))
        )
        for i, part in enumerate(rest, start=1):
            if part is None:
                raise MissingManifest(save_id, f"part {i} of {count} is not stored")
        encoded = b"".join([head.data or b""] + [p.data or b"" for p in rest if p is not None])
        if hashlib.sha256(encoded).hexdigest() != digest:
            raise CorruptManifest(f"manifest of save {save_id}: its parts do not hash to {digest}")
        manifest = decode_manifest(encoded)
        if manifest.save_id != save_id:
            raise CorruptManifest(f"manifest stored for {save_id} is the one of {manifest.save_id}")
        return manifest

    async def stored_manifests(self) -> set[str]:
        """The save ids with a manifest (or a part of one) stored."""
        return set(await self.stored_manifest_times())

    async def stored_manifest_times(self) -> dict[str, float]:
        """The save ids with a manifest (or a part of one) stored, each with the
        unix time of its newest part."""
        cut = len(self._names.manifest(""))
        times: dict[str, float] = {}
        for subject, at in (await self._s.stored_times(self._names.manifest("*"))).items():
            save_id = subject[cut:].split("~", 1)[0]
            times[save_id] = max(at, times.get(save_id, at))
        return times

    async def delete_manifest(self, save_id: str) -> bool:
        """Delete a save's manifest (parts first, head last); False when there was none."""
        check_save_id(save_id)
        head = await self._s.get(self._names.manifest(save_id))
        if head is None:
            return False
        try:
            count, _ = _head_fields(save_id, head)
        except CorruptManifest:
            count = 1
        for i in range(count - 1, 0, -1):
            await self._s.purge(self._part_subject(save_id, i))
        await self._s.purge(self._names.manifest(save_id))
        return True

    # --- verification ---------------------------------------------------------

    async def verify(
        self, manifest: Manifest, *, recheck: Iterable[str] = (), read_from_store: bool = False
    ) -> list[str]:
        """What stops this save from counting; an empty list means verified.

        Checks that this very manifest is stored and decodable (not read again
        when the caller just read it from the store: `read_from_store`), that it
        describes a sound tree, that every chunk it names is stored, and
        fetches and re-hashes the chunks in `recheck` (those uploaded for this
        save), checking their lengths too. Errors reaching the store are
        raised, not listed: "could not check" is not "checked and broken".
        """
        problems: list[str] = []
        try:
            if not read_from_store:
                stored = await self.get_manifest(manifest.save_id)
                if stored != manifest:
                    problems.append(f"save {manifest.save_id} has a different manifest stored")
        except (MissingManifest, CorruptManifest) as err:
            problems.append(str(err))
        problems += entry_problems(manifest)
        needed: dict[str, tuple[int, bytes]] = {}  # digest -> (length, first path needing it)
        for entry in manifest.entries:
            if entry.kind != "file":
                continue
            for digest, length in zip(
                entry.chunks, chunk_lengths(entry, manifest.chunk_size), strict=True
            ):
                known = needed.setdefault(digest, (length, entry.path))
                if known[0] != length:
                    problems.append(f"chunk {digest} is named with lengths {known[0]} and {length}")
        absent = await self.missing(needed)
        for digest in sorted(absent)[:_MAX_LISTED_PROBLEMS]:
            path = needed[digest][1].decode(errors="backslashreplace")
            problems.append(f"chunk {digest} is not stored (needed by {path!r})")
        if len(absent) > _MAX_LISTED_PROBLEMS:
            problems.append(f"... and {len(absent) - _MAX_LISTED_PROBLEMS} more chunks not stored")

        async def recheck_one(digest: str) -> None:
            try:
                data = await self.get_chunk(digest)
            except (MissingChunk, CorruptChunk) as err:
                problems.append(str(err))
                return
            if digest in needed and len(data) != needed[digest][0]:
                problems.append(
                    f"chunk {digest} has {len(data)} bytes, the manifest needs {needed[digest][0]}"
                )

        todo = sorted({check_digest(d) for d in recheck} - absent)
        await for_each(todo, recheck_one, concurrency=8)
        return problems

    # --- plumbing -------------------------------------------------------------

    def _part_subject(self, save_id: str, index: int) -> str:
        return self._names.manifest(f"{save_id}~{index}")

    async def _put_immutable(
        self, save_id: str, subject: str, data: bytes, headers: dict[str, str]
    ) -> None:
        # The id names the content: an R3 stream's duplicate answer then means
        # "this very content", and a different content still meets the fence.
        msg_id = f"{subject}:{hashlib.sha256(data).hexdigest()}"
        if await self._s.put_new(subject, data, msg_id=msg_id, headers=headers):
            return
        existing = await self._s.get(subject)
        if existing is None:
            raise SaveStoreError(f"{subject} was refused as taken but is empty", retryable=True)
        same_data = (existing.data or b"") == data
        same_headers = all((existing.headers or {}).get(k) == v for k, v in headers.items())
        if not (same_data and same_headers):
            raise ManifestConflict(save_id)


def _head_fields(save_id: str, head: RawStreamMsg) -> tuple[int, str]:
    headers = head.headers or {}
    try:
        count = int(headers[PARTS_HEADER])
        digest = headers[DIGEST_HEADER]
    except (KeyError, ValueError) as err:
        raise CorruptManifest(f"manifest of save {save_id}: bad head ({err!r})") from err
    if count < 1:
        raise CorruptManifest(f"manifest of save {save_id}: {count} parts")
    return count, digest


def file_size(path: Path) -> int:
    """A spooled file's size; 0 when it is gone (then reading it fails where it matters)."""
    try:
        return os.stat(path).st_size
    except OSError:
        return 0
