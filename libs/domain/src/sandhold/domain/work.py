"""Instructions from the scheduler to one host (the HOSTWORK stream).

Every instruction names the placement `generation` it belongs to, so a host
never acts for a placement that has since been superseded.
"""

from __future__ import annotations

import msgspec


# Subclasses repeat `frozen=True`: msgspec inherits it, but type checkers only
# read the keywords of the class itself.
class HostWork(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    sandbox_id: str
    generation: int

    @property
    def msg_id(self) -> str:
        """Deterministic, so a re-sent instruction is dropped as a duplicate."""
        tag = type(self).__struct_config__.tag
        return f"{tag}:{self.sandbox_id}:{self.generation}"


class StartSandboxWork(HostWork, tag="start_sandbox", frozen=True):
    memory_limit_bytes: int | None = None
    network: str = "none"
    image: str | None = None
    pids_limit: int | None = None  # None: the host's default
    cpu_limit: float | None = None
    disk_limit_bytes: int | None = None  # a file system of this size for its persistent layer
    # Materialise the workspace from this save when the host has none for the sandbox,
    # from the manifest with this SHA-256 (when recorded) and no other.
    restore_save_id: str | None = None
    restore_manifest_digest: str = ""
    # The sandbox's Connections as of `connections_revision`: where the plan
    # says each is kept, and their values, filled in by the scheduler as it
    # sends the work (the work queue drops the message once taken).
    connections_revision: int = 0
    connection_value_ids: dict[str, str] = {}
    connections: dict[str, str] = {}

    def __repr__(self) -> str:  # never a Connection's value in a log line
        shown = msgspec.structs.replace(self, connections=dict.fromkeys(self.connections, "***"))
        return "StartSandboxWork" + repr(msgspec.structs.asdict(shown))


class RunCommandWork(HostWork, tag="run_command", frozen=True):
    command_id: str
    argv: list[str]
    cwd: str | None = None
    env: dict[str, str] = {}
    timeout_s: float | None = None
    kill_grace_s: float = 5.0
    user: str = "user"
    # Filled in by the scheduler from its secret store as it sends the work (the
    # plan knows the names only); the work queue drops the message once taken.
    secrets: dict[str, str] = {}
    # The run request's key: a host whose copy of the sandbox keeps no ended
    # command (decision 057) tells one that ended from one not read yet by it.
    request_key: str = ""

    @property
    def msg_id(self) -> str:
        return f"run_command:{self.command_id}:{self.generation}"


class DeliverConnectionsWork(HostWork, tag="deliver_connections", frozen=True):
    """Write the sandbox's Connections as of `revision` (the whole set: a name
    not in it is removed); as in `StartSandboxWork`, values filled in on send."""

    revision: int
    connection_value_ids: dict[str, str] = {}
    connections: dict[str, str] = {}

    @property
    def msg_id(self) -> str:
        return f"deliver_connections:{self.sandbox_id}:{self.generation}:{self.revision}"

    def __repr__(self) -> str:
        return f"DeliverConnectionsWork({self.sandbox_id}, {self.generation}, {self.revision})"


class CancelCommandWork(HostWork, tag="cancel_command", frozen=True):
    command_id: str

    @property
    def msg_id(self) -> str:
        return f"cancel_command:{self.command_id}:{self.generation}"


class StopSandboxWork(HostWork, tag="stop_sandbox", frozen=True):
    final_save_id: str | None = None  # capture and upload once processes are stopped
    parent_save_id: str | None = None
    deadline_s: float = 60.0


class SaveSandboxWork(HostWork, tag="save_sandbox", frozen=True):
    """Freeze, capture what changed since `parent_save_id`, thaw, upload."""

    save_id: str
    parent_save_id: str | None = None

    @property
    def msg_id(self) -> str:
        return f"save_sandbox:{self.save_id}:{self.generation}"


class DestroySandboxWork(HostWork, tag="destroy_sandbox", frozen=True):
    pass


AnyWork = (
    StartSandboxWork
    | RunCommandWork
    | CancelCommandWork
    | StopSandboxWork
    | DestroySandboxWork
    | SaveSandboxWork
    | DeliverConnectionsWork
)
