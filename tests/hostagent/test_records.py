"""How a host's records reach the disk (records.py)."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import stat
from pathlib import Path

import pytest
from sandhold.hostagent.driver import records, supervisor
from sandhold.hostagent.driver.handle import CommandHandle
from sandhold.hostagent.driver.layout import CommandPaths
from sandhold.hostagent.driver.records import CommandExit, CommandSpec, read_exit, write_atomically
from sandhold.hostagent.driver.supervisor import Supervisor


def test_a_durable_record_is_told_whole_then_synced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Decision 094: the supervisor rings once the exit record is in place under
    # its name, whole; the file's and the directory's fsyncs come after the ring.
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
    assert told == [(b'{"reason":"exited"}', [])]
    assert synced == ["file", "directory"]
    assert [p.name for p in tmp_path.iterdir()] == ["exit.json"]  # no temporary left


def test_a_durable_record_nobody_is_told_of_is_synced_before_its_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (A launch failure's record, written by the agent: a power loss leaves the
    # old name or the whole file.)
    path = tmp_path / "exit.json"
    seen: list[tuple[str, bool]] = []
    fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        kind = "directory" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"
        seen.append((kind, path.exists()))
        fsync(fd)

    monkeypatch.setattr(records.os, "fsync", recording_fsync)
    write_atomically(path, b'{"reason":"launch_failed"}', durable=True)
    assert seen == [("file", False), ("directory", True)]
    assert path.read_bytes() == b'{"reason":"launch_failed"}'


@pytest.mark.parametrize(
    "left", [b"", b'{"reason":"exi', b"\0" * 64], ids=["empty", "cut", "zeros"]
)
def test_a_record_a_power_loss_left_without_content_is_no_record(
    tmp_path: Path, left: bytes
) -> None:
    # What the name may hold after a power loss between the rename and the fsync:
    # the command then ended as one whose record was never made.
    (tmp_path / "exit.json").write_bytes(left)
    assert read_exit(tmp_path / "exit.json") is None


def test_a_record_that_need_not_survive_a_power_loss_is_not_synced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[int] = []
    monkeypatch.setattr(records.os, "fsync", synced.append)
    write_atomically(tmp_path / "pid", b"42\n", durable=False)
    assert (tmp_path / "pid").read_bytes() == b"42\n"
    assert synced == []


def _supervisor(tmp_path: Path) -> Supervisor:
    spec = CommandSpec(sandbox_id="sb", command_id="c1", argv=["true"], cwd=str(tmp_path), env={})
    return Supervisor(CommandPaths(tmp_path), spec, wakeup=-1)


@pytest.mark.parametrize("failing", ["file", "directory"])
def test_an_exit_whose_fsync_fails_after_the_ring_is_still_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    # The agent was told (it may have handed over the next command already): the
    # supervisor must not fail over an fsync after the ring (decisions 091, 094).
    rung: list[bytes] = []
    monkeypatch.setattr(
        supervisor, "ring", lambda: rung.append((tmp_path / "exit.json").read_bytes())
    )
    fsync = os.fsync

    def failing_fsync(fd: int) -> None:
        if ("directory" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file") == failing:
            raise OSError(errno.EIO, "I/O error")
        fsync(fd)

    monkeypatch.setattr(records.os, "fsync", failing_fsync)
    _supervisor(tmp_path).finish(CommandExit(reason="exited", exit_code=0))
    assert len(rung) == 1
    assert read_exit(tmp_path / "exit.json") == CommandExit.from_json(json.loads(rung[0]))


def test_an_exit_that_cannot_be_written_tells_no_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rung: list[None] = []
    monkeypatch.setattr(supervisor, "ring", lambda: rung.append(None))

    def failing(fd: int, data: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(records.os, "write", failing)
    with pytest.raises(OSError):
        _supervisor(tmp_path).finish(CommandExit(reason="exited", exit_code=0))
    assert rung == []
    assert not (tmp_path / "exit.json").exists()


@pytest.mark.parametrize("left", [b"", b"12", b"\0" * 8], ids=["empty", "cut", "zeros"])
def test_a_pid_file_a_power_loss_left_without_content_is_no_pid(
    tmp_path: Path, left: bytes
) -> None:
    (tmp_path / "pid").write_bytes(left)
    assert records.read_pid(tmp_path / "pid") is None
    (tmp_path / "pid").write_bytes(b"12\n")
    assert records.read_pid(tmp_path / "pid") == 12


async def test_a_command_whose_records_a_power_loss_emptied_ended_unknown(tmp_path: Path) -> None:
    # Exit record, supervisor record and pid file were all in place but not yet
    # synced (decision 094): after the restart the command is one whose record
    # was never made, not a failure of whoever reads them.
    paths = CommandPaths(tmp_path)
    for path in (paths.exit, paths.supervisor, paths.pid):
        path.write_bytes(b"")
    handle = CommandHandle("sb", "c1", paths, poll_interval_s=0.01)
    end = await asyncio.wait_for(handle.wait(), 30)
    assert end.reason == "unknown"
    assert isinstance(await handle.started(), CommandExit)
