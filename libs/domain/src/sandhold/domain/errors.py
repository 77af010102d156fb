"""The error tree: one root, refusals carry a machine-readable code."""

from __future__ import annotations


class SandholdError(Exception):
    """Root of every error sandhold raises on purpose."""


class Rejected(SandholdError):
    """A request the domain refuses. `code` is stable; `message` is for people."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class InfraError(SandholdError):
    """Something outside the domain failed; `retryable` says whether to try again."""

    def __init__(self, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable
