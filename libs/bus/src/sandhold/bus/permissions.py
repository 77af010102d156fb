"""Who may do what on the bus: one table, rendered into the nats-server config.

Every process connects as its own user, and each user may publish and
subscribe only where its row below says (docs/security.md shows the same
table). What no row grants is refused by the server: an anonymous client, a
host-agent taking another host's work, any service creating, changing or
purging a stream (only `admin` may; `sandhold up` uses it to make the
streams, no service holds it).

JetStream is driven through subjects too (`$JS.API.…`), so the rows name the
API calls each role makes, stream by stream. Replies go to inboxes; every
user's inbox is `_INBOX.<user>.…` and only that user may subscribe to it.
"""

from __future__ import annotations

import json

import msgspec
from sandhold.bus.credentials import Credentials
from sandhold.bus.names import Names
from sandhold.bus.roles import ROLES

# The services whose instances hold leases or claims in the instance bucket
# (decisions 036, 037); the others (the gateway, which faces tenants, among
# them) need no write there.
INSTANCE_WRITERS = ("scheduler", "saver", "orchestrator")


class Permissions(msgspec.Struct, frozen=True, kw_only=True):
    publish: list[str]
    subscribe: list[str]
    # Answering a core request (`msg.respond`) to whoever sent it, once.
    responses: bool = False


def inbox_prefix(user: str) -> str:
    return f"_INBOX.{user}"


def _api(*tokens: str) -> str:
    return "$JS.API." + ".".join(tokens)


def _read(stream: str) -> list[str]:
    """Reading a stream: direct gets, ordered and pull consumers of one's own."""
    return [
        _api("DIRECT.GET", stream),
        _api("DIRECT.GET", stream, ">"),
        _api("STREAM.MSG.GET", stream),
        _api("CONSUMER.CREATE", stream),
        _api("CONSUMER.CREATE", stream, ">"),
        _api("CONSUMER.INFO", stream, "*"),
        _api("CONSUMER.MSG.NEXT", stream, "*"),
        _api("CONSUMER.DELETE", stream, "*"),
        f"$JS.FC.{stream}.>",  # flow control of push consumers
    ]


def _direct(stream: str) -> list[str]:
    """Reading single messages of a stream, by subject or sequence; no consumer."""
    return [
        _api("DIRECT.GET", stream),
        _api("DIRECT.GET", stream, ">"),
        _api("STREAM.MSG.GET", stream),  # headers as stored (decision 034)
    ]


def _work_queue(stream: str, durable: str, *, filtered_create: str | None = None) -> list[str]:
    """Taking messages off one durable of a work-queue stream, and no other."""
    create = (
        [_api("CONSUMER.CREATE", stream, durable, filtered_create)]
        if filtered_create is not None
        else [
            _api("CONSUMER.CREATE", stream, durable),
            _api("CONSUMER.CREATE", stream, durable, ">"),
        ]
    )
    return [
        *create,
        _api("CONSUMER.INFO", stream, durable),
        _api("CONSUMER.MSG.NEXT", stream, durable),
        f"$JS.ACK.{stream}.{durable}.>",
    ]


def _dead_letters(stream: str) -> list[str]:
    """Answering and removing what a work queue gave up on (by sequence)."""
    return [_api("STREAM.MSG.GET", stream), _api("STREAM.MSG.DELETE", stream)]


def _advisory(stream: str, durable: str) -> str:
    return f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{stream}.{durable}"


def _instances(names: Names, role: str) -> list[str]:
    """A service's instances' leases (decision 036): its own role's keys to renew,
    the whole bucket to watch."""
    return [f"$KV.{names.instance_bucket}.{role}.>", *_read(f"KV_{names.instance_bucket}")]


