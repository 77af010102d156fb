"""Each user may do what its row in `permissions.py` says and nothing else, on a
real nats-server with the credentials `sandhold up` makes."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Iterator
from pathlib import Path

import nats
import nats.errors
import pytest
from nats.js.api import ConsumerConfig
from nats.js.errors import NotFoundError
from sandhold.bus import credentials
from sandhold.bus.connection import connect
from sandhold.bus.names import Names
from sandhold.bus.permissions import inbox_prefix
from sandhold.bus.server import NatsServer

from tests.support.bus import hello, make_streams

NAMES = Names("sh")
ROLES = [
    ("scheduler", None),
    ("saver", None),
    ("gateway", None),
    ("operator", None),
    ("orchestrator", None),
    ("recovery", None),
    ("metrics", None),
]
HOSTS = ["h1", "h2"]
TENANTS = ["acme", "globex"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    running = NatsServer(tmp_path_factory.mktemp("perm") / "nats", names=NAMES)
    for role, _ in ROLES:
        credentials.issue(running.credentials_dir, role)
    for host in HOSTS:
        credentials.issue(running.credentials_dir, "host-agent", host=host)
    for tenant in TENANTS:
        credentials.issue(running.credentials_dir, "tenant", tenant=tenant)
    running.start()
    try:
        asyncio.run(make_streams(running, NAMES))
        yield running
    finally:
        running.stop()


class As:
    """A connection as one user, with the server's refusals collected."""

    def __init__(self, nc: nats.NATS, errors: asyncio.Queue[Exception]) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.errors = errors

    async def refused(self, action: Awaitable[object], subject: str) -> None:
        """`action` is refused by the server: a permissions violation naming `subject`."""
        attempt = asyncio.ensure_future(action)
        try:
            async with asyncio.timeout(15):
                while True:
                    said = str(await self.errors.get()).lower()  # nats-py lowercases it
                    if "permissions violation" in said and subject.lower() in said:
                        return
        finally:
            attempt.cancel()
            with contextlib.suppress(BaseException):
                await attempt


@contextlib.asynccontextmanager
async def as_user(server: NatsServer, user: str) -> AsyncIterator[As]:
    own = credentials.load(credentials.path_of(server.credentials_dir, user))
    errors: asyncio.Queue[Exception] = asyncio.Queue()

    async def on_error(err: Exception) -> None:
        errors.put_nowait(err)

    nc = await nats.connect(
        server.url,
        user=own.user,
        password=own.password,
        inbox_prefix=inbox_prefix(own.user),
        error_cb=on_error,
        allow_reconnect=False,
    )
    try:
        yield As(nc, errors)
    finally:
        await nc.close()


async def test_an_anonymous_client_is_refused(server: NatsServer):
    assert b"Authorization Violation" in await hello(server.url, {})


async def test_a_wrong_password_is_refused_and_the_right_one_taken(server: NatsServer):
    assert b"Authorization Violation" in await hello(
        server.url, {"user": "scheduler", "pass": "guess"}
    )
    own = credentials.load(credentials.path_of(server.credentials_dir, "scheduler"))
    assert await hello(server.url, {"user": own.user, "pass": own.password}) == b"+OK\r\n"


async def test_a_host_agent_takes_its_own_work_and_no_other_hosts(server: NatsServer):
    async with as_user(server, "host-h1") as h1:
        own = ConsumerConfig(durable_name="host-h1", name="host-h1", filter_subject="sh.work.h1")
        await h1.js.add_consumer(NAMES.hostwork_stream, own)  # its own: allowed
        other = ConsumerConfig(durable_name="host-h2", name="host-h2", filter_subject="sh.work.h2")
        await h1.refused(
            h1.js.add_consumer(NAMES.hostwork_stream, other), "CONSUMER.CREATE.SH_HOSTWORK.host-h2"
        )
        # nor h2's work under its own consumer's name
        sneaky = ConsumerConfig(durable_name="host-h1", name="host-h1", filter_subject="sh.work.h2")
        await h1.refused(h1.js.add_consumer(NAMES.hostwork_stream, sneaky), "host-h1.sh.work.h2")
        await h1.refused(
            h1.js.publish("sh.work.h2", b"{}", stream=NAMES.hostwork_stream), '"sh.work.h2"'
        )


