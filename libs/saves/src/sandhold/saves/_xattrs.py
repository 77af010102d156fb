"""Reading and writing the extended attributes a save carries, never following symlinks."""

from __future__ import annotations

import errno
import os

from sandhold.saves.errors import CaptureError, RestoreError
from sandhold.saves.manifest import xattr_is_carried

# A file system without xattrs answers these; it has none to save.
_UNSUPPORTED = (errno.ENOTSUP, errno.EOPNOTSUPP)


def read_xattrs(path: bytes) -> dict[bytes, bytes]:
    """The carried xattrs of `path`, sorted by name (equal trees give equal manifests).

    Raises:
        CaptureError: they exist but cannot be read.
    """
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError as err:
        if err.errno in _UNSUPPORTED or err.errno == errno.ENOENT:
            return {}  # no xattrs here, or the name is gone since the listing
        raise CaptureError(f"cannot list the xattrs of {os.fsdecode(path)}: {err}") from err
    found: dict[bytes, bytes] = {}
    for name in sorted(os.fsencode(n) for n in names):
        if not xattr_is_carried(name):
            continue
        try:
            found[name] = os.getxattr(path, name, follow_symlinks=False)
        except OSError as err:
            if err.errno in (errno.ENODATA, errno.ENOENT):
                continue  # removed since the listing
            raise CaptureError(
                f"cannot read xattr {os.fsdecode(name)} of {os.fsdecode(path)}: {err}"
            ) from err
    return found


def write_xattrs(path: bytes, xattrs: dict[bytes, bytes]) -> None:
    """Set every xattr on `path`.

    Raises:
        RestoreError: the destination refuses one. Dropping it would change
            what the save means (an opaque directory would show the lower
            layer's files again), so the restore fails instead.
    """
    for name, value in xattrs.items():
        try:
            os.setxattr(path, name, value, follow_symlinks=False)
        except OSError as err:
            raise RestoreError(
                f"the restore destination refuses xattr {os.fsdecode(name)} on "
                f"{os.fsdecode(path)}: {err}"
            ) from err
