"""What the host makes in a sandbox's persistent root before it starts, and
what it gives to the sandbox after a restore: never through what the
sandbox's root put in their place (a whiteout of a directory it removed, a
symlink to a host path), on a real file system, as the host's root."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from sandhold.hostagent.driver.rootfs import (
    USER_HOME,
    USER_UID,
    Base,
    SandboxFs,
    claim_host_files,
    prepare,
)

OFFSET = 2_000_000
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="chown needs the host's root")


@pytest.fixture
def fs(tmp_path: Path) -> SandboxFs:
    skeleton = tmp_path / "skeleton"
    (skeleton / "workspace").mkdir(parents=True)
    sandbox = SandboxFs(tmp_path / "fs")
    prepare(sandbox, Base(skeleton, []), OFFSET)
    return sandbox


def _host_dir(tmp_path: Path) -> Path:
    """A host directory with a file, both the host root's."""
    target = tmp_path / "host-owned"
    target.mkdir()
    (target / "secret").write_text("host")
    return target


def test_a_fresh_root_gets_a_workspace_and_a_home_of_the_sandbox_user(fs: SandboxFs) -> None:
    home = fs.upper / "root" / USER_HOME.lstrip("/")
    assert (fs.workspace.stat().st_uid, home.stat().st_uid) == (OFFSET + USER_UID,) * 2
    assert home.parent.stat().st_uid == OFFSET


def test_a_workspace_the_sandbox_removed_stays_removed(fs: SandboxFs, tmp_path: Path) -> None:
    """Its root removed /workspace: the overlay left a whiteout. A restart must
    not fail on it (the sandbox would never start again), nor bring it back."""
    fs.workspace.rmdir()
    os.mknod(fs.workspace, stat.S_IFCHR | 0o000, os.makedev(0, 0))
    prepare(fs, Base(tmp_path / "skeleton", []), OFFSET)
    assert stat.S_ISCHR(os.lstat(fs.workspace).st_mode)


def test_nothing_is_chowned_through_a_symlink_the_sandbox_planted(
    fs: SandboxFs, tmp_path: Path
) -> None:
    target = _host_dir(tmp_path)
    home_parent = fs.upper / "root" / "home"
    for planted in (fs.workspace, home_parent):
        if planted.is_dir() and not planted.is_symlink():
            for child in planted.iterdir():
                child.rmdir()
            planted.rmdir()
        planted.symlink_to(target)
    prepare(fs, Base(tmp_path / "skeleton", []), OFFSET)
    claim_host_files(fs, OFFSET)
    assert target.stat().st_uid == 0 and (target / "secret").stat().st_uid == 0
    assert not (target / "sandbox").exists(), "no home made through the symlink"
    assert fs.workspace.is_symlink() and home_parent.is_symlink()


def test_files_a_restore_wrote_are_given_to_the_sandbox_user(fs: SandboxFs) -> None:
    (fs.workspace / "restored").write_text("seed")
    os.chown(fs.workspace / "restored", 0, 0)
    claim_host_files(fs, OFFSET)
    assert (fs.workspace / "restored").stat().st_uid == OFFSET + USER_UID
