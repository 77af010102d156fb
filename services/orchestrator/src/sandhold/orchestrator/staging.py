"""Staging: the repository at the ref, checked out here and stored as a seed save.

The checkout becomes the sandbox's first save in the content-addressed store
(the same store every save lives in): the host restores it into the
workspace when the sandbox is placed, and again after a host failure if no
later save exists. Two tasks on the same repository share its chunks.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path

import msgspec
from sandhold.saves import SaveStore, capture
from sandhold.saves.manifest import SANDBOX_USER_ID, Entry, Manifest


class Staged(msgspec.Struct, frozen=True):
    seed_save_id: str
    files: int
    bytes: int
    manifest_digest: str  # SHA-256 of the manifest as stored: the one the sandbox restores


async def store_seed(
    store: SaveStore, checkout: Path, *, save_id: str, sandbox_id: str, spool: Path
) -> Staged:
    """Capture `checkout` as save `save_id` of `sandbox_id` and store it."""
    shutil.rmtree(spool, ignore_errors=True)
    try:
        captured = await asyncio.to_thread(
            capture,
            checkout,
            save_id=save_id,
            sandbox_id=sandbox_id,
            previous=None,
            spool=spool,
            now=time.time(),
            exclude=frozenset(),
        )
        manifest = owned_by_the_sandbox_user(captured.manifest)
        await store.upload(captured.new_chunks)
        _, digest = await store.put_manifest(manifest)
    finally:
        shutil.rmtree(spool, ignore_errors=True)
    return Staged(save_id, manifest.files, manifest.total_bytes, digest)


def owned_by_the_sandbox_user(manifest: Manifest) -> Manifest:
    """The checkout is the agent's to change: every entry belongs to the sandbox's user.

    Cloned here by this service's own user, it would otherwise be restored as
    the sandbox's root's (or as an id the sandbox does not map at all).
    """
    owner = SANDBOX_USER_ID

    def own(entry: Entry) -> Entry:
        return msgspec.structs.replace(entry, uid=owner, gid=owner)

    root = None if manifest.root is None else own(manifest.root)
    return msgspec.structs.replace(
        manifest, entries=[own(entry) for entry in manifest.entries], root=root
    )
