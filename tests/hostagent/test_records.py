"""How a host's records reach the disk (records.py)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from sandhold.hostagent.driver import records
from sandhold.hostagent.driver.records import write_atomically


def test_a_durable_record_is_whole_and_synced_before_anyone_is_told(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Decision 091: the supervisor rings once the exit record is in place with
    # its content on disk; only the directory's fsync comes after the ring.
    path = tmp_path / "exit.json"
    synced: list[str] = []
    fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append("directory" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        fsync(fd)

    monkeypatch.setattr(records.os, "fsync", recording_fsync)
    told: list[tuple[bytes, list[str]]] = []
    write_atomically(
        path,
        b'{"reason":"exited"}',
        durable=True,
        placed=lambda: told.append((path.read_bytes(), list(synced))),
    )
    assert told == [(b'{"reason":"exited"}', ["file"])]
    assert synced == ["file", "directory"]
    assert [p.name for p in tmp_path.iterdir()] == ["exit.json"]  # no temporary left


def test_a_record_that_need_not_survive_a_power_loss_is_not_synced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[int] = []
    monkeypatch.setattr(records.os, "fsync", synced.append)
    write_atomically(tmp_path / "pid", b"42\n", durable=False)
    assert (tmp_path / "pid").read_bytes() == b"42\n"
    assert synced == []
