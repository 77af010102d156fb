"""Which data dirs use a host id's cgroups on this machine (decision 066).

Cgroups belong to the machine, a sandbox's files to a data dir. Two
installations may share a host id on one machine (`sandhold up` calls its host
`local`); an agent that removes the empty cgroups of sandboxes it does not hold
must keep those of the other installations' sandboxes, running or stopped, and
may remove those of a data dir that is gone. Each agent registers its data dir
here at start; the register lives on tmpfs (/run), as the cgroups do: a reboot
empties both.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

REGISTER = (
    Path("/run/sandhold/hosts")
    if os.access("/run", os.W_OK)
    else Path(tempfile.gettempdir()) / "sandhold-hosts"
)


def others_of(host_id: str, root: Path, register: Path = REGISTER) -> list[Path]:
    """Register `root` as a user of `host_id`'s cgroups; return the other roots
    registered for it that still exist (a root that is gone is forgotten)."""
    folder = register / host_id
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    root = root.resolve()
    own = hashlib.sha256(os.fsencode(root)).hexdigest()[:16]
    tmp = folder / f".{own}.tmp"
    tmp.write_text(str(root))
    tmp.replace(folder / own)
    others = []
    for entry in folder.iterdir():
        if entry.name == own or entry.name.startswith("."):
            continue
        try:
            path = Path(entry.read_text())
        except OSError:
            continue
        if path.is_dir():
            others.append(path)
        else:
            entry.unlink(missing_ok=True)
    return others
