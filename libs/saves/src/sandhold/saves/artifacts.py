"""A task's artifacts, read back from its final Snapshot in the save store.

One reader for `sandhold task artifact` and the console's download, so both
find a file, and refuse one, the same way."""

from __future__ import annotations

from collections.abc import AsyncIterator

from sandhold.domain.errors import Rejected
from sandhold.domain.events import Artifact
from sandhold.saves.manifest import Entry
from sandhold.saves.store import SaveStore


async def artifact_entry(
    store: SaveStore, task_id: str, artifacts: list[Artifact], path: str
) -> Entry:
    """The Snapshot's entry for the artifact at `path`, among the task's `artifacts`.

    Raises:
        Rejected: `artifact_not_found`, not an artifact of the task or not in its Snapshot.
        SaveStoreError: the manifest cannot be read.
    """
    found = next((a for a in artifacts if a.path == path), None)
    if found is None:
        raise Rejected("artifact_not_found", f"task {task_id} has no artifact {path!r}")
    manifest = await store.get_manifest(found.save_id)
    entry = next(
        (e for e in manifest.workspace_entries() if e.path.decode("utf-8", "replace") == path),
        None,
    )
    if entry is None:
        raise Rejected("artifact_not_found", f"{path!r} is not in the snapshot {found.save_id}")
    return entry


async def entry_chunks(store: SaveStore, entry: Entry) -> AsyncIterator[bytes]:
    """The entry's content chunk by chunk, each checked against its digest: a
    large artifact is sent on as it is read, never held whole."""
    for digest in entry.chunks:
        yield await store.get_chunk(digest)


async def read_artifact(
    store: SaveStore, task_id: str, artifacts: list[Artifact], path: str
) -> bytes:
    """The artifact's bytes, whole (see `artifact_entry` for what it raises)."""
    entry = await artifact_entry(store, task_id, artifacts, path)
    return b"".join([chunk async for chunk in entry_chunks(store, entry)])