async def test_a_host_agent_takes_its_own_saves_and_no_other_hosts(server: NatsServer):
    # Its save instructions come in a queue of their own (decision 064).
    async with as_user(server, "host-h1") as h1:
        own = ConsumerConfig(
            durable_name="saves-h1", name="saves-h1", filter_subject="sh.work.h1.saves"
        )
        await h1.js.add_consumer(NAMES.hostwork_stream, own)  # its own: allowed
        other = ConsumerConfig(
            durable_name="saves-h2", name="saves-h2", filter_subject="sh.work.h2.saves"
        )
        await h1.refused(
            h1.js.add_consumer(NAMES.hostwork_stream, other), "CONSUMER.CREATE.SH_HOSTWORK.saves-h2"
        )
        sneaky = ConsumerConfig(
            durable_name="saves-h1", name="saves-h1", filter_subject="sh.work.h2.saves"
        )
        await h1.refused(
            h1.js.add_consumer(NAMES.hostwork_stream, sneaky), "saves-h1.sh.work.h2.saves"
        )


async def test_the_saver_sends_hosts_save_instructions_and_no_other_work(server: NatsServer):
    async with as_user(server, "saver") as saver:
        await saver.js.publish("sh.work.h1.saves", b"{}", stream=NAMES.hostwork_stream)
        await saver.refused(
            saver.js.publish("sh.work.h1", b"{}", stream=NAMES.hostwork_stream), '"sh.work.h1"'
        )
    async with as_user(server, "scheduler") as scheduler:  # which sends no save
        await scheduler.refused(
            scheduler.js.publish("sh.work.h1.saves", b"{}", stream=NAMES.hostwork_stream),
            '"sh.work.h1.saves"',
        )


@pytest.mark.parametrize("stream", ["SH_EVENTS", "SH_OUTPUT", "SH_SAVES"])
async def test_a_host_agent_reads_streams_by_direct_get_and_makes_no_consumer_on_them(
    server: NatsServer, stream: str
):
    """A push consumer would deliver stored bytes (its own output, say) to any
    subject it names, such as another tenant's requests (decision 032)."""
    async with as_user(server, "host-h1") as h1:
        with contextlib.suppress(NotFoundError):
            await h1.js.get_last_msg(stream, "sh.nothing.here", direct=True)  # allowed
        assert h1.errors.empty()
        await h1.refused(
            h1.js.add_consumer(stream, ConsumerConfig(deliver_subject="sh.req.command.run.acme")),
            f"$JS.API.CONSUMER.CREATE.{stream}",
        )


async def test_a_host_agent_writes_its_own_lease_and_host_events_only(server: NatsServer):
    async with as_user(server, "host-h1") as h1:
        await h1.js.publish("$KV.SH_leases.h1", b"lease")  # its own: allowed
        await h1.refused(h1.js.publish("$KV.SH_leases.h2", b"lease"), "$KV.SH_leases.h2")
        await h1.refused(h1.js.publish("sh.ev.host.h2", b"{}"), "sh.ev.host.h2")
        await h1.refused(h1.js.publish("sh.ev.task.tk-1", b"{}"), "sh.ev.task.tk-1")


@pytest.mark.parametrize(
    ("user", "other"), [("orchestrator", "scheduler"), ("scheduler", "orchestrator")]
)
async def test_a_service_renews_its_own_instances_leases_and_no_other_roles(
    server: NatsServer, user: str, other: str
):
    """Two orchestrators take tasks from each other when one's lease lapses: no
    other role may keep an orchestrator's lease alive, or let one lapse (decision 036)."""
    async with as_user(server, user) as service:
        kv = await service.js.key_value(NAMES.instance_bucket)
        await kv.put(f"{user}.{user}-1", b"{}")  # its own role's key: allowed
        assert (await kv.get(f"{user}.{user}-1")).value == b"{}"  # and it reads the bucket
        await service.refused(
            kv.put(f"{other}.{other}-1", b"{}"), f"$KV.SH_instances.{other}.{other}-1"
        )
        await service.refused(kv.put(f"{other}-1", b"{}"), f"$KV.SH_instances.{other}-1")


@pytest.mark.parametrize("user", ["operator", "host-h1", "gateway", "recovery", "metrics"])
async def test_no_one_else_writes_an_instances_lease(server: NatsServer, user: str):
    """Only roles that hold leases or claims write the bucket: not the gateway,
    which faces tenants, nor recovery or metrics, which hold none."""
    async with as_user(server, user) as someone:
        subject = "$KV.SH_instances.orchestrator.orchestrator-1"
        await someone.refused(someone.js.publish(subject, b"{}"), subject)