def row(
    names: Names, role: str, user: str, *, host: str | None = None, tenant: str | None = None
) -> Permissions | None:
    """The permissions of `user` in `role` (None: everything, the admin)."""
    p = names.prefix
    ev, out, req = names.events_stream, names.output_stream, names.requests_stream
    work, saves, leases = names.hostwork_stream, names.saves_stream, f"KV_{names.lease_bucket}"
    inbox = f"{inbox_prefix(user)}.>"
    # Every process: see that the streams exist, say it is ready, hear its replies.
    base_pub = [_api("STREAM.INFO", s) for s in names.all_streams] + [names.ready]
    base_sub = [inbox]
    answers = "_INBOX.>"  # replies to whoever asked (a request names its inbox)
    kv = f"$KV.{names.lease_bucket}"
    match role:
        case "admin":
            return None
        case "tenant":
            # A tenant's own clients: its API subject, its own replies, nothing
            # else: no JetStream API at all (decision 028 says why).
            if tenant is None:
                raise ValueError("a tenant's permissions are for one tenant")
            return Permissions(publish=[names.api(tenant)], subscribe=[inbox])
        case "operator":  # the CLI on the control-plane machine
            pub = [
                names.all_requests,
                f"{p}.admin.>",
                *_read(ev),
                *_read(out),
                *_read(saves),
                *_read(leases),
                *_read(f"KV_{names.instance_bucket}"),
            ]
            sub = [f"{p}.ev.>", f"{p}.out.>", f"{p}.progress.>", names.ready]
        case "scheduler":
            secrets = names.secrets_stream
            pub = [
                names.events("sandbox"),
                # commands' secrets: kept until launch, then removed (only here)
                f"{p}.secret.cmd.*",
                _api("DIRECT.GET", secrets, f"{p}.secret.cmd.*"),
                _api("STREAM.MSG.GET", secrets),  # what was kept, headers as stored
                _api("STREAM.PURGE", secrets),
                _api("STREAM.INFO", secrets),  # which are kept (names, not values)
                # Connections' values: kept while referred to (only here)
                f"{p}.conn.*.*",
                _api("DIRECT.GET", names.connections_stream, f"{p}.conn.*.*"),
                _api("STREAM.MSG.GET", names.connections_stream),
                _api("STREAM.PURGE", names.connections_stream),
                f"{p}.work.*",
                answers,
                *_read(ev),
                *_read(leases),
                _api("DIRECT.GET", saves, f"{p}.manifest.*"),
                *_work_queue(req, "scheduler"),
                *_dead_letters(req),
            ]
            sub = [_advisory(req, "scheduler")]
        case "saver":
            pub = [
                names.events("sandbox"),
                names.work("*", saves=True),  # save instructions, no other
                *_read(ev),
                *_read(saves),
                # garbage collection removes unreferenced chunks and manifests
                _api("STREAM.PURGE", saves),
            ]
            sub = [f"{p}.admin.gc"]
        case "recovery":
            pub = [
                names.events("sandbox"),
                names.events("host"),
                f"{kv}._recovery",
                *_read(ev),
                *_read(leases),
            ]
            sub = []
        case "orchestrator":
            pub = [
                names.events("task"),
                # tasks' secrets: kept from submit to end (only here)
                f"{p}.secret.task.*",
                _api("DIRECT.GET", names.secrets_stream, f"{p}.secret.task.*"),
                _api("STREAM.MSG.GET", names.secrets_stream),
                _api("STREAM.PURGE", names.secrets_stream),
                f"{p}.req.sandbox.*.*",
                f"{p}.req.command.*.*",
                answers,
                *_read(ev),
                *_read(out),
                *_read(saves),
                f"{p}.chunk.*",  # staged repositories and artifacts are saves too
                f"{p}.manifest.*",
                *_work_queue(req, "orchestrator"),
                *_dead_letters(req),
            ]
            sub = [_advisory(req, "orchestrator")]
        case "gateway":
            pub = [
                f"{p}.req.sandbox.*.*",
                f"{p}.req.command.*.*",
                f"{p}.req.connection.*.*",
                f"{p}.req.task.*.*",
                *_read(ev),
                *_read(out),
                *_read(leases),
                _api("STREAM.INFO", saves),
                # a task's artifacts for the console's download: single messages
                # (a manifest, its chunks), never a consumer
                *_direct(saves),
            ]
            sub = [f"{p}.ev.*.*", f"{p}.admin.rebuild-read-model", names.all_api]
        case "metrics":
            pub = [*_read(ev)]
            sub = []
        case "host-agent":
            if host is None:
                raise ValueError("a host-agent's permissions are for one host")
            durable, saves_durable = (
                names.work_consumer(host),
                names.work_consumer(host, saves=True),
            )
            pub = [
                names.events("sandbox"),
                names.events("host", host),
                f"{p}.out.*.*.*",
                f"{p}.progress.*.*",
                f"{p}.chunk.*",
                f"{p}.manifest.*",
                f"{kv}.{host}",
                # Direct gets only, no consumer: a push consumer delivers where its
                # maker says, past the maker's permissions (decision 032).
                *_direct(ev),
                *_direct(out),
                *_direct(saves),
                _api("STREAM.INFO", leases),
                _api("STREAM.MSG.GET", leases),
                # its own work and no other host's: the filter is in the subject
                *_work_queue(work, durable, filtered_create=names.work(host)),
                *_work_queue(work, saves_durable, filtered_create=names.work(host, saves=True)),
            ]
            sub = [_advisory(work, durable), _advisory(work, saves_durable)]
        case _:
            raise ValueError(f"no role {role!r}; roles: {', '.join(ROLES)}")
    if role in INSTANCE_WRITERS:
        pub += _instances(names, role)
    return Permissions(
        publish=sorted({*base_pub, *pub}),
        subscribe=sorted({*base_sub, *sub}),
        responses=role in ("saver", "gateway"),
    )


