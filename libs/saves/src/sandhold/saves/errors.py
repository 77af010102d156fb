"""Errors of the save store. Each says what is wrong and with which save or chunk."""

from __future__ import annotations

from sandhold.domain.errors import InfraError


class SaveStoreError(InfraError):
    """Root of the save store's own errors; not worth retrying unless it says so."""

    def __init__(self, message: str, *, retryable: bool = False) -> None:
        super().__init__(message, retryable=retryable)


class MissingChunk(SaveStoreError):
    """A chunk a manifest names is not in the store."""

    def __init__(self, digest: str) -> None:
        super().__init__(f"chunk {digest} is not in the save store")
        self.digest = digest


class CorruptChunk(SaveStoreError):
    """A chunk's content does not hash to its name (or has the wrong size)."""

    def __init__(self, digest: str, reason: str) -> None:
        super().__init__(f"chunk {digest} is corrupt: {reason}")
        self.digest = digest


class MissingManifest(SaveStoreError):
    """No complete manifest is stored for this save."""

    def __init__(self, save_id: str, reason: str = "not stored") -> None:
        super().__init__(f"manifest of save {save_id}: {reason}")
        self.save_id = save_id


class CorruptManifest(SaveStoreError):
    """A manifest that cannot be decoded, or that describes an impossible tree."""


class ManifestConflict(SaveStoreError):
    """A different manifest is already stored under this save id (manifests are immutable)."""

    def __init__(self, save_id: str) -> None:
        super().__init__(
            f"save {save_id} already has a different manifest; manifests are immutable"
        )
        self.save_id = save_id


class CaptureError(SaveStoreError):
    """The workspace could not be captured (an unreadable file, a bad spool)."""


class RestoreError(SaveStoreError):
    """The destination cannot take a restore (exists and is not empty, ...)."""


class GcAborted(SaveStoreError):
    """Garbage collection stopped before deleting anything: its knowledge was incomplete."""
