"""The save store: capture a workspace, upload its chunks, verify, restore, collect garbage."""

from sandhold.saves._spool import clear_spool
from sandhold.saves.cache import DEFAULT_CACHE_BYTES, ChunkCache
from sandhold.saves.capture import (
    DEFAULT_EXCLUDE,
    Capture,
    capture,
    finish_capture,
    holds,
)
from sandhold.saves.chunking import DEFAULT_CHUNK_SIZE
from sandhold.saves.errors import (
    CaptureError,
    CorruptChunk,
    CorruptManifest,
    GcAborted,
    ManifestConflict,
    MissingChunk,
    MissingManifest,
    RestoreError,
    SaveStoreError,
)
from sandhold.saves.gc import GcStats, collect_garbage, collectable, delete_unretained_manifests
from sandhold.saves.manifest import (
    Entry,
    Manifest,
    decode_manifest,
    encode_manifest,
    same_files,
)
from sandhold.saves.restore import RestoreStats, restore
from sandhold.saves.store import Progress, SaveStore, UploadStats
from sandhold.saves.storing import store_capture

__all__ = [
    "DEFAULT_CACHE_BYTES",
    "ChunkCache",
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_EXCLUDE",
    "Capture",
    "CaptureError",
    "CorruptChunk",
    "CorruptManifest",
    "Entry",
    "GcAborted",
    "GcStats",
    "Manifest",
    "ManifestConflict",
    "MissingChunk",
    "MissingManifest",
    "Progress",
    "RestoreError",
    "RestoreStats",
    "SaveStore",
    "SaveStoreError",
    "UploadStats",
    "capture",
    "clear_spool",
    "finish_capture",
    "holds",
    "collect_garbage",
    "delete_unretained_manifests",
    "collectable",
    "decode_manifest",
    "encode_manifest",
    "same_files",
    "restore",
    "store_capture",
]