def authorization(names: Names, users: list[Credentials]) -> str:
    """The `authorization` block of a nats-server config for `users`.

    Passwords are written as they are: the config file and the credential files
    sit side by side in a 0700 directory, so hashing one would protect nothing
    the other does not give away."""
    entries = []
    for c in users:
        entry: dict[str, object] = {"user": c.user, "password": c.password}
        permissions = row(names, c.role, c.user, host=c.host, tenant=c.tenant)
        if permissions is not None:
            rules: dict[str, object] = {
                "publish": {"allow": permissions.publish},
                "subscribe": {"allow": permissions.subscribe},
            }
            if permissions.responses:
                rules["allow_responses"] = {"max": 1, "expires": "15m"}
            entry["permissions"] = rules
        entries.append(entry)
    # JSON is a subset of the nats-server config syntax; quoted strings keep `$`.
    return "authorization " + json.dumps({"users": entries}, indent=2) + "\n"


def table(names: Names, *, host: str = "<host>", tenant: str = "<tenant>") -> str:
    """The table of docs/security.md, made from the rows themselves."""
    lines = [
        "| user | role | may publish (and call) | may subscribe to |",
        "|---|---|---|---|",
    ]
    for role in ROLES:
        user = {"host-agent": f"host-{host}", "tenant": f"tenant-{tenant}"}.get(role, role)
        permissions = row(
            names, role, user,
            host=host if role == "host-agent" else None,
            tenant=tenant if role == "tenant" else None,
        )  # fmt: skip
        if permissions is None:
            lines.append(f"| `{user}` | {role} | everything | everything |")
            continue
        publish = "<br>".join(f"`{s}`" for s in permissions.publish)
        subscribe = "<br>".join(f"`{s}`" for s in permissions.subscribe)
        if permissions.responses:
            subscribe += "<br>(and may answer each request it receives, once)"
        lines.append(f"| `{user}` | {role} | {publish} | {subscribe} |")
    return "\n".join(lines) + "\n"
