"""An overlay's upper directory saved and restored: owners across namespaces,
whiteouts, opaque directories, hard links, and a real overlayfs mounted on top."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from sandhold.saves import (
    Capture,
    CorruptManifest,
    Entry,
    Manifest,
    RestoreError,
    SaveStore,
    capture,
    restore,
)
from sandhold.saves.capture import RACY_WINDOW_S

from tests.saves.conftest import tree, write

SLOT_1 = 1_000_000 + 1 * 65536
SLOT_3 = 1_000_000 + 3 * 65536
FILE_CAPABILITY = bytes.fromhex("0100000200200000000000000000000000000000")  # cap_net_raw+ep


@pytest.fixture
def overlay_prefix(tmp_path: Path) -> str:
    """Where overlay xattrs live: `trusted.overlay.` as overlayfs mounted by host root
    writes them; `user.overlay.` (an overlay in a user namespace) where the test's
    file system refuses trusted.* xattrs."""
    probe = tmp_path / "xattr-probe"
    probe.touch()
    try:
        os.setxattr(probe, "trusted.overlay.probe", b"y")
    except OSError as err:
        if err.errno not in (errno.EPERM, errno.ENOTSUP):
            raise
        return "user.overlay."
    finally:
        probe.unlink()
    return "trusted.overlay."


async def save(
    store: SaveStore, upper: Path, spool: Path, save_id: str, *, id_offset: int = 0
) -> Capture:
    result = capture(
        upper,
        save_id=save_id,
        sandbox_id="sb-1",
        previous=None,
        spool=spool,
        now=time.time() + RACY_WINDOW_S,
        id_offset=id_offset,
    )
    await store.upload(result.new_chunks)
    await store.put_manifest(result.manifest)
    return result


def owners(root: Path) -> dict[bytes, tuple[int, int]]:
    root_b = os.fsencode(root)
    found = {b"": (os.lstat(root_b).st_uid, os.lstat(root_b).st_gid)}
    for dirpath, dirnames, filenames in os.walk(root_b):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            found[os.path.relpath(path, root_b)] = (st.st_uid, st.st_gid)
    return found


async def test_owners_move_from_one_namespace_to_another(
    store: SaveStore, tmp_path: Path, spool: Path
) -> None:
    upper = tmp_path / "upper"
    (upper / "home").mkdir(parents=True)
    write(upper / "home" / "notes", b"agent's", mode=0o600)
    os.symlink("notes", upper / "home" / "link")
    os.mkfifo(upper / "home" / "pipe")
    os.mknod(upper / "gone", stat.S_IFCHR, os.makedev(0, 0))
    write(upper / "stray", b"owned by a host id")
    for rel, inside in [("", 0), ("home", 1000), ("home/notes", 1000), ("home/link", 1000)]:
        os.chown(upper / rel, SLOT_1 + inside, SLOT_1 + inside + 1, follow_symlinks=False)
    os.chown(upper / "home" / "pipe", SLOT_1 + 65535, SLOT_1)
    os.chown(upper / "gone", SLOT_1, SLOT_1)
    os.chown(upper / "stray", 4242, SLOT_1 + 5)  # uid outside the namespace: unknown

    saved = await save(store, upper, spool, "sv-ids", id_offset=SLOT_1)
    dest = tmp_path / "restored"
    await restore(store, saved.manifest, dest, id_offset=SLOT_3)

    assert owners(dest) == {
        b"": (SLOT_3, SLOT_3 + 1),
        b"home": (SLOT_3 + 1000, SLOT_3 + 1001),
        b"home/notes": (SLOT_3 + 1000, SLOT_3 + 1001),
        b"home/link": (SLOT_3 + 1000, SLOT_3 + 1001),
        b"home/pipe": (SLOT_3 + 65535, SLOT_3),
        b"gone": (SLOT_3, SLOT_3),
        b"stray": (0, SLOT_3 + 5),  # the unknown uid is left to the restorer (root)
    }
    assert tree(dest) == tree(upper)

    # Back to the first namespace: the same owners as where the save was taken.
    again = await save(store, dest, spool, "sv-ids-2", id_offset=SLOT_3)
    back = tmp_path / "back"
    await restore(store, again.manifest, back, id_offset=SLOT_1)
    assert owners(back) == owners(upper) | {b"stray": (0, SLOT_1 + 5)}


async def test_an_id_outside_the_namespace_is_never_shifted_into_another(
    store: SaveStore, tmp_path: Path, spool: Path
) -> None:
    upper = tmp_path / "upper"
    upper.mkdir()
    write(upper / "f", b"x")
    os.chown(upper / "f", SLOT_1 + 1000, SLOT_1 + 1000)
    saved = await save(store, upper, spool, "sv-host-ids")  # no offset: host ids recorded
    await restore(store, saved.manifest, tmp_path / "plain")
    assert owners(tmp_path / "plain")[b"f"] == (SLOT_1 + 1000, SLOT_1 + 1000)
    await restore(store, saved.manifest, tmp_path / "shifted", id_offset=SLOT_3)
    assert owners(tmp_path / "shifted")[b"f"] == (0, 0)


async def test_whiteouts_and_opaque_directories_round_trip(
    store: SaveStore, tmp_path: Path, spool: Path, overlay_prefix: str
) -> None:
    upper = tmp_path / "upper"
    (upper / "replaced").mkdir(parents=True)
    write(upper / "replaced" / "new", b"the lower dir's files are hidden")
    os.setxattr(upper / "replaced", overlay_prefix + "opaque", b"y")
    os.setxattr(upper / "replaced" / "new", "user.note", b"\x00binary\xff")
    os.mknod(upper / "deleted", stat.S_IFCHR, os.makedev(0, 0))
    os.mknod(upper / "replaced" / "also-deleted", stat.S_IFCHR, os.makedev(0, 0))
    (upper / "renamed").mkdir()
    os.setxattr(upper / "renamed", overlay_prefix + "redirect", b"/old-name")
    os.setxattr(upper, "user.workspace", b"root xattr")

    saved = await save(store, upper, spool, "sv-overlay")
    kinds = {e.path: e.kind for e in saved.manifest.entries}
    assert kinds[b"deleted"] == kinds[b"replaced/also-deleted"] == "whiteout"
    dest = tmp_path / "restored"
    stats = await restore(store, saved.manifest, dest)

    assert tree(dest) == tree(upper)
    assert os.stat(dest / "deleted").st_rdev == 0
    assert stat.S_ISCHR(os.stat(dest / "deleted").st_mode)
    assert os.getxattr(dest / "replaced", overlay_prefix + "opaque") == b"y"
    assert os.getxattr(dest / "replaced" / "new", "user.note") == b"\x00binary\xff"
    assert stats.whiteouts == 2 and stats.dirs == 2


async def test_hard_links_share_an_inode_again(
    store: SaveStore, tmp_path: Path, spool: Path
) -> None:
    upper = tmp_path / "upper"
    (upper / "d").mkdir(parents=True)
    write(upper / "a", b"one inode, three names", mode=0o640)
    os.link(upper / "a", upper / "b")
    os.link(upper / "a", upper / "d" / "c")
    os.setxattr(upper / "a", "user.kept", b"once")
    os.utime(upper / "a", ns=(1_500_000_000_000_000_000,) * 2)

    saved = await save(store, upper, spool, "sv-links")
    dest = tmp_path / "restored"
    stats = await restore(store, saved.manifest, dest)

    inodes = {os.stat(dest / name).st_ino for name in ("a", "b", "d/c")}
    assert len(inodes) == 1 and os.stat(dest / "a").st_nlink == 3
    assert tree(dest) == tree(upper)
    assert stats.files == 1 and stats.hardlinks == 2
    assert stats.fetched_chunks == 1

    # The first capture after the restore reuses the restored file, links included.
    after = capture(
        dest,
        save_id="sv-links-2",
        sandbox_id="sb-1",
        previous=stats.local_manifest,
        spool=spool,
        now=time.time(),
    )
    assert after.changed_files == 0
    assert [(e.path, e.kind) for e in after.manifest.entries] == [
        (b"a", "file"),
        (b"b", "hardlink"),
        (b"d", "dir"),
        (b"d/c", "hardlink"),
    ]


async def test_security_xattrs_do_not_travel(store: SaveStore, tmp_path: Path, spool: Path) -> None:
    upper = tmp_path / "upper"
    upper.mkdir()
    write(upper / "ping", b"\x7fELF...", mode=0o755)
    os.setxattr(upper / "ping", "security.capability", FILE_CAPABILITY)
    os.setxattr(upper / "ping", "user.kept", b"yes")

    saved = await save(store, upper, spool, "sv-caps")
    dest = tmp_path / "restored"
    await restore(store, saved.manifest, dest)
    assert os.listxattr(dest / "ping") == ["user.kept"]

    # Nor does a manifest that names one restore at all.
    (ping,) = saved.manifest.entries
    forged = msgspec.structs.replace(
        saved.manifest,
        entries=[
            msgspec.structs.replace(
                ping, xattrs={**ping.xattrs, b"security.capability": FILE_CAPABILITY}
            )
        ],
    )
    with pytest.raises(CorruptManifest, match="'security.capability' is not one a save may"):
        await restore(store, forged, tmp_path / "forged")
    assert not (tmp_path / "forged").exists()


async def test_a_malformed_link_is_refused_before_anything_is_written(
    store: SaveStore, tmp_path: Path
) -> None:
    evil = Manifest(
        save_id="sv-evil-link",
        sandbox_id="sb",
        parent_id=None,
        created_at=0.0,
        chunk_size=4,
        entries=[Entry(path=b"passwd", kind="hardlink", mode=0o644, link_to=b"../../etc/passwd")],
    )
    with pytest.raises(CorruptManifest, match="not an earlier file entry"):
        await restore(store, evil, tmp_path / "dest")
    assert os.listdir(tmp_path) == []


async def test_an_xattr_the_destination_refuses_fails_the_restore(
    store: SaveStore, tmp_path: Path
) -> None:
    # Linux allows no user.* xattr on a symlink: a file system refusing an xattr.
    refused = Manifest(
        save_id="sv-refused",
        sandbox_id="sb",
        parent_id=None,
        created_at=0.0,
        chunk_size=4,
        entries=[
            Entry(path=b"l", kind="symlink", mode=0o777, target=b"x", xattrs={b"user.x": b""})
        ],
    )
    with pytest.raises(RestoreError, match="refuses xattr user.x on .*/l"):
        await restore(store, refused, tmp_path / "dest")
    assert os.listdir(tmp_path) == []  # no destination, no staging left


@pytest.fixture
def overlay(tmp_path: Path) -> Iterator[OverlayMounts]:
    mounts = OverlayMounts(tmp_path)
    try:
        yield mounts
    finally:
        mounts.unmount_all()


class OverlayMounts:
    """Real overlayfs mounts under the test's directory, unmounted at the end."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.mounted: list[Path] = []

    def mount(self, lower: Path, upper: Path, name: str) -> Path:
        work = self.base / f"{name}-work"
        merged = self.base / f"{name}-merged"
        work.mkdir()
        merged.mkdir()
        options = f"lowerdir={lower},upperdir={upper},workdir={work}"
        done = subprocess.run(
            ["mount", "-t", "overlay", "overlay", "-o", options, str(merged)],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            if "permission denied" in done.stderr.lower() or os.geteuid() != 0:
                pytest.skip(f"mounting an overlay is not permitted here (EPERM): {done.stderr}")
            raise AssertionError(f"mount -t overlay failed: {done.stderr}")
        self.mounted.append(merged)
        return merged

    def unmount(self, merged: Path) -> None:
        subprocess.run(["umount", str(merged)], check=True)
        self.mounted.remove(merged)

    def unmount_all(self) -> None:
        for merged in list(self.mounted):
            subprocess.run(["umount", "-l", str(merged)], check=False)


async def test_a_real_overlay_shows_the_same_view_after_restore(
    store: SaveStore, tmp_path: Path, spool: Path, overlay: OverlayMounts
) -> None:
    lower = tmp_path / "lower"
    (lower / "dir" / "sub").mkdir(parents=True)
    write(lower / "deleted.txt", b"deleted through the mount")
    write(lower / "kept.txt", b"untouched lower file")
    write(lower / "edited.txt", b"lower version")
    write(lower / "dir" / "old", b"hidden once dir is replaced")
    write(lower / "dir" / "sub" / "deeper", b"hidden too")
    upper = tmp_path / "upper"
    upper.mkdir()

    merged = overlay.mount(lower, upper, "first")
    os.unlink(merged / "deleted.txt")
    subprocess.run(["rm", "-rf", str(merged / "dir")], check=True)
    (merged / "dir").mkdir()
    write(merged / "dir" / "new", b"the replacement's only file")
    write(merged / "edited.txt", b"upper version")
    write(merged / "linked", b"two names")
    os.link(merged / "linked", merged / "dir" / "also-linked")
    os.mkfifo(merged / "pipe")
    view = tree(merged)
    overlay.unmount(merged)

    saved = await save(store, upper, spool, "sv-real-overlay")
    by_path = {e.path: e for e in saved.manifest.entries}
    assert by_path[b"deleted.txt"].kind == "whiteout"  # what overlayfs made of the unlink
    assert any(name.endswith(b".overlay.opaque") for name in by_path[b"dir"].xattrs)
    assert by_path[b"dir/also-linked"].kind == "hardlink"
    assert b"kept.txt" not in by_path

    fresh = tmp_path / "fresh-upper"
    await restore(store, saved.manifest, fresh)
    remounted = overlay.mount(lower, fresh, "second")
    assert tree(remounted) == view
    assert sorted(os.listdir(remounted / "dir")) == ["also-linked", "new"]
    assert not (remounted / "deleted.txt").exists()
    assert (remounted / "kept.txt").read_bytes() == b"untouched lower file"
    assert (remounted / "edited.txt").read_bytes() == b"upper version"
