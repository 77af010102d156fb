"""Stream, subject and bucket names, all derived from one prefix.

The default prefix `sh` gives `sh.ev.sandbox.<id>`; tests use a unique prefix
each, so many tests share one server without seeing each other.
"""

from __future__ import annotations

import re

import msgspec

_PREFIX = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")


class Names(msgspec.Struct, frozen=True):
    prefix: str = "sh"

    def __post_init__(self) -> None:
        if not _PREFIX.match(self.prefix):
            raise ValueError(
                f"prefix {self.prefix!r} must be 1-32 of a-z 0-9 _ - and start with a letter"
            )

    @property
    def _stream_prefix(self) -> str:
        return self.prefix.upper().replace("-", "_")

    @property
    def events_stream(self) -> str:
        return f"{self._stream_prefix}_EVENTS"

    @property
    def output_stream(self) -> str:
        return f"{self._stream_prefix}_OUTPUT"

    @property
    def requests_stream(self) -> str:
        return f"{self._stream_prefix}_REQUESTS"

    @property
    def hostwork_stream(self) -> str:
        return f"{self._stream_prefix}_HOSTWORK"

    @property
    def saves_stream(self) -> str:
        """The save store: content-addressed chunks and manifests."""
        return f"{self._stream_prefix}_SAVES"

    @property
    def secrets_stream(self) -> str:
        return f"{self._stream_prefix}_SECRETS"

    def secret(self, command_id: str) -> str:
        """A command's secrets (the scheduler's)."""
        return f"{self.prefix}.secret.cmd.{command_id}"

    def task_secret(self, task_id: str) -> str:
        """A task's secrets, for its agent steps (the orchestrator's)."""
        return f"{self.prefix}.secret.task.{task_id}"

    @property
    def connections_stream(self) -> str:
        return f"{self._stream_prefix}_CONNECTIONS"

    def connection(self, sandbox_id: str, value_id: str) -> str:
        """One Connection value of a sandbox, as one set request gave it (the scheduler's)."""
        return f"{self.prefix}.conn.{sandbox_id}.{value_id}"

    def connections_of(self, sandbox_id: str) -> str:
        return f"{self.prefix}.conn.{sandbox_id}.*"

    @property
    def all_streams(self) -> tuple[str, ...]:
        """Every stream sandhold keeps, the lease and instance buckets' included."""
        return (
            self.events_stream,
            self.output_stream,
            self.requests_stream,
            self.hostwork_stream,
            self.saves_stream,
            self.secrets_stream,
            self.connections_stream,
            f"KV_{self.lease_bucket}",
            f"KV_{self.instance_bucket}",
        )

    def chunk(self, digest: str) -> str:
        return f"{self.prefix}.chunk.{digest}"

    def manifest(self, save_id: str) -> str:
        return f"{self.prefix}.manifest.{save_id}"

    @property
    def lease_bucket(self) -> str:
        return f"{self._stream_prefix}_leases"

    @property
    def instance_bucket(self) -> str:
        """Service instances' leases (`<role>.<instance>`), for services that run twice."""
        return f"{self._stream_prefix}_instances"

    def events(self, kind: str, aggregate_id: str = "*") -> str:
        return f"{self.prefix}.ev.{kind}.{aggregate_id}"

    def request(self, tag: str, tenant: str) -> str:
        """Where a request of type `tag` (`family.verb`) for `tenant` is sent:
        the tenant is in the subject, so permissions can hold a publisher to
        its own, and the service refuses a body that names another."""
        return f"{self.prefix}.req.{tag}.{tenant_token(tenant)}"

    def tenant_of_request(self, subject: str, tag: str) -> str | None:
        """The tenant a request subject of type `tag` names (None: not one of them)."""
        home, _, token = subject.rpartition(".")
        return tenant_of_token(token) if home == f"{self.prefix}.req.{tag}" and token else None

    def requests(self, family: str) -> str:
        """Every request of one family (`sandbox`, `command`, `task`). Wider than
        `.<verb>.<tenant>`: one sent to a subject of the wrong shape is still
        taken off the queue, to be answered and dead-lettered."""
        return f"{self.prefix}.req.{family}.>"

    @property
    def all_requests(self) -> str:
        return f"{self.prefix}.req.>"

    def work(self, host: str, *, saves: bool = False) -> str:
        """A host's instructions; `saves`: its save instructions, a queue of their
        own (decision 064): a burst of saves is never ahead of a command."""
        return f"{self.prefix}.work.{host}.saves" if saves else f"{self.prefix}.work.{host}"

    def work_consumer(self, host: str, *, saves: bool = False) -> str:
        """The durable that takes `work(host, saves=...)` off the queue. (Two
        prefixes, so no host's name makes one another host's.)"""
        return f"saves-{host}" if saves else f"host-{host}"

    def output(self, sandbox_id: str, command_id: str) -> str:
        return f"{self.prefix}.out.{sandbox_id}.{command_id}"

    def api(self, tenant: str) -> str:
        """A tenant's own NATS API (the gateway answers it, decision 028)."""
        return f"{self.prefix}.api.{tenant_token(tenant)}"

    @property
    def all_api(self) -> str:
        return f"{self.prefix}.api.*"

    @property
    def ready(self) -> str:
        """Core subject on which services announce that they are serving."""
        return f"{self.prefix}.svc.ready"


def tenant_token(tenant: str) -> str:
    """A tenant name as one subject token. Tenant names may hold dots, which
    split subjects; `~` is not allowed in a name, so the mapping is one-to-one."""
    return tenant.replace(".", "~")


def tenant_of_token(token: str) -> str:
    return token.replace("~", ".")
