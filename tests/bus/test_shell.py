"""The service shell: a crashed loop stops the service loudly; a stop is bounded,
connected or not (real service processes, a real nats-server killed under them)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import nats
import pytest
from sandhold.bus.names import Names
from sandhold.bus.server import NatsServer, free_port
from sandhold.bus.service import STOP_TIMEOUT_S, ServiceCrashed, Shell

from tests.support.bus import credential_file, make_streams


async def test_a_loop_that_raises_stops_the_service_and_says_which(
    nc: nats.NATS, nats_url: str, names: Names
):  # `nc`: the admin made the streams
    shell = Shell("test", nats_url, names)

    async def broken() -> None:
        await asyncio.sleep(0.05)
        raise ValueError("the loop's own bug")

    async def steady() -> None:
        await asyncio.Event().wait()

    with pytest.raises(ServiceCrashed, match="its broken loop crashed: ValueError"):
        async with shell:
            shell.spawn(steady(), "steady")
            shell.spawn(broken(), "broken")
            await asyncio.wait_for(shell.serve(), 10)
    assert shell.nc.is_closed


async def test_a_loop_cancelled_by_no_stop_stops_the_service_and_says_which(
    nc: nats.NATS, nats_url: str, names: Names
):
    """A cancellation meant for an await inside a loop that escaped it ends the
    loop as cancelled: its work (a host's lease renewal) must not stop unheard."""
    shell = Shell("test", nats_url, names)

    async def leaked() -> None:
        await asyncio.sleep(0.05)
        raise asyncio.CancelledError  # (as one escaping a timed-out inner await)

    with pytest.raises(ServiceCrashed, match="its leaked loop crashed: RuntimeError"):
        async with shell:
            shell.spawn(leaked(), "leaked")
            await asyncio.wait_for(shell.serve(), 10)
    assert shell.nc.is_closed


async def test_a_stop_while_serving_ends_every_loop_and_closes(
    nc: nats.NATS, nats_url: str, names: Names
):
    shell = Shell("test", nats_url, names)
    order: list[str] = []

    async def loop() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            order.append("loop ended")

    async def wind_down() -> None:
        order.append("wind down")  # while the loops still run

    async def close() -> None:
        order.append("closed")

    async with shell:
        shell.spawn(loop(), "loop")
        shell.on_stopping(wind_down)
        shell.on_close(close)
        asyncio.get_running_loop().call_later(0.1, shell.stop)
        await asyncio.wait_for(shell.serve(), 10)
    assert order == ["wind down", "loop ended", "closed"]
    assert shell.nc.is_closed
    # A shell in a process that is not the service's own freezes nothing (081).
    assert gc.get_freeze_count() == 0


def _service(
    module: str,
    url: str,
    names: Names,
    tmp_path: Path,
    credential: Path | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    env = {**os.environ, **(env or {}), "SANDHOLD_NATS_URL": url, "SANDHOLD_PREFIX": names.prefix}
    if credential is not None:
        env["SANDHOLD_NATS_CREDENTIALS"] = str(credential)
    with (tmp_path / f"{module}.log").open("wb") as log:  # the child keeps its own copy
        return subprocess.Popen(
            [sys.executable, "-m", module], env=env, stdout=log, stderr=subprocess.STDOUT
        )


async def _ready_service(
    module: str,
    server: NatsServer,
    names: Names,
    tmp_path: Path,
    credential: Path,
    env: dict[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """`_service`, once it has announced that it serves (its pid's readiness)."""
    nc = await nats.connect(server.admin_url)
    try:
        ready = await nc.subscribe(names.ready)
        process = _service(module, server.url, names, tmp_path, credential, env)
        try:
            async with asyncio.timeout(60):
                while msgspec.json.decode((await ready.next_msg(timeout=60)).data)["pid"] != (
                    process.pid
                ):
                    pass
        except BaseException:
            process.kill()  # (not handed to the test: stopped here)
            process.wait()
            raise
        return process
    finally:
        await nc.close()


def _exits_within(process: subprocess.Popen[bytes], seconds: float) -> int:
    try:
        return process.wait(seconds)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"still running {seconds}s after SIGTERM") from None


@pytest.mark.parametrize("module", ["sandhold.scheduler", "sandhold.recovery", "sandhold.saver"])
async def test_sigterm_stops_a_service_whose_nats_server_is_gone(module: str, tmp_path: Path):
    names = Names("gone")
    server = NatsServer(tmp_path / "nats", port=free_port(), names=names)
    credential = credential_file(server, module.rsplit(".", 1)[-1])
    server.start()
    process: subprocess.Popen[bytes] | None = None
    try:
        await make_streams(server, names)
        process = await _ready_service(module, server, names, tmp_path, credential)
        server.kill()
        process.send_signal(signal.SIGTERM)
        started = time.monotonic()
        code = await asyncio.to_thread(_exits_within, process, 2 * STOP_TIMEOUT_S + 10)
        assert code == 0, (tmp_path / f"{module}.log").read_text()[-2000:]
        assert time.monotonic() - started < 2 * STOP_TIMEOUT_S + 10
    finally:
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()
        server.stop()


async def test_sigterm_stops_a_service_still_waiting_for_its_first_connection(tmp_path: Path):
    names = Names("never")
    nowhere = f"nats://127.0.0.1:{free_port()}"  # nothing listens there
    process = _service("sandhold.recovery", nowhere, names, tmp_path)
    try:
        log = tmp_path / "sandhold.recovery.log"
        deadline = time.monotonic() + 30
        while b"Connection refused" not in log.read_bytes():  # it is trying
            assert time.monotonic() < deadline, log.read_text()
            await asyncio.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(_exits_within, process, STOP_TIMEOUT_S) == 0
    finally:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        process.wait()


async def test_a_stop_while_announcing_readiness_to_a_vanished_server_ends_quietly(
    tmp_path: Path,
):
    """NATS gone between the readiness announcement and its flush (seen in CI
    under load): the service must still stop on request, not crash."""
    server = NatsServer(tmp_path / "nats", port=free_port())
    server.start()
    await make_streams(server, Names("vanish"))
    shell = Shell("test", server.admin_url, Names("vanish"))
    crashed: list[BaseException] = []

    async def life() -> None:
        try:
            async with shell:
                server.kill()
                asyncio.get_running_loop().call_later(0.3, shell.stop)
                await shell.serve()
        except asyncio.CancelledError:
            pass  # a stop during start-up interrupts it
        except BaseException as err:  # noqa: BLE001 - what the test is about
            crashed.append(err)

    try:
        await asyncio.wait_for(asyncio.create_task(life()), STOP_TIMEOUT_S + 10)
    finally:
        server.stop()
    assert crashed == []


async def test_a_service_freezes_what_its_start_up_left_before_it_serves(tmp_path: Path):
    """Decision 081: a real service process moves what exists once it serves
    out of the cyclic collector's full collections, and says how much."""
    names = Names("frozen")
    server = NatsServer(tmp_path / "nats", port=free_port(), names=names)
    credential = credential_file(server, "recovery")
    server.start()
    process: subprocess.Popen[bytes] | None = None
    try:
        await make_streams(server, names)
        process = await _ready_service(
            "sandhold.recovery", server, names, tmp_path, credential,
            env={"SANDHOLD_LOG": "info", "SANDHOLD_LOG_FORMAT": "json"},
        )  # fmt: skip
        log = (tmp_path / "sandhold.recovery.log").read_text()
        messages = [
            msgspec.json.decode(line).get("message", "")
            for line in log.splitlines()
            if line.startswith("{")  # (a stray line of a library's own is not a log record)
        ]
        said = [m for m in messages if m.endswith("objects of its start-up frozen")]
        assert len(said) == 1, log[-2000:]
        frozen = int(said[0].removeprefix("recovery: ").split()[0])
        assert frozen > 10_000  # the modules, functions and types of a service at least
    finally:
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(2 * STOP_TIMEOUT_S + 10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        server.stop()
