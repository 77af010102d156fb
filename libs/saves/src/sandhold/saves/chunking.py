"""Cutting a file into chunks where its content says, not every `chunk_size` bytes.

With fixed-size chunks one byte inserted near the start of a large file
shifts every later chunk, and the next save uploads the whole file again.
Content-defined chunking (FastCDC 2020: a gear hash over the bytes, a cut where
its low bits are zero) puts the cuts at the same content wherever it moved, so
such an edit re-uploads only the chunks around it (decision 041). The cutting
runs in C with the GIL released; a chunk is named by its SHA-256 as before.

Cuts: never shorter than a quarter of the average, never longer than three
averages (the default average, 256 KiB, keeps every chunk under the server's
1 MiB message limit). The last piece of a file may be shorter.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Iterator

from pyfastcdc import FastCDC

DEFAULT_CHUNK_SIZE = 256 * 1024
MIN_AVERAGE = 1024  # FastCDC's own bounds start below this; smaller makes no sense here


def max_chunk(average: int) -> int:
    return average * 3


class Chunker:
    """Cuts and hashes one file at a time (not for concurrent use)."""

    def __init__(self, average: int = DEFAULT_CHUNK_SIZE) -> None:
        if average < MIN_AVERAGE:
            raise ValueError(f"an average chunk size under {MIN_AVERAGE} bytes: {average}")
        self.average = average
        self._cdc = FastCDC(average, min_size=average // 4, max_size=max_chunk(average))

    def cut(self, fd: int) -> Iterator[tuple[str, memoryview]]:
        """(sha256 hex, bytes) of each chunk of what `fd` holds from its offset on.

        Each view is valid only until the next chunk is asked for: copy what
        must outlive it. `fd` is not closed.
        """
        reader = io.FileIO(fd, "rb", closefd=False)
        for chunk in self._cdc.cut_stream(reader):
            yield hashlib.sha256(chunk.data).hexdigest(), chunk.data


def recorded_lengths(lengths: list[int], size: int, chunk_size: int) -> list[int]:
    """What an entry records of its chunks' lengths: nothing when they are the
    fixed layout (`chunk_size` each, the last the rest), which is what a small
    file's single chunk is and what every save before content-defined cuts was."""
    fixed = fixed_lengths(-(-size // chunk_size), size, chunk_size)
    return [] if lengths == fixed else lengths


def fixed_lengths(count: int, size: int, chunk_size: int) -> list[int]:
    """`count` pieces of `chunk_size`, the last the rest: what an entry without
    `lengths` means (with the count the size needs, see `entry_problems`)."""
    if count == 0:
        return []
    return [chunk_size] * (count - 1) + [size - chunk_size * (count - 1)]
