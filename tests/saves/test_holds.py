"""`holds`: whether a workspace is still as a save holds it, by a stat walk alone
(decision 078). It must say "unchanged" exactly where a capture's `same_files`
would, and never read or write a file. No server."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from sandhold.saves import Manifest, capture, holds, same_files
from sandhold.saves.capture import RACY_WINDOW_S

from tests.saves.conftest import write


def _save(workspace: Path, spool: Path, now: float) -> Manifest:
    return capture(
        workspace, save_id="sv-1", sandbox_id="sb", previous=None, spool=spool / "1", now=now
    ).manifest


def _tree(workspace: Path) -> None:
    write(workspace / "a", b"first")
    (workspace / "src").mkdir()
    write(workspace / "src" / "main.py", b"print('hi')\n")
    os.symlink("src/main.py", workspace / "link")
    (workspace / "tmp").mkdir()
    write(workspace / "tmp" / "scratch", b"never saved")  # an excluded name


def _captured_again_is_unchanged(workspace: Path, spool: Path, saved: Manifest) -> bool:
    again = capture(
        workspace,
        save_id="sv-2",
        sandbox_id="sb",
        previous=saved,
        spool=spool / "2",
        now=time.time(),
        defer_hashing=True,
    )
    return same_files(saved, again.manifest)


def test_an_untouched_tree_is_held(workspace: Path, spool: Path) -> None:
    _tree(workspace)
    saved = _save(workspace, spool, time.time() + RACY_WINDOW_S + 1)
    assert holds(workspace, saved)
    # Excluded names change freely (temporary mounts, delivered credentials).
    write(workspace / "tmp" / "scratch", b"changed")
    assert holds(workspace, saved)
    assert _captured_again_is_unchanged(workspace, spool, saved)


def _append(path: Path, data: bytes) -> None:
    with path.open("ab") as f:
        f.write(data)


CHANGES: dict[str, Callable[[Path], object]] = {
    "a file rewritten, same size": lambda w: write(w / "a", b"FIRST"),
    "a file appended to": lambda w: _append(w / "a", b"!"),
    "a file added": lambda w: write(w / "src" / "new.py", b""),
    "a file removed": lambda w: (w / "a").unlink(),
    "a mode changed": lambda w: os.chmod(w / "src" / "main.py", 0o755),
    "a link retargeted": lambda w: ((w / "link").unlink(), os.symlink("a", w / "link")),
    "a directory added": lambda w: (w / "build").mkdir(),
    "only touched": lambda w: os.utime(w / "a"),
    "an xattr set": lambda w: os.setxattr(w / "a", b"user.note", b"x"),
}


@pytest.mark.parametrize("change", CHANGES)
def test_any_change_a_capture_would_see_is_not_held(
    change: str, workspace: Path, spool: Path
) -> None:
    _tree(workspace)
    saved = _save(workspace, spool, time.time() + RACY_WINDOW_S + 1)
    time.sleep(0.05)  # past the file system's timestamp tick
    CHANGES[change](workspace)
    assert not holds(workspace, saved)
    assert not _captured_again_is_unchanged(workspace, spool, saved)


def test_a_file_written_in_the_racy_window_of_the_save_is_not_held(
    workspace: Path, spool: Path
) -> None:
    """Written within a timestamp tick of the save's capture, a later write may
    keep its stat: a capture reads it again, so the look does not trust it."""
    _tree(workspace)
    saved = _save(workspace, spool, time.time())
    assert not holds(workspace, saved)


def test_a_save_of_another_layout_is_not_held(workspace: Path, spool: Path) -> None:
    _tree(workspace)
    saved = _save(workspace, spool, time.time() + RACY_WINDOW_S + 1)
    assert holds(workspace, saved, layout="workspace")
    assert not holds(workspace, saved, layout="root")
