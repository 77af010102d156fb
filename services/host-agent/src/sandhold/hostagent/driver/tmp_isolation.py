"""A private ``/tmp`` for a command: its own mount namespace with a fresh tmpfs.

``/tmp`` is a temporary mount of the sandbox (never saved), and files one
command leaves there must not show up on the host. Python 3.11 has no
``os.unshare``, hence ctypes. Everything here runs in the forked child just
before exec, so libc is loaded beforehand and nothing may raise.
"""

from __future__ import annotations

import ctypes
import os

_CLONE_NEWNS = 0x00020000
_MS_NOSUID = 0x2
_MS_NODEV = 0x4
_MS_BIND = 0x1000
_MS_REC = 0x4000
_MS_PRIVATE = 0x40000
_MNT_DETACH = 0x2

TMP = "/tmp"


def _under_tmp(path: str) -> bool:
    real = os.path.realpath(path)
    return real == TMP or real.startswith(TMP + "/")


def _outermost(paths: list[str]) -> list[str]:
    """The real paths under /tmp, without those inside another one of them."""
    reals = sorted({os.path.realpath(path) for path in paths if _under_tmp(path)})
    outer: list[str] = []
    for real in reals:
        if real != TMP and not any(real.startswith(kept + "/") for kept in outer):
            outer.append(real)
    return outer


class TmpIsolation:
    """Loaded in the supervisor, used in its child (see module docstring)."""

    def __init__(self) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._libc.unshare.argtypes = [ctypes.c_int]
        self._libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
        self._libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]

    def _failure(self, call: str) -> str:
        code = ctypes.get_errno()
        return f"{call} failed: {os.strerror(code)}"

    def _mount(
        self, source: str, target: str, fstype: str | None, flags: int, data: str | None
    ) -> bool:
        return (
            self._libc.mount(
                source.encode(),
                target.encode(),
                None if fstype is None else fstype.encode(),
                flags,
                None if data is None else data.encode(),
            )
            == 0
        )

    def isolate(self, keep_visible: list[str]) -> str | None:
        """Give the calling process a private /tmp; None on success, else why not.

        ``keep_visible`` are directories (the workspace) that may live under the
        host's /tmp, e.g. when the data root is a test's tmp_path; they are
        bind-mounted back into the new tmpfs at the same path.
        """
        if self._libc.unshare(_CLONE_NEWNS) != 0:
            return self._failure("unshare(CLONE_NEWNS)")
        # Without private propagation the tmpfs would appear on the host too.
        if not self._mount("none", "/", None, _MS_REC | _MS_PRIVATE, None):
            return self._failure("making / a private mount")
        kept: list[tuple[str, int]] = []
        tmp_mounted = False
        try:
            for real in _outermost(keep_visible):
                kept.append((real, os.open(real, os.O_PATH | os.O_DIRECTORY)))
            if not self._mount("tmpfs", TMP, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=1777"):
                return self._failure("mounting a tmpfs on /tmp")
            tmp_mounted = True
            for real, fd in kept:
                os.makedirs(real, exist_ok=True)
                if not self._mount(f"/proc/self/fd/{fd}", real, None, _MS_BIND | _MS_REC, None):
                    code = ctypes.get_errno()
                    raise OSError(code, f"bind-mounting {real} into it: {os.strerror(code)}")
        except OSError as err:
            # A /tmp that hides the workspace is worse than a shared /tmp.
            if tmp_mounted:
                self._libc.umount2(TMP.encode(), _MNT_DETACH)
            return f"preparing a private /tmp: {err}"
        finally:
            for _real, fd in kept:
                os.close(fd)
        return None
