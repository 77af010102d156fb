"""The sandbox driver as the host-agent sees it: a port, so another isolation is a new class.

``ProcessDriver`` implements it today with two isolations behind it (the
namespaced boxes, the unisolated process driver). A microVM driver (KVM) would
implement the same methods: a sandbox per VM, commands run by an agent inside
it, the persistent root as the VM's disk, freeze as a VM pause.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from sandhold.hostagent.driver.boxes import SandboxSettings, User
from sandhold.hostagent.driver.handle import CommandHandle
from sandhold.hostagent.driver.layout import HostLayout
from sandhold.hostagent.driver.records import CommandExit
from sandhold.saves.manifest import Layout


class SandboxDriver(Protocol):
    layout: HostLayout  # where sandboxes' records live on this host (ids, generations)

    async def start(self) -> None: ...
    async def close(self) -> None: ...
    def capabilities(self) -> dict[str, Any]: ...
    def sandbox_capabilities(self, sandbox_id: str) -> dict[str, Any]: ...

    # sandboxes
    async def provision(self, sandbox_id: str, settings: SandboxSettings) -> None: ...
    async def create_sandbox(
        self,
        sandbox_id: str,
        memory_limit_bytes: int | None,
        settings: SandboxSettings | None = None,
        *,
        pids_limit: int | None = ...,
        cpu_limit: float | None = None,
    ) -> None: ...
    async def stop_sandbox(self, sandbox_id: str, grace: float = ...) -> dict[str, CommandExit]: ...
    async def destroy_sandbox(self, sandbox_id: str) -> None: ...
    async def freeze(self, sandbox_id: str) -> None: ...
    async def thaw(self, sandbox_id: str) -> None: ...

    # what saves capture and restore
    @property
    def save_layout(self) -> Layout: ...
    def save_root(self, sandbox_id: str) -> Path: ...
    def workspace(self, sandbox_id: str) -> Path: ...
    def id_offset(self, sandbox_id: str) -> int: ...
    def has_local_copy(self, sandbox_id: str) -> bool: ...
    def restored(self, sandbox_id: str) -> None: ...

    # commands
    async def launch(
        self,
        sandbox_id: str,
        command_id: str,
        argv: list[str],
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        secrets: dict[str, str] | None = None,
        timeout_s: float | None = None,
        kill_grace_s: float = ...,
        user: User = "user",
    ) -> CommandHandle: ...
    async def interrupt(
        self, sandbox_id: str, command_id: str, *, grace_s: float | None = None
    ) -> bool: ...
    def adopt_all(self) -> list[CommandHandle]: ...
    def mark_reported(self, sandbox_id: str, command_id: str) -> None: ...
