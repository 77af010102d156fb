"""Saves on the host: freeze, capture what changed into the spool, thaw, upload.

The freeze window covers only the capture (a walk of the workspace plus a copy
of the files that changed since the parent save); cutting, hashing and
uploading happen after the thaw, in one pass over the spool's copies. Each
save is attempted once: a marker in the spool says an attempt began, so a
host-agent that restarts mid-save reports it failed instead of quietly
producing a different save under the same id.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypedDict

import msgspec
from nats.aio.client import Client as NATS
from sandhold.bus.cancelling import finish
from sandhold.bus.names import Names
from sandhold.domain import events as ev
from sandhold.domain.errors import SandholdError
from sandhold.domain.reports import HostReport
from sandhold.hostagent.driver.port import SandboxDriver
from sandhold.saves import (
    ChunkCache,
    Manifest,
    SaveStore,
    capture,
    decode_manifest,
    encode_manifest,
    holds,
    restore,
    same_files,
    store_capture,
)

log = logging.getLogger("sandhold.host-agent.saving")

Report = Callable[[HostReport], Awaitable[None]]


class _Placement(TypedDict):
    """Where a save runs, as every save event of this host says it."""

    host: str
    generation: int


class _Capture(_Placement):
    """What `save.captured` and `save.unchanged` both say of a capture."""

    save_id: str
    freeze_ms: float
    freeze_method: str
    scanned_files: int
    quiet: bool


class Progress(msgspec.Struct):
    """Published (core NATS, not kept) while a long save or restore runs."""

    operation: str  # "upload" | "restore"
    done_bytes: int
    total_bytes: int


# A command's end looks at the sandbox's files (`HostSaves.files_held`, decision
# 078) only where its last save lists at most this many names: the look runs in
# the agent's loop, in the command's own path, at ~4 µs a name to decode and
# as much to walk here (~2 ms at the cap). A larger tree is left to the
# scheduled save, which finds the same off that path (decision 067).
LOOK_MAX_NAMES = 256

# Saves of running sandboxes one host takes at once (see `HostSaves._turns`).
SAVES_AT_ONCE = max(2, os.cpu_count() or 2)


class HostSaves:
    def __init__(
        self,
        nc: NATS,
        names: Names,
        driver: SandboxDriver,
        store: SaveStore,
        root: Path,
        host_id: str,
        cache: ChunkCache | None = None,
    ) -> None:
        self._nc = nc
        self._cache = cache  # chunks restored or uploaded here, for the next restore
        self._names = names
        self._driver = driver
        self._store = store
        self._root = root
        self._host_id = host_id
        self._running: set[str] = set()  # saves being taken by this agent right now
        # Saves of running sandboxes taken at once. Each is mostly thread work
        # (capture, cutting, hashing): unbounded, the saves falling due together
        # filled every thread and core, and commands waited (docs/benchmarks.md (m)).
        # A final save (the sandbox is stopping) never waits for one of these.
        self._turns = asyncio.Semaphore(SAVES_AT_ONCE)

    def _spool(self, sandbox_id: str) -> Path:
        return self._root / "spool" / sandbox_id

    async def save(
        self,
        sandbox_id: str,
        generation: int,
        save_id: str,
        parent_id: str | None,
        *,
        freeze: bool,
        report: Report,
        may_be_unchanged: bool = False,
    ) -> None:
        """One attempt at a save; every outcome is reported, none raises.
        `may_be_unchanged`: a capture that finds every file as the parent save
        holds it stores nothing and says so (`save.unchanged`, decision 067)."""
        if save_id in self._running:
            return  # a duplicate instruction while this very save is under way
        self._running.add(save_id)
        try:
            async with self._turns if freeze else contextlib.nullcontext():
                await self._save(
                    sandbox_id,
                    generation,
                    save_id,
                    parent_id,
                    freeze=freeze,
                    report=report,
                    may_be_unchanged=may_be_unchanged,
                )
        finally:
            self._running.discard(save_id)

    async def _save(
        self,
        sandbox_id: str,
        generation: int,
        save_id: str,
        parent_id: str | None,
        *,
        freeze: bool,
        report: Report,
        may_be_unchanged: bool,
    ) -> None:
        spool = self._spool(sandbox_id)
        spool.mkdir(parents=True, exist_ok=True)
        marker = spool / f"{save_id}.started"
        me: _Placement = {"host": self._host_id, "generation": generation}
        if marker.exists():
            await report(
                ev.SaveFailed(
                    save_id=save_id,
                    stage="interrupted",
                    **me,
                    reason="the host-agent restarted during this save",
                )
            )
            marker.unlink(missing_ok=True)
            return
        marker.touch()
        try:
            previous = await self._manifest(sandbox_id, parent_id)
            # (Not `capabilities()`: that looks for programs on PATH, every save.)
            method = self._driver.freeze_method if freeze else "none"
            started = time.monotonic()
            quiet = False
            try:
                # Inside the try: a freeze that timed out leaves the cgroup FREEZING,
                # and only a thaw undoes that.
                if freeze:
                    await self._driver.freeze(sandbox_id)
                    # Frozen, nothing forks: if only the box runs now, the files
                    # stay as captured until a command runs (`unchanged_since`).
                    quiet = await asyncio.to_thread(self._driver.quiet, sandbox_id)
                captured = await asyncio.to_thread(
                    capture,
                    self._driver.save_root(sandbox_id),
                    save_id=save_id,
                    sandbox_id=sandbox_id,
                    previous=previous,
                    spool=spool / save_id,
                    now=time.time(),
                    # Frozen, only a stat walk and a copy of what changed; the
                    # hashing happens on the copies once processes run again.
                    defer_hashing=True,
                    # Owners as the sandbox sees them, so another host's range fits.
                    id_offset=self._driver.id_offset(sandbox_id),
                    layout=self._driver.save_layout,
                )
            finally:
                if freeze:
                    # Whatever cancels the save (a fence, a shutdown, again and
                    # again), the thaw is not what it interrupts.
                    await finish(self._driver.thaw(sandbox_id))
            freeze_ms = (time.monotonic() - started) * 1000
        except (OSError, SandholdError) as err:
            await report(ev.SaveFailed(save_id=save_id, stage="capture", reason=str(err), **me))
            marker.unlink(missing_ok=True)
            return
        # What the capture says, stored or not.
        seen = _Capture(
            save_id=save_id,
            freeze_ms=round(freeze_ms, 2),
            freeze_method=str(method),
            scanned_files=captured.scanned_files,
            quiet=quiet,
            **me,
        )
        if may_be_unchanged and previous is not None and same_files(previous, captured.manifest):
            # Nothing to store: the parent holds these files. (A scheduled save of
            # a sandbox that ran only `true` was a manifest stored, four events and
            # a verification: ~30 ms of CPU, decision 067.)
            shutil.rmtree(spool / save_id, ignore_errors=True)
            await report(ev.SaveUnchanged(**seen))
            marker.unlink(missing_ok=True)
            return
        await report(
            ev.SaveCaptured(
                **seen,
                changed_files=captured.changed_files,
                changed_bytes=captured.changed_bytes,
            )
        )
        started = time.monotonic()
        try:
            progress = self._progress(sandbox_id, save_id, "upload")
            # The copies are cut and hashed while their first chunks are sent.
            captured, uploaded = await store_capture(
                self._store, captured, progress=progress, cache=self._cache
            )
            manifest_bytes, manifest_digest = await self._store.put_manifest(captured.manifest)
        except (OSError, SandholdError, TimeoutError) as err:
            await report(ev.SaveFailed(save_id=save_id, stage="upload", reason=str(err), **me))
            marker.unlink(missing_ok=True)
            return
        finally:
            shutil.rmtree(spool / save_id, ignore_errors=True)
        self._remember(sandbox_id, captured.manifest, keep=parent_id)
        await report(
            ev.SaveUploaded(
                save_id=save_id,
                total_bytes=captured.manifest.total_bytes,
                files=captured.manifest.files,
                uploaded_bytes=uploaded.uploaded_bytes,
                uploaded_chunks=uploaded.uploaded_chunks,
                manifest_bytes=manifest_bytes,
                manifest_digest=manifest_digest,
                duration_ms=round((time.monotonic() - started) * 1000, 2),
                **me,
            )
        )
        # Reported: a redelivered instruction finds the save no longer requested.
        # (Kept where an outcome could not be reported: the next attempt says
        # "interrupted". Left behind, one marker a save filled the spool.)
        marker.unlink(missing_ok=True)

    async def restore_workspace(
        self, sandbox_id: str, save_id: str, digest: str = ""
    ) -> ev.RestoreReport | None:
        """Materialise the sandbox's files from a save when this host has none, and
        say what that cost (None: the host had them, nothing was restored).

        A save of a whole root goes back into the persistent layer; one of a
        workspace (a task's seed, a save from the process driver) into the workspace.
        """
        if await asyncio.to_thread(self._driver.has_local_copy, sandbox_id):
            return None
        started = time.monotonic()
        manifest = await self._store.get_manifest(save_id, digest=digest)
        if manifest.layout == "root":
            dest = self._driver.save_root(sandbox_id)
            await asyncio.to_thread(shutil.rmtree, dest, True)
        else:
            dest = self._driver.workspace(sandbox_id)
            with contextlib.suppress(FileNotFoundError):
                dest.rmdir()
        dest.parent.mkdir(parents=True, exist_ok=True)
        stats = await restore(
            self._store,
            manifest,
            dest,
            progress=self._progress(sandbox_id, save_id, "restore"),
            id_offset=self._driver.id_offset(sandbox_id),
            cache=self._cache,
        )
        await asyncio.to_thread(self._driver.restored, sandbox_id)
        # The restored tree has new inodes and times: remembering them as they are on
        # disk lets the next save read only what changed since, not everything.
        self._spool(sandbox_id).mkdir(parents=True, exist_ok=True)
        self._remember(sandbox_id, stats.local_manifest)
        return ev.RestoreReport(
            save_id=save_id,
            restore_ms=round((time.monotonic() - started) * 1000, 1),
            fetched_bytes=stats.fetched_bytes,
            fetched_chunks=stats.fetched_chunks,
            files=stats.files,
            cache_hits=stats.cache_hits,
            cached_bytes=stats.cached_bytes,
        )

    async def _manifest(self, sandbox_id: str, save_id: str | None) -> Manifest | None:
        """The parent manifest: from the local copy, else the store, else none
        (then every file counts as changed, and the store still de-duplicates)."""
        if save_id is None:
            return None
        local = self._spool(sandbox_id) / "manifests" / save_id
        with contextlib.suppress(OSError, msgspec.DecodeError, ValueError):
            return decode_manifest(local.read_bytes())
        with contextlib.suppress(SandholdError):
            return await self._store.get_manifest(save_id)
        return None

    def _remember(self, sandbox_id: str, manifest: Manifest, *, keep: str | None = None) -> None:
        """Keep `manifest` here, as this copy's files are (inodes, times), for the
        next save's walk; with it only `keep` (the parent it was taken from: the
        parent again if this save never completes). Any other, of a save no
        longer the last, would be read again only as a fallback the store gives
        (one a save, kept, filled the spool)."""
        folder = self._spool(sandbox_id) / "manifests"
        # (No spool: forgotten while this save ran, the copy is gone from here.)
        with contextlib.suppress(FileNotFoundError):
            folder.mkdir(exist_ok=True)
            tmp = folder / f".{manifest.save_id}.tmp"
            tmp.write_bytes(encode_manifest(manifest))
            tmp.replace(folder / manifest.save_id)
            for entry in os.scandir(folder):
                if entry.name not in (manifest.save_id, keep) and not entry.name.startswith("."):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)

    def files_held(self, sandbox_id: str, save_id: str) -> bool:
        """Whether nothing runs in the sandbox but its box and every file is as
        the save `save_id` holds them, as this host last captured or restored
        them (its local manifest; none here, unreadable, or a tree of more than
        `LOOK_MAX_NAMES` names: not looked at). A stat walk (`holds`), made in
        the caller's thread: bounded by the cap, it is cheaper than a hop to a
        worker thread, which waits for the GIL behind a busy loop.

        Asked as a command ends (decision 078). Quiet before the walk: no process
        is left that could write behind it; quiet after: none began during it.
        A command launched and ended within the walk is not seen here: the
        service's `files_at_end` refuses the claim then, for its queueing moved
        the sandbox's count after the look."""
        local = self._spool(sandbox_id) / "manifests" / save_id
        try:
            manifest = decode_manifest(local.read_bytes())
            if len(manifest.entries) > LOOK_MAX_NAMES or not self._driver.quiet(sandbox_id):
                return False
            same = holds(
                self._driver.save_root(sandbox_id),
                manifest,
                id_offset=self._driver.id_offset(sandbox_id),
                layout=self._driver.save_layout,
            )
            return same and self._driver.quiet(sandbox_id)
        except (OSError, SandholdError):
            # (No manifest here, a torn one, a cgroup gone while read: not known.)
            return False

    def forget(self, sandbox_id: str) -> None:
        """Drop what this host keeps for the sandbox's saves (its copy is gone)."""
        shutil.rmtree(self._spool(sandbox_id), ignore_errors=True)

    def _progress(self, sandbox_id: str, save_id: str, operation: str):
        subject = f"{self._names.prefix}.progress.{sandbox_id}.{save_id}"
        last = 0.0

        def publish(done: int, total: int) -> None:
            nonlocal last
            now = time.monotonic()
            if now - last < 0.25 and done < total:
                return
            last = now
            body = msgspec.json.encode(Progress(operation, done, total))
            asyncio.ensure_future(self._nc.publish(subject, body))

        return publish