async def test_the_operator_reads_the_instances_leases(server: NatsServer):
    async with as_user(server, "orchestrator") as orchestrator:
        kv = await orchestrator.js.key_value(NAMES.instance_bucket)
        await kv.put("orchestrator.orchestrator-2", b'{"instance": "orchestrator-2"}')
    async with as_user(server, "operator") as operator:
        kv = await operator.js.key_value(NAMES.instance_bucket)
        entry = await kv.get("orchestrator.orchestrator-2")
        assert entry.value == b'{"instance": "orchestrator-2"}'
        watcher = await kv.watchall()
        assert (await watcher.updates(timeout=10)) is not None
        await watcher.stop()
        assert operator.errors.empty()


@pytest.mark.parametrize("user", ["host-h1", "scheduler", "saver", "gateway", "operator"])
async def test_no_service_may_purge_or_delete_the_event_log(server: NatsServer, user: str):
    async with as_user(server, user) as someone:
        await someone.refused(
            someone.js.purge_stream(NAMES.events_stream), "STREAM.PURGE.SH_EVENTS"
        )
        await someone.refused(
            someone.js.delete_stream(NAMES.events_stream), "STREAM.DELETE.SH_EVENTS"
        )
        await someone.refused(
            someone.js.update_stream(name=NAMES.events_stream, subjects=["sh.ev.>"]),
            "STREAM.UPDATE.SH_EVENTS",
        )
    # the admin may (checked, not done: the stream is still there)
    admin = await connect(server.admin_url, name="test-admin")
    try:
        assert (await admin.jetstream().stream_info(NAMES.events_stream)).config.name
    finally:
        await admin.close()


async def test_the_scheduler_may_not_write_the_save_store(server: NatsServer):
    async with as_user(server, "scheduler") as scheduler:
        await scheduler.js.publish("sh.ev.sandbox.sb-0000000000000001", b"{}")  # its own events
        await scheduler.refused(scheduler.js.publish("sh.chunk.abc", b"x"), "sh.chunk.abc")
        await scheduler.refused(scheduler.js.publish("sh.manifest.sv-1", b"x"), "sh.manifest.sv-1")


async def test_the_gateway_may_not_append_events(server: NatsServer):
    async with as_user(server, "gateway") as gateway:
        await gateway.refused(
            gateway.js.publish("sh.ev.sandbox.sb-0000000000000002", b"{}"),
            "sh.ev.sandbox.sb-0000000000000002",
        )


async def test_no_one_reads_another_users_replies(server: NatsServer):
    async with as_user(server, "gateway") as gateway:
        await gateway.nc.subscribe(f"{inbox_prefix('gateway')}.mine")  # its own: allowed
        await gateway.refused(
            gateway.nc.subscribe(f"{inbox_prefix('scheduler')}.>"), "_INBOX.scheduler.>"
        )
        await gateway.refused(gateway.nc.subscribe("_INBOX.>"), '"_INBOX.>"')


async def test_a_user_connecting_through_bus_connect_gets_its_own_inbox(
    server: NatsServer, tmp_path: Path
):
    own = credentials.load(credentials.path_of(server.credentials_dir, "operator"))
    nc = await connect(server.url, name="test", credentials=own)
    try:
        assert nc.new_inbox().startswith("_INBOX.operator.")
        # a request round trip works through that inbox: the JetStream API answers
        assert (await nc.jetstream().stream_info(NAMES.events_stream)).config.name
    finally:
        await nc.close()


async def test_a_tenant_may_call_its_own_api_subject(server: NatsServer):
    admin = await connect(server.admin_url, name="test-admin")
    try:
        heard = await admin.subscribe("sh.api.acme")
        await admin.flush()
        async with as_user(server, "tenant-acme") as acme:
            await acme.nc.publish("sh.api.acme", b"call")
            await acme.nc.flush()
            assert (await heard.next_msg(timeout=10)).data == b"call"
            assert acme.errors.empty()
    finally:
        await admin.close()


