"""Content-defined cuts and what an entry records of them. Pure, no server."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from sandhold.saves.chunking import Chunker, max_chunk, recorded_lengths


def test_cuts_cover_the_content_and_stay_within_their_bounds(tmp_path: Path) -> None:
    data = os.urandom(3 * 1024 * 1024 + 5)
    (tmp_path / "f").write_bytes(data)
    chunker = Chunker(64 * 1024)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        cut = [(digest, bytes(view)) for digest, view in chunker.cut(fd)]
    finally:
        os.close(fd)
    assert b"".join(piece for _, piece in cut) == data
    assert all(digest == hashlib.sha256(piece).hexdigest() for digest, piece in cut)
    lengths = [len(piece) for _, piece in cut]
    assert all(16 * 1024 <= n <= max_chunk(64 * 1024) for n in lengths[:-1])


@pytest.mark.parametrize(
    "lengths, size, recorded",
    [
        ([1000], 1000, []),  # one piece no longer than chunk_size: the fixed layout
        ([300_000], 300_000, [300_000]),  # the fixed layout would be two pieces
        ([262_144, 100], 262_244, []),
        ([200_000, 62_244], 262_244, [200_000, 62_244]),
        ([], 0, []),
    ],
)
def test_lengths_are_recorded_where_they_are_not_the_fixed_layout(
    lengths: list[int], size: int, recorded: list[int]
) -> None:
    assert recorded_lengths(lengths, size, 262_144) == recorded


def test_an_average_too_small_to_cut_by_is_refused() -> None:
    with pytest.raises(ValueError, match="under 1024"):
        Chunker(4)
