"""The host-agent's process driver: sandbox commands under detached supervisors.

Pure local OS work (processes, cgroups, mount namespaces, files); no NATS.
Exports resolve lazily: every warm supervisor imports this package, and
asyncio alone would add tens of milliseconds to its start.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sandhold.hostagent.driver.cgroups import (
        CgroupError,
        Cgroups,
        NoCgroups,
        V1Cgroups,
        V2Cgroups,
        detect_cgroups,
    )
    from sandhold.hostagent.driver.driver import ProcessDriver, SandboxNotFound
    from sandhold.hostagent.driver.handle import CommandHandle
    from sandhold.hostagent.driver.records import CommandExit, ExitReason, OutputChunk

_EXPORTS = {
    "CgroupError": "cgroups",
    "Cgroups": "cgroups",
    "NoCgroups": "cgroups",
    "V1Cgroups": "cgroups",
    "V2Cgroups": "cgroups",
    "detect_cgroups": "cgroups",
    "ProcessDriver": "driver",
    "SandboxNotFound": "driver",
    "CommandHandle": "handle",
    "CommandExit": "records",
    "ExitReason": "records",
    "OutputChunk": "records",
}

__all__ = [
    "CgroupError",
    "Cgroups",
    "CommandExit",
    "CommandHandle",
    "ExitReason",
    "NoCgroups",
    "OutputChunk",
    "ProcessDriver",
    "SandboxNotFound",
    "V1Cgroups",
    "V2Cgroups",
    "detect_cgroups",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
