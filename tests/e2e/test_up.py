"""`sandhold up` as a user runs it: ready line, runtime.json, clean stop, restart."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
from pathlib import Path

import nats
import pytest
from sandhold.bus import credentials
from sandhold.bus.names import Names
from sandhold.bus.permissions import inbox_prefix
from sandhold.bus.server import NatsServer
from sandhold.client import connect
from sandhold.domain.requests import command_id_for

from tests.e2e.conftest import running_sandbox
from tests.e2e.harness import SANDHOLD, Up, box_inits
from tests.support.bus import credential_file, hello, make_streams, ready_announcements
from tests.support.net import host_address
from tests.support.procs import alive, process_tree, stop_all
from tests.support.waiting import wait_until


async def _running(client, sandbox_id: str, command_id: str) -> bool:
    try:
        return (await client.show_command(sandbox_id, command_id)).state == "running"
    except Exception:
        return False


def _pids_in(sandbox_id: str) -> list[int]:
    """Processes in the sandbox's cgroups (its box, its commands), found from the host."""
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if f"/{sandbox_id}/" in (d / "cgroup").read_text():
                    found.append(int(d.name))
            except OSError:
                continue
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


async def test_up_writes_runtime_json_and_stops_everything_on_sigterm(tmp_path: Path):
    up = Up(tmp_path / "data").start()
    try:
        runtime = up.runtime
        assert runtime["nats_url"] == up.nats_url and up.nats_url.startswith("nats://127.0.0.1:")
        pids = [runtime["nats_pid"], *runtime["services"].values()]
        assert set(runtime["services"]) == {
            "scheduler",
            "saver",
            "recovery",
            "orchestrator",
            "metrics",
            "gateway",
            "host-agent:local",
        }
        assert runtime["gateway"]["url"] == up.gateway_url.rstrip("/")
        client = await connect(up.url)
        idle = await running_sandbox(client, key="idle")  # its box is a process too
        sandbox_id = await running_sandbox(client)
        done = up.cli("exec", sandbox_id, "--", "true")
        assert done.returncode == 0
        # a command still running when `up` stops must not be left behind
        sleeper = asyncio.create_task(client.exec(sandbox_id, ["sleep", "600"], key="sleeper"))
        command_id = command_id_for(sandbox_id, "sleeper")
        await wait_until(lambda: _running(client, sandbox_id, command_id), what="sleep running")
        tree = process_tree(pids) + _pids_in(sandbox_id) + _pids_in(idle)
        assert _pids_in(idle), "the idle sandbox's box runs"
        assert any(_cmdline(p) == "sleep 600" for p in tree)
        sleeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sleeper
        await client.close()
    finally:
        code = up.stop()
    assert code == 0
    assert not [p for p in tree if alive(p)], "processes left after sandhold up stopped"
    assert not (tmp_path / "data" / "runtime.json").exists()


async def test_kill_9_of_up_leaves_no_process_behind_and_the_next_up_opens_the_store(
    tmp_path: Path,
):
    """However `up` dies, its children die with it (a parent-death signal), the
    nats-server included: no orphan keeps writing the store, and the lock the
    dead `up` held is gone with it, so the next `up` starts on the same log."""
    first = Up(tmp_path / "data").start()
    try:
        runtime = first.runtime
        pids = [runtime["nats_pid"], *runtime["services"].values()]
        async with await connect(first.url) as client:
            sandbox_id = await running_sandbox(client)
        tree = process_tree(pids) + _pids_in(sandbox_id)
        assert first.process is not None
        os.kill(first.process.pid, signal.SIGKILL)
        await wait_until(
            lambda: not [p for p in tree if alive(p)],
            timeout=60,
            interval=0.2,
            what="every process of the killed up to end",
        )
    finally:
        first.stop()
    second = Up(tmp_path / "data").start()
    try:
        shown = second.cli_json("sandbox", "show", sandbox_id)
        assert shown["id"] == sandbox_id
        ran = second.cli("exec", sandbox_id, "--", "true")
        assert ran.returncode == 0, ran.stderr
    finally:
        second.stop()