async def test_a_tenant_has_no_other_subject_and_no_jetstream(server: NatsServer):
    """Not another tenant's API or replies, no request, event or output subject,
    and no JetStream API: no consumers, so none that delivers stored messages
    to a subject the tenant may not publish to (nats-server #8274)."""
    async with as_user(server, "tenant-acme") as acme:
        for subject in (
            "sh.api.globex",
            "sh.req.sandbox.create.acme",
            "sh.ev.sandbox.x",
            "sh.svc.ready",
        ):
            await acme.refused(acme.nc.publish(subject, b"{}"), f'"{subject}"')
        await acme.refused(
            acme.js.add_consumer(
                NAMES.events_stream, ConsumerConfig(name="mine", filter_subject="sh.ev.>")
            ),
            "CONSUMER.CREATE.SH_EVENTS",
        )
        await acme.refused(
            acme.js.get_last_msg(NAMES.events_stream, "sh.ev.sandbox.x", direct=True),
            "DIRECT.GET.SH_EVENTS",
        )
        await acme.refused(acme.js.stream_info(NAMES.events_stream), "STREAM.INFO.SH_EVENTS")
        for subject in (
            "sh.ev.>",
            "sh.out.>",
            "sh.api.globex",
            f"{inbox_prefix('tenant-globex')}.>",
        ):
            await acme.refused(acme.nc.subscribe(subject), f'"{subject}"')


@pytest.mark.parametrize("user", ["host-h1", "gateway", "operator", "saver", "tenant-acme"])
async def test_no_one_but_the_scheduler_reads_or_writes_commands_secrets(
    server: NatsServer, user: str
):
    subject = "sh.secret.cmd.cmd-0123456789abcdef"
    async with as_user(server, "scheduler") as scheduler:
        await scheduler.js.publish(subject, b'{"T": "v"}', stream=NAMES.secrets_stream)
        kept = await scheduler.js.get_last_msg(NAMES.secrets_stream, subject, direct=True)
        assert kept.data == b'{"T": "v"}'
    async with as_user(server, user) as someone:
        await someone.refused(
            someone.js.get_last_msg(NAMES.secrets_stream, subject, direct=True),
            f"DIRECT.GET.SH_SECRETS.{subject}",
        )
        await someone.refused(someone.nc.publish(subject, b"{}"), f'"{subject}"')
        await someone.refused(someone.js.consumer_info(NAMES.secrets_stream, "any"), "SH_SECRETS")


@pytest.mark.parametrize("user", ["host-h1", "gateway", "operator", "saver", "tenant-acme"])
async def test_no_one_but_the_scheduler_reads_writes_or_purges_connection_values(
    server: NatsServer, user: str
):
    """The host gets a sandbox's values in its work, never from the store."""
    subject = "sh.conn.sb-0123456789abcdef.cv-0123456789abcdef"
    async with as_user(server, "scheduler") as scheduler:
        await scheduler.js.publish(subject, b'{"value": "v"}', stream=NAMES.connections_stream)
        kept = await scheduler.js.get_last_msg(NAMES.connections_stream, subject, direct=True)
        assert kept.data == b'{"value": "v"}'
    async with as_user(server, user) as someone:
        await someone.refused(
            someone.js.get_last_msg(NAMES.connections_stream, subject, direct=True),
            f"DIRECT.GET.SH_CONNECTIONS.{subject}",
        )
        await someone.refused(someone.nc.publish(subject, b"{}"), f'"{subject}"')
        await someone.refused(
            someone.js.purge_stream(NAMES.connections_stream), "STREAM.PURGE.SH_CONNECTIONS"
        )


def test_docs_security_shows_the_permission_table_of_the_code():
    from sandhold.bus.permissions import table

    doc = (Path(__file__).parents[2] / "docs" / "security.md").read_text()
    shown = doc.split("<!-- permissions:begin -->\n", 1)[1].split("<!-- permissions:end -->")[0]
    assert shown == table(Names()), "regenerate the table: python -c 'from sandhold.bus...'"


def test_the_stream_list_permissions_name_is_every_stream_made():
    """The permissions and the start-up wait name streams by `Names.all_streams`:
    a stream added to `stream_configs` but not there would be unreachable."""
    from sandhold.bus.streams import stream_configs

    made = {str(c.name) for c in stream_configs(NAMES)} | {
        f"KV_{NAMES.lease_bucket}",
        f"KV_{NAMES.instance_bucket}",
    }
    assert set(NAMES.all_streams) == made
