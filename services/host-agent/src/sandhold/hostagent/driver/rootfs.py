"""A namespaced sandbox's root: a read-only base under a persistent upper layer.

The default base is the host's own programs and libraries (``/usr`` and the
top-level ``/bin``, ``/lib*``, ``/sbin``, which are links into ``/usr`` on a
merged-usr system) and a minimal ``/etc`` built here, never the host's: no
host users, no host secrets, no host configuration beyond what programs need
to start (the dynamic linker's cache, CA certificates, Debian's
alternatives). An image (``--image DIR``) replaces all of that with one
directory. Either way the sandbox writes only into its upper layer:

    <sandbox>/fs/upper/root   what the sandbox changed in its root (the workspace too)
    <sandbox>/fs/upper/usr    what it changed under a host directory such as /usr
    <sandbox>/fs/work/...     overlayfs's own scratch space, one per upper

``fs/upper`` is the persistent part: a save carries it and a restore on
another host brings it back. ``/tmp`` and ``/run`` are tmpfs inside.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

from sandhold.saves.manifest import SANDBOX_USER_ID

# Where the workspace is, inside the sandbox's root.
WORKSPACE = "/workspace"
# The sandbox's users: root (0) and the unprivileged user commands run as by default.
USER_UID = SANDBOX_USER_ID
USER_NAME = "sandbox"
USER_HOME = "/home/sandbox"
# Every sandbox maps 65536 ids (0..65535 inside) onto its own host range.
ID_COUNT = 65536
_ID_BASE = 1_000_000
_ID_SLOTS = 60_000  # keeps the highest host id well below 2**32

# Host top-level directories that may form the default base.
_HOST_TOP = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
# Entries of the host's /etc copied into the default base's /etc (links kept as links).
_HOST_ETC = (
    "alternatives", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "ssl", "ca-certificates",
    "ca-certificates.conf", "nsswitch.conf", "localtime", "os-release", "debian_version",
    "profile", "bash.bashrc", "inputrc", "mime.types", "services", "protocols", "shells",
    "host.conf", "gai.conf", "environment", "magic", "login.defs", "xattr.conf",
)  # fmt: skip
_SKELETON_DIRS = (
    "dev", "proc", "sys", "tmp", "run", "etc", "root", "home", "var/tmp", "var/lib",
    "var/cache", "opt", "srv", "mnt", WORKSPACE.lstrip("/"), USER_HOME.lstrip("/"),
)  # fmt: skip


@dataclass(frozen=True)
class Overlay:
    """One overlay mount of the sandbox's root: ``lower`` under ``upper`` at ``target``."""

    target: str  # inside the sandbox, "/" first
    lower: str  # host path, read-only
    upper: str  # host path, the saved part
    work: str  # host path, overlayfs's work dir (same file system as upper)


@dataclass(frozen=True)
class SandboxFs:
    """The host paths of one sandbox's root file system."""

    directory: Path  # <sandbox>/fs

    @property
    def upper(self) -> Path:
        return self.directory / "upper"

    @property
    def workspace(self) -> Path:
        return self.upper / "root" / WORKSPACE.lstrip("/")

    def overlays(self, base: Base) -> list[Overlay]:
        return [
            Overlay(
                target=target,
                lower=str(lower),
                upper=str(self.upper / name),
                work=str(self.directory / "work" / name),
            )
            for name, target, lower in base.layers()
        ]


class Base:
    """The read-only layers under every sandbox of a host (or of one image)."""

    def __init__(self, skeleton: Path, host_dirs: list[str], image: Path | None = None) -> None:
        self.skeleton = skeleton
        self.host_dirs = host_dirs
        self.image = image

    def layers(self) -> list[tuple[str, str, Path]]:
        """(upper name, target inside, lower on the host) for each overlay, root first."""
        if self.image is not None:
            return [("root", "/", self.image)]
        return [("root", "/", self.skeleton)] + [
            (name, f"/{name}", Path("/") / name) for name in self.host_dirs
        ]

    def describe(self) -> str:
        return f"image {self.image}" if self.image is not None else "host"


