"""Which chunks garbage collection may delete: pure."""

from __future__ import annotations

from sandhold.saves import Entry, Manifest, collectable


def saved(*digests: str) -> Manifest:
    return Manifest(
        save_id="sv-1",
        sandbox_id="sb",
        parent_id=None,
        created_at=0.0,
        chunk_size=4,
        entries=[
            Entry(path=b"f%d" % i, kind="file", mode=0o644, size=4, chunks=[d])
            for i, d in enumerate(digests)
        ],
    )


def test_only_old_unreferenced_chunks_are_collectable() -> None:
    now = 10_000.0
    stored = {
        "kept": 0.0,  # old, referenced
        "old": 0.0,  # old, unreferenced: collectable
        "inflight": now - 10,  # unreferenced but recent: a save may still name it
        "edge": now - 100,  # exactly grace old: kept
    }
    assert collectable(stored, [saved("kept")], now=now, grace_s=100) == {"old"}


def test_nothing_retained_means_age_alone_decides() -> None:
    assert collectable({"a": 0.0, "b": 50.0}, [], now=100.0, grace_s=60) == {"a"}