async def test_a_second_up_on_the_same_data_dir_reuses_the_log(tmp_path: Path):
    first = Up(tmp_path / "data").start()
    try:
        created = first.cli_json("sandbox", "create", "--wait")
        assert first.cli("exec", created["id"], "--", "sh", "-c", "echo 1 > mark").returncode == 0
        # while it runs, another `up` on the same dir is refused
        refused = subprocess.run(
            [SANDHOLD, "--data-dir", str(tmp_path / "data"), "up"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert refused.returncode == 1 and "another `sandhold up`" in refused.stderr
        assert first.process is not None and f"pid {first.process.pid}" in refused.stderr
    finally:
        first.stop()
    # Each service kept its folded state as it stopped; the next folds from there.
    checkpoints = tmp_path / "data" / "checkpoints"
    for instance in ("scheduler", "recovery"):
        for kind in ("sandbox", "host"):
            assert (checkpoints / instance / f"{kind}.checkpoint").stat().st_size > 0
    assert (checkpoints / "metrics" / "metrics.checkpoint").stat().st_size > 0  # decision 062
    second = Up(tmp_path / "data").start()
    try:
        shown = second.cli_json("sandbox", "show", created["id"])
        assert shown["id"] == created["id"] and shown["generation"] == 1
        listed = second.cli_json("sandbox", "ls")
        assert created["id"] in {s["id"] for s in listed}
        started = (tmp_path / "data" / "logs" / "scheduler.log").read_text()
        assert "sandbox: 1 aggregate(s) from the checkpoint at seq" in started
        # and what a restart believed is what the log says
        verified = second.cli("replay", "sandbox", created["id"], "--verify")
        assert verified.returncode == 0, verified.stdout + verified.stderr
        assert "scheduler's checkpoint matches the log" in verified.stdout
    finally:
        second.stop()


def test_cli_without_a_server_says_how_to_start_one(tmp_path: Path):
    done = subprocess.run(
        [SANDHOLD, "--data-dir", str(tmp_path), "sandbox", "ls"],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "SANDHOLD_NATS_URL": ""},
    )
    assert done.returncode != 0
    assert "sandhold up" in done.stderr


async def test_services_run_alone_against_a_given_server(tmp_path: Path):
    server = NatsServer(tmp_path / "nats")
    # run elsewhere, a service is given its credential (`sandhold credentials`)
    scheduler = credential_file(server, "scheduler")
    host = credential_file(server, "host-agent", "h1")
    operator = credential_file(server, "operator")
    server.start()
    await make_streams(server, Names())
    procs: list[subprocess.Popen[bytes]] = []
    nc = await nats.connect(server.admin_url)
    try:
        ready = await ready_announcements(nc)
        for service, extra in (
            ("scheduler", ["--credentials", str(scheduler), "--metrics-port", "0"]),
            (
                "host-agent",
                ["--host-id", "h1", "--root", str(tmp_path / "h1"), "--credentials", str(host)],
            ),
        ):
            procs.append(
                subprocess.Popen(
                    [SANDHOLD, "run", service, "--nats", server.url, *extra],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        await wait_until(lambda: len(ready) == 2, timeout=30, what="both services ready")
        services = {json.loads(r)["service"] for r in ready}
        assert services == {"scheduler", "host-agent"}
        # Its /metrics listens on loopback only unless told otherwise.
        [metrics_port] = [json.loads(r)["metrics_port"] for r in ready if b"metrics_port" in r]
        _, writer = await asyncio.open_connection("127.0.0.1", metrics_port)
        writer.close()
        elsewhere = host_address()
        assert elsewhere is not None, "this test needs an address other than loopback"
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection(elsewhere, metrics_port)
        client = await connect(server.url, credentials=credentials.load(operator))
        sandbox_id = await running_sandbox(client)
        result = await client.exec(sandbox_id, ["python3", "-c", "print('alone')"])
        assert result.stdout == b"alone\n"
        assert (await client.show_sandbox(sandbox_id)).host == "h1"
        await client.close()
    finally:
        await nc.close()
        stop_all(procs, grace_s=30)
        # A standalone agent keeps its sandboxes running when it exits (for the next one).
        for pid in box_inits(tmp_path / "h1"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        server.stop()


@pytest.mark.parametrize(
    "service",
    ["scheduler", "saver", "recovery", "orchestrator", "gateway", "metrics", "host-agent"],
)
async def test_a_service_whose_server_is_gone_ends_on_sigterm(tmp_path: Path, service: str):
    """Connected or not, a service asked to stop stops: one left waiting for a
    server that never comes back would hold its port and its work forever."""
    server = NatsServer(tmp_path / "nats")
    host = "h1" if service == "host-agent" else None
    credential = credential_file(server, service, *([host] if host else []))
    server.start()
    await make_streams(server, Names())
    nc = await nats.connect(server.admin_url)
    proc: subprocess.Popen[bytes] | None = None
    try:
        ready = await ready_announcements(nc)
        extra = {
            "orchestrator": ["--work-dir", str(tmp_path / "work")],
            "gateway": ["--data-dir", str(tmp_path / "gateway")],
            "host-agent": ["--host-id", "h1", "--root", str(tmp_path / "h1")],
        }.get(service, [])
        proc = subprocess.Popen(
            [SANDHOLD, "run", service, "--nats", server.url, "--credentials", str(credential),
             "--metrics-port", "0", *extra],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        await wait_until(lambda: ready, timeout=30, what=f"{service} ready")
        await nc.close()
        server.kill()  # gone for good: nothing answers any more
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(proc.wait, 30)  # raises TimeoutExpired if it hangs
        assert code is not None
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        server.stop()


async def test_a_credential_made_for_a_host_elsewhere_works_at_once_and_ends_when_revoked(
    own_up: Up, tmp_path: Path
):
    out = tmp_path / "h9.json"
    made = own_up.cli(
        "credentials", "create", "--role", "host-agent", "--host", "h9", "--out", str(out)
    )
    assert made.returncode == 0, made.stderr
    assert out.stat().st_mode & 0o777 == 0o600
    listed = own_up.cli_json("credentials", "ls", "--json")
    assert {"user": "host-h9", "role": "host-agent", "host": "h9", "tenant": None} in listed
    h9 = credentials.load(out)
    closed = asyncio.Event()

    async def on_closed() -> None:
        closed.set()

    nc = await nats.connect(
        own_up.nats_url, user=h9.user, password=h9.password, allow_reconnect=False,
        closed_cb=on_closed, inbox_prefix=inbox_prefix(h9.user),
    )  # fmt: skip
    try:
        # no restart: the running server took the new user
        assert (await nc.jetstream().stream_info("SH_EVENTS")).config.name == "SH_EVENTS"
        revoked = own_up.cli("credentials", "revoke", "host-h9")
        assert revoked.returncode == 0, revoked.stderr
        await asyncio.wait_for(closed.wait(), 30)  # the server ended its connection
    finally:
        await nc.close()
    refused = await hello(own_up.nats_url, {"user": h9.user, "pass": h9.password})
    assert b"Authorization Violation" in refused
    assert own_up.cli("credentials", "revoke", "admin").returncode != 0


async def test_what_up_keeps_is_its_owners_alone(up: Up, client):
    """The data dir (credentials, tokens, the log's store, every sandbox's files)
    is 0700; the files that hold secrets are 0600 themselves, and so is a
    command's spec (its environment)."""
    assert up.data_dir.stat().st_mode & 0o777 == 0o700
    for private in [
        *up.data_dir.joinpath("credentials").iterdir(),
        up.data_dir / "nats" / "nats-server.conf",
        up.data_dir / "tokens.json",
    ]:
        assert private.stat().st_mode & 0o077 == 0, private
    sandbox_id = await running_sandbox(client)
    result = await client.exec(sandbox_id, ["true"], env={"A_SETTING": "x"})
    [spec] = up.data_dir.glob(
        f"hosts/local/sandboxes/{sandbox_id}/commands/{result.command.id}/spec.json"
    )
    assert spec.stat().st_mode & 0o077 == 0


async def test_up_started_with_a_strict_umask_runs_sandboxes_and_keeps_its_files_private(
    tmp_path: Path,
):
    """A hardened login (umask 077) must not break the sandboxes, whose trees the
    host-agent builds for users other than root; the services' own files are
    private whatever the umask (here: the gateway's read model)."""
    strict = Up(tmp_path / "data", umask=0o077).start()
    try:
        client = await connect(strict.url)
        try:
            sandbox_id = await running_sandbox(client)
            result = await client.exec(sandbox_id, ["sh", "-c", "echo fine > f; cat f"])
            assert (result.command.state, result.stdout) == ("exited", b"fine\n")
        finally:
            await client.close()
    finally:
        strict.stop()
    read_model = tmp_path / "data" / "gateway" / "read-model.sqlite"
    assert read_model.stat().st_mode & 0o077 == 0


async def test_a_killed_nats_server_is_started_again_on_its_port_and_store(own_up: Up):
    """`up` supervises its server as it does its services: killed, it comes back
    where the services left it, with the log it had."""
    created = own_up.cli_json("sandbox", "create", "--wait")
    old = own_up.runtime["nats_pid"]
    os.kill(old, signal.SIGKILL)

    def restarted() -> bool:
        now = own_up.runtime["nats_pid"]
        return now != old and alive(now)

    await wait_until(restarted, timeout=30, what="the server started again")
    assert own_up.runtime["nats_url"] == own_up.nats_url  # the same port
    ran = own_up.cli("exec", created["id"], "--", "sh", "-c", "echo back")
    assert ran.returncode == 0 and ran.stdout == "back\n", ran.stderr


async def test_up_gives_its_hosts_the_capacity_asked_for(tmp_path: Path):
    up = Up(tmp_path / "data", "--host-capacity", "1").start()
    try:
        client = await connect(up.url)
        try:
            await running_sandbox(client, key="fits")
            second = await client.create_sandbox(key="waits")
            waiting = await client.wait_for(
                second.id,
                lambda s: s if s.phase == "pending" and s.reason else None,
                timeout=30,
                what="a reason to wait",
            )
            assert waiting.reason == "no host has room: 1/1"
        finally:
            await client.close()
    finally:
        assert up.stop() == 0