def default_base(skeleton: Path) -> Base:
    """Build (or refresh) the default base's skeleton at ``skeleton``; safe to repeat."""
    tmp = skeleton.with_name(f".{skeleton.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    host_dirs = []
    for directory in _SKELETON_DIRS:
        (tmp / directory).mkdir(parents=True, exist_ok=True)
    for name in _HOST_TOP:
        host = Path("/") / name
        if host.is_symlink():
            os.symlink(os.readlink(host), tmp / name)
        elif host.is_dir():
            (tmp / name).mkdir()
            host_dirs.append(name)
    os.chmod(tmp / "tmp", 0o1777)
    os.chmod(tmp / "var/tmp", 0o1777)
    os.chmod(tmp / "root", 0o700)
    _write_etc(tmp / "etc")
    if skeleton.exists():
        shutil.rmtree(skeleton)
    os.replace(tmp, skeleton)
    return Base(skeleton, host_dirs)


def image_base(image: str, roots: list[Path]) -> Base:
    """An image directory as the whole base; it must look like a root file system.

    ``image`` is a name or an absolute path, and either way must lie under one
    of ``roots`` (the host's image directories): a request must never be able
    to make a host directory such as ``/`` or the data directory a sandbox's base.
    """
    real_roots = [Path(os.path.realpath(root)) for root in roots]
    if "/" in image:
        found = Path(os.path.realpath(image))
    else:
        found = next((r / image for r in real_roots if (r / image).is_dir()), Path(image))
    if not any(found != root and found.is_relative_to(root) for root in real_roots):
        shown = ", ".join(str(root) for root in roots) or "none configured"
        raise ValueError(f"image {image!r} is not in this host's image directories ({shown})")
    if not found.is_dir():
        raise ValueError(f"image is not a directory: {image}")
    if not any((found / name).exists() for name in ("bin", "usr/bin")):
        raise ValueError(f"image has no bin or usr/bin directory: {found}")
    return Base(found, [], found)


def _write_etc(etc: Path) -> None:
    for name in _HOST_ETC:
        host = Path("/etc") / name
        if host.is_symlink():
            os.symlink(os.readlink(host), etc / name)
        elif host.is_dir():
            shutil.copytree(host, etc / name, symlinks=True)
        elif host.is_file():
            shutil.copy2(host, etc / name)
    home = USER_HOME
    (etc / "passwd").write_text(
        "root:x:0:0:root:/root:/bin/sh\n"
        f"{USER_NAME}:x:{USER_UID}:{USER_UID}:{USER_NAME}:{home}:/bin/sh\n"
        "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
    )
    (etc / "group").write_text(f"root:x:0:\n{USER_NAME}:x:{USER_UID}:\nnogroup:x:65534:\n")
    (etc / "hosts").write_text("127.0.0.1\tlocalhost sandbox\n::1\tlocalhost ip6-localhost\n")
    (etc / "hostname").write_text("sandbox\n")
    # The egress network's resolver (user-mode networking answers DNS there).
    (etc / "resolv.conf").write_text("nameserver 10.0.2.3\n")


def allocate_id_offset(sandbox_dir: Path, host_id: str, taken: set[int]) -> int:
    """The host id that is root in this sandbox, fixed for the sandbox's life on this host.

    Chosen from the sandbox and host ids (so two agents on one machine rarely
    pick the same range) and probed past ranges this host already uses.
    """
    record = sandbox_dir / "ids.json"
    try:
        return int(json.loads(record.read_text())["offset"])
    except (OSError, ValueError, KeyError):
        pass
    digest = hashlib.sha256(f"{host_id}/{sandbox_dir.name}".encode()).digest()
    slot = int.from_bytes(digest[:4], "big") % _ID_SLOTS
    while _ID_BASE + slot * ID_COUNT in taken:
        slot = (slot + 1) % _ID_SLOTS
    offset = _ID_BASE + slot * ID_COUNT
    sandbox_dir.mkdir(parents=True, exist_ok=True)
    tmp = record.with_name(".ids.json.tmp")
    tmp.write_text(json.dumps({"offset": offset, "count": ID_COUNT}))
    os.replace(tmp, record)
    return offset


def read_id_offset(sandbox_dir: Path) -> int | None:
    try:
        return int(json.loads((sandbox_dir / "ids.json").read_text())["offset"])
    except (OSError, ValueError, KeyError):
        return None


def prepare(fs: SandboxFs, base: Base, id_offset: int) -> None:
    """Make the upper and work directories, owned by the sandbox's root; safe to repeat.

    A restore may have made some of them first, as the host's root, so their
    owners are set every time (a few chowns).
    """
    for overlay in fs.overlays(base):
        for directory in (Path(overlay.upper), Path(overlay.work)):
            directory.mkdir(parents=True, exist_ok=True)
            os.chown(directory, id_offset, id_offset)
    user = id_offset + USER_UID
    home = fs.upper / "root" / USER_HOME.lstrip("/")
    _own_directory(fs.workspace, user)
    if _own_directory(home.parent, id_offset):
        _own_directory(home, user)


def _own_directory(directory: Path, owner: int) -> bool:
    """Make `directory` (its parent is a real one) for the sandbox, or give it
    to the sandbox if the host made it; whether it is a real directory. What
    the sandbox's root put in its place is left as it is and never followed: a
    whiteout of a directory it removed (it can make it again, decision 070), a
    file, a symlink (followed, the host's root would chown whatever it names)."""
    try:
        st = os.lstat(directory)
    except FileNotFoundError:
        directory.mkdir()
        st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode):
        return False
    if st.st_uid < _ID_BASE:
        os.chown(directory, owner, owner, follow_symlinks=False)
    return True


def has_files(fs: SandboxFs) -> bool:
    """Whether the persistent layer holds anything beyond the directories ``prepare`` makes."""
    scaffolding = {fs.upper, fs.workspace, fs.upper / "root" / USER_HOME.lstrip("/")}
    scaffolding |= {path.parent for path in scaffolding} | {
        p for p in fs.upper.glob("*") if p.is_dir() and not p.is_symlink()
    }
    for directory, dirnames, filenames in os.walk(fs.upper):
        if filenames:
            return True
        for name in dirnames:
            if Path(directory, name) not in scaffolding:
                return True
    return False


def claim_host_files(fs: SandboxFs, id_offset: int) -> None:
    """Give workspace files the host wrote (a restored seed checkout) to the sandbox user.

    Files a sandbox made are already in its id range and are left as they are.
    """
    owner = id_offset + USER_UID
    try:
        if not stat.S_ISDIR(os.lstat(fs.workspace).st_mode):
            return  # what the sandbox put there (a symlink is never walked)
    except FileNotFoundError:
        return
    for directory, dirnames, filenames in os.walk(fs.workspace):
        for name in [directory, *(os.path.join(directory, n) for n in dirnames + filenames)]:
            st = os.lstat(name)
            if st.st_uid < _ID_BASE:
                os.chown(name, owner, owner, follow_symlinks=False)
