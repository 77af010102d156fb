"""The sandbox as a boundary: real escape attempts from inside, on real namespaces.

Each test runs a command inside a namespaced sandbox that tries something a
hostile tenant would, and asserts that it failed (and, where it could have
left a trace, that the host shows none). docs/isolation.md states the threat
model these tests stand for.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sandhold.hostagent.driver import CommandExit, ProcessDriver, box_init

from tests.support.net import host_address
from tests.support.waiting import wait_until

from .conftest import A, B, collect, init_pid, proc_status


async def run(
    driver: ProcessDriver, sandbox: str, script: str, *, user: str = "user"
) -> tuple[str, str, CommandExit]:
    command_id = f"c-{uuid.uuid4().hex[:12]}"
    handle = await driver.launch(sandbox, command_id, ["sh", "-c", script], user=user)  # type: ignore[arg-type]
    stdout, stderr, end = await collect(handle)
    return stdout.decode(), stderr.decode(), end


@pytest.fixture
async def listener() -> AsyncIterator[int]:
    """A TCP server on the host's loopback, standing in for NATS and the gateway."""
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()


async def test_another_sandboxes_files_are_out_of_reach(two: ProcessDriver) -> None:
    out, err, end = await run(two, A, "echo tenant-a-secret > /workspace/secret; echo ok")
    assert (out, end.reason) == ("ok\n", "exited"), err
    host_path = two.workspace(A) / "secret"
    assert host_path.read_text() == "tenant-a-secret\n"  # it is there, on the host
    relative = os.path.relpath(host_path, two.workspace(B))  # ../../../sb-a/… from B's
    for path in (str(host_path), relative, f"/workspace/{relative}", f"/../../{A}/workspace"):
        out, err, end = await run(two, B, f"cat {path} || ls {path}")
        assert "tenant-a-secret" not in out
        assert end.exit_code != 0, (path, out, err)


async def test_the_data_dir_is_out_of_reach(two: ProcessDriver, root: Path) -> None:
    data_dir = root.parent.parent
    (data_dir / "tokens.json").write_text('{"secret": "host-token"}')
    (data_dir / "runtime.json").write_text('{"nats_url": "nats://127.0.0.1:1"}')
    for name in ("tokens.json", "runtime.json"):
        out, _, end = await run(two, A, f"cat {data_dir / name}")
        assert "host-token" not in out and "nats_url" not in out
        assert end.exit_code != 0
    out, _, end = await run(two, A, f"ls {root} {root}/sandboxes", user="root")
    assert end.exit_code != 0 and A not in out


async def test_the_hosts_etc_cannot_be_written(two: ProcessDriver) -> None:
    marker = f"sandhold-escape-{uuid.uuid4().hex}"
    _, err, end = await run(two, A, f"echo pwned > /etc/{marker}")
    assert end.exit_code != 0 and "Permission denied" in err
    # The sandbox's root may change its own /etc (in its upper layer), never the host's.
    out, _, end = await run(two, A, f"echo mine > /etc/{marker} && cat /etc/{marker}", user="root")
    assert (out, end.exit_code) == ("mine\n", 0)
    assert not Path(f"/etc/{marker}").exists()
    out, _, _ = await run(two, B, f"cat /etc/{marker}")
    assert out == ""  # nor another sandbox's


async def test_host_loopback_services_are_unreachable(two: ProcessDriver, listener: int) -> None:
    # Reachable from the host itself, so the refusal below is the sandbox's doing.
    reader, writer = await asyncio.open_connection("127.0.0.1", listener)
    writer.close()
    probe = (
        "import socket, sys\n"
        "s = socket.socket()\n"
        "s.settimeout(3)\n"
        "try:\n"
        f"    s.connect((sys.argv[1], {listener}))\n"
        "    print('connected')\n"
        "except OSError as err:\n"
        "    print('refused', err.errno)\n"
    )
    host_ip = host_address()
    for address in ["127.0.0.1", *([host_ip] if host_ip else [])]:
        command_id = f"net-{uuid.uuid4().hex[:8]}"
        handle = await two.launch(A, command_id, ["python3", "-c", probe, address])
        out, _, end = await collect(handle)
        assert end.reason == "exited"
        assert out.decode().startswith("refused"), (address, out)


async def test_host_processes_are_invisible(two: ProcessDriver) -> None:
    out, _, end = await run(two, A, "ps -eo pid=,args=")
    assert end.exit_code == 0
    lines = [line.split(None, 1) for line in out.strip().splitlines()]
    # the init (and a holder where box_init has no program), this shell and ps
    assert 3 <= len(lines) <= 8, out
    assert all(int(pid) < 100 for pid, _ in lines)
    assert not any("pytest" in args or "sandhold" in args for _, args in lines), out
    out, _, _ = await run(two, A, f"cat /proc/{os.getpid()}/cmdline | tr '\\0' ' '")
    assert "pytest" not in out


@pytest.mark.skipif(box_init.program() is None, reason="box_init has no program for this CPU")
async def test_the_boxs_pid_1_maps_no_shared_file(two: ProcessDriver) -> None:
    # Every process mapping libc lengthens the kernel's reverse-map walks that
    # forks and execs on the whole host wait for (box_init says why).
    out, _, end = await run(two, A, "true")
    assert end.exit_code == 0
    maps = Path(f"/proc/{init_pid(two, A)}/maps").read_text().splitlines()
    files = {line.split(None, 5)[5] for line in maps if len(line.split(None, 5)) == 6}
    assert {f for f in files if not f.startswith("[")} == {box_init.PATH_INSIDE}, maps


async def test_orphans_inside_are_reaped(two: ProcessDriver) -> None:
    # The command's shell exits at once; its `sleep` is re-parented to the box's
    # pid 1, which must reap it when it ends, or it stays a zombie for ever.
    out, _, end = await run(two, A, "sleep 0.3 & echo $!")
    assert end.exit_code == 0
    orphan = out.strip()

    async def gone() -> bool:
        out, _, _ = await run(two, A, f"ps -o stat=,args= -p {orphan} || true")
        return out.strip() == ""

    await wait_until(gone, timeout=15, what=f"the orphan {orphan} reaped")


@pytest.mark.skipif(box_init.program() is None, reason="box_init has no program for this CPU")
@pytest.mark.parametrize("signal_name", ["KILL", "TERM"])
async def test_the_sandboxs_root_cannot_end_its_box(two: ProcessDriver, signal_name: str) -> None:
    # `kill -1` reaches every process in the box but pid 1 and the caller; the
    # shell holder used elsewhere dies of it, and its box with it.
    init = init_pid(two, A)
    _, err, end = await run(two, A, f"kill -{signal_name} 1; kill -{signal_name} -1", user="root")
    assert end.reason == "exited", err
    out, _, end = await run(two, A, "echo still")
    assert (out, end.exit_code) == ("still\n", 0)
    assert init_pid(two, A) == init  # the same box, not a new one


@pytest.mark.skipif(box_init.program() is None, reason="box_init has no program for this CPU")
async def test_the_sandboxs_root_cannot_rewrite_its_pid_1(two: ProcessDriver) -> None:
    # Same user, no ptrace needed: only pid 1 being not dumpable closes /proc/1/mem.
    probe = (
        "try:\n"
        "    open('/proc/1/mem', 'r+b')\n"
        "    print('opened')\n"
        "except OSError as e:\n"
        "    print(e.errno)"
    )
    out, err, end = await run(two, A, f'python3 -c "{probe}"', user="root")
    assert end.exit_code == 0, err
    assert out.strip() in ("1", "13"), out  # EPERM or EACCES, never "opened"


@pytest.mark.parametrize("user", ["user", "root"])
async def test_mounting_and_new_namespaces_are_refused(two: ProcessDriver, user: str) -> None:
    attempts = {
        "mount": "mkdir -p /tmp/m && mount -t tmpfs none /tmp/m",
        "bind": "mount --bind / /tmp",
        "unshare": "unshare -r true",
        "unshare-mount": "unshare -m true",
    }
    for name, script in attempts.items():
        _, err, end = await run(two, A, script, user=user)
        assert end.exit_code != 0, (name, err)


async def test_loading_a_kernel_module_is_refused(two: ProcessDriver) -> None:
    script = (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "fd = os.open('/dev/null', os.O_RDONLY)\n"
        "print(libc.init_module(b'', 0, b''), ctypes.get_errno(),"
        " libc.syscall(313, fd, b'', 0), ctypes.get_errno())\n"  # finit_module on x86_64
    )
    handle = await two.launch(A, "mod", ["python3", "-c", script], user="root")
    out, _, end = await collect(handle)
    assert end.exit_code == 0
    init_rc, init_errno, finit_rc, finit_errno = out.decode().split()
    assert (init_rc, finit_rc) == ("-1", "-1")
    assert int(init_errno) == int(finit_errno) == 1  # EPERM


async def test_ptrace_is_refused(two: ProcessDriver) -> None:
    script = (
        "import ctypes\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]\n"
        "print(libc.ptrace(16, 1, None, None), ctypes.get_errno())\n"  # PTRACE_ATTACH to pid 1
    )
    handle = await two.launch(A, "ptrace", ["python3", "-c", script], user="root")
    out, _, end = await collect(handle)
    assert end.exit_code == 0
    assert out.decode().split() == ["-1", "1"]


async def test_a_setuid_file_in_the_persistent_layer_grants_nothing(two: ProcessDriver) -> None:
    setup = (
        "cp /usr/bin/id /workspace/rootid && chmod 4755 /workspace/rootid && "
        "echo root-only > /root/secret && chmod 600 /root/secret && "
        "cp /bin/cat /workspace/rootcat && chmod 4755 /workspace/rootcat && ls -l /workspace"
    )
    out, err, end = await run(two, A, setup, user="root")
    assert end.exit_code == 0, err
    assert "-rwsr-xr-x" in out
    out, err, end = await run(two, A, "/workspace/rootid -u; /workspace/rootcat /root/secret")
    assert out.splitlines()[0] == "1000"  # no euid 0: no_new_privs
    assert "root-only" not in out and "Permission denied" in err


@pytest.mark.parametrize("user", ["user", "root"])
async def test_from_the_host_a_command_is_never_host_root(two: ProcessDriver, user: str) -> None:
    handle = await two.launch(A, f"sleep-{user}", ["sleep", "30"], user=user)  # type: ignore[arg-type]
    pid = await handle.started()
    assert isinstance(pid, int)
    try:
        fields = proc_status(pid)
        uids = [int(v) for v in fields["Uid"].split()]
        offset = two.id_offset(A)
        expected = offset if user == "root" else offset + 1000
        assert uids == [expected] * 4 and offset > 0
        assert fields["NoNewPrivs"].strip() == "1"
        assert fields["Seccomp"].strip() == "2"  # a filter
        if user == "user":
            assert int(fields["CapEff"], 16) == 0
        assert int(fields["CapBnd"], 16) & (1 << 21) == 0  # no CAP_SYS_ADMIN, even for root
        # Its own pid namespace: the host's pid is not the one it sees.
        assert fields["NSpid"].split()[0] == str(pid) and len(fields["NSpid"].split()) == 2
    finally:
        await two.interrupt(A, f"sleep-{user}", grace_s=0)
        await handle.wait()


async def test_everyday_tools_still_work_inside(two: ProcessDriver) -> None:
    script = (
        "set -e; cd /workspace; mkdir proj; cd proj; "
        "git init -q; echo hello > README; git add README; "
        "git -c user.email=a@b -c user.name=agent commit -qm first; git log --oneline | wc -l; "
        "python3 -c 'import json, sqlite3; print(json.dumps({\"ok\": True}))'; "
        "echo data > /tmp/t && cat /tmp/t; echo home > ~/file && cat ~/file"
    )
    out, err, end = await run(two, A, script)
    assert end.exit_code == 0, err
    assert out.split() == ["1", '{"ok":', "true}", "data", "home"]
    # As root, the sandbox may install into its own /usr (an upper layer, never the host's).
    marker = f"sandhold-{uuid.uuid4().hex}"
    script = f"echo tool > /usr/local/bin/{marker} && echo ok"
    out, err, end = await run(two, A, script, user="root")
    assert (out, end.exit_code) == ("ok\n", 0), err
    assert not Path(f"/usr/local/bin/{marker}").exists()


async def test_a_fork_bomb_ends_resource_exhausted_naming_the_process_limit(
    driver: ProcessDriver,
) -> None:
    if not driver.cgroups.enforces_pids_limit:
        pytest.skip(f"no pids controller here: {driver.cgroups.message}")
    await driver.create_sandbox("small", None, pids_limit=32)
    bomb = "for i in $(seq 200); do sleep 5 & done; wait"
    handle = await driver.launch("small", "bomb", ["sh", "-c", bomb])
    _, _, end = await collect(handle)
    assert end.reason == "resource_exhausted", end
    assert "process limit (pids)" in end.detail
    await driver.stop_sandbox("small", grace=0)
    # The limit is the sandbox's: an ordinary command there still runs.
    await driver.create_sandbox("small", None, pids_limit=32)
    stdout, _, end = await collect(await driver.launch("small", "ok", ["sh", "-c", "echo fine"]))
    assert (stdout, end.reason) == (b"fine\n", "exited")


async def test_egress_reaches_out_but_never_the_hosts_loopback(
    driver: ProcessDriver, listener: int
) -> None:
    from sandhold.hostagent.driver.boxes import SandboxSettings, network_modes

    if "egress" not in network_modes():
        # .ci/run installs slirp4netns and sets this, so CI never skips it.
        assert not os.environ.get("SANDHOLD_REQUIRE_EGRESS"), "slirp4netns is not installed"
        pytest.skip("network egress needs slirp4netns: apt install slirp4netns")
    host_ip = host_address()
    assert host_ip is not None, "this test needs an address other than loopback"
    # A service on the host's own (non-loopback) address stands in for the internet.
    outside = await asyncio.start_server(lambda r, w: w.close(), host_ip, 0)
    outside_port = outside.sockets[0].getsockname()[1]
    try:
        await driver.create_sandbox(A, None, SandboxSettings(network="egress"))
        # A blocking connect with SO_SNDTIMEO, not settimeout(): see PROBE in
        # tests/e2e/test_boundary.py (slirp's ICMP refusal can look like success
        # to a poll-based connect).
        probe = (
            "import socket, struct, sys\n"
            "for host, port in ((sys.argv[1], int(sys.argv[2])), ('10.0.2.2', int(sys.argv[3])),"
            " ('127.0.0.1', int(sys.argv[3]))):\n"
            "    s = socket.socket()\n"
            "    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack('ll', 5, 0))\n"
            "    try:\n"
            "        s.connect((host, port)); print('connected')\n"
            "    except OSError as err:\n"
            "        print('refused')\n"
        )
        argv = ["python3", "-c", probe, host_ip, str(outside_port), str(listener)]
        out, _, end = await collect(await driver.launch(A, "egress", argv))
        assert end.reason == "exited"
        # out, yes; the host's loopback through the gateway address or directly, never
        assert out.decode().split() == ["connected", "refused", "refused"]
        assert driver.sandbox_capabilities(A)["network"] == "egress"
    finally:
        outside.close()
        await outside.wait_closed()


async def test_a_cpu_limit_throttles_a_busy_command(driver: ProcessDriver) -> None:
    if not driver.cgroups.enforces_cpu_limit:
        pytest.skip(f"no cpu controller here: {driver.cgroups.message}")
    await driver.create_sandbox("slow", None, cpu_limit=0.1)
    before = driver.cgroups.cpu_stat("slow").get("nr_throttled", 0)
    spin = ["python3", "-c", "while True: pass"]
    handle = await driver.launch("slow", "spin", spin, timeout_s=120.0)
    assert isinstance(await handle.started(), int)

    def throttled() -> bool:
        # The kernel holds it back: it runs out of its quota period after period.
        return driver.cgroups.cpu_stat("slow").get("nr_throttled", 0) > before + 3

    try:
        await wait_until(throttled, timeout=60, what="the busy command is throttled")
    finally:
        await driver.interrupt("slow", "spin", grace_s=0)
    end = await handle.wait()
    assert end.reason == "interrupted"  # a throttle, never an end of its own


async def test_a_commands_final_kill_reaches_only_its_own_processes(two: ProcessDriver) -> None:
    neighbour = await two.launch(A, "neighbour", ["sleep", "60"])
    assert isinstance(await neighbour.started(), int)
    stubborn = "trap '' TERM; sleep 60 & wait"
    end = await (
        await two.launch(A, "stubborn", ["sh", "-c", stubborn], timeout_s=0.3, kill_grace_s=0.2)
    ).wait()
    assert end.reason == "timed_out" and end.signal == 9
    # The other command and the box itself live on.
    out, _, end = await run(two, A, "echo still here")
    assert (out, end.reason) == ("still here\n", "exited")
    assert neighbour.exit_record() is None
    await two.interrupt(A, "neighbour", grace_s=0)
    assert (await neighbour.wait()).reason == "interrupted"


def _tiny_image(directory: Path) -> None:
    """A root file system of three programs and the libraries they need (from the host)."""
    import shutil
    import subprocess

    programs = ["/bin/sh", "/bin/sleep", "/bin/cat"]
    needed = set(programs)
    for program in programs:
        listed = subprocess.run(["ldd", program], capture_output=True, text=True).stdout
        needed |= {word for word in listed.split() if word.startswith("/")}
    for path in needed:
        target = directory / os.path.realpath(path).lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(os.path.realpath(path), target)
        alias = directory / path.lstrip("/")
        if not alias.exists():
            alias.parent.mkdir(parents=True, exist_ok=True)
            alias.symlink_to(os.path.realpath(path))
    (directory / "etc").mkdir(exist_ok=True)
    (directory / "etc" / "image-marker").write_text("from the image\n")


async def test_an_image_is_the_whole_base_and_only_from_the_image_directories(
    make_driver, root: Path, tmp_path: Path
) -> None:
    from sandhold.hostagent.driver.boxes import IsolationUnavailable, SandboxSettings

    images = tmp_path / "images"
    _tiny_image(images / "tiny")
    driver = await make_driver(image_roots=[images])
    await driver.create_sandbox(A, None, SandboxSettings(image="tiny"))
    out, err, end = await run(
        driver, A, "cat /etc/image-marker; test -e /usr/bin/python3 || echo no-python"
    )
    assert (out, end.exit_code) == ("from the image\nno-python\n", 0), err
    assert driver.sandbox_capabilities(A)["base"] == "image tiny"
    # A host directory outside the image directories is never a base.
    for image in ("/", str(root), "../" * 8 + "etc"):
        with pytest.raises(IsolationUnavailable, match="not in this host's image directories"):
            await driver.create_sandbox(B, None, SandboxSettings(image=image))


async def test_a_full_disk_ends_resource_exhausted_naming_the_disk_quota(
    driver: ProcessDriver,
) -> None:
    from sandhold.hostagent.driver import disk
    from sandhold.hostagent.driver.boxes import SandboxSettings

    if (why := disk.problem()) is not None:
        # .ci/run sets this where the machine has loop devices, so CI never skips it.
        assert not os.environ.get("SANDHOLD_REQUIRE_DISK_QUOTA"), why
        pytest.skip(why)
    assert driver.capabilities()["disk_quota"] is True
    limit = 64 << 20
    await driver.create_sandbox(A, None, SandboxSettings(disk_limit_bytes=limit))
    await driver.create_sandbox(B, None)
    fs_dir = driver.layout.sandbox_dir(A) / "fs"
    assert fs_dir.is_mount()
    assert driver.sandbox_capabilities(A)["disk_limit_bytes"] == str(limit)
    # The sandbox sees its quota as its root's size (overlayfs reports its upper's).
    out, err, end = await run(driver, A, "df -k / | tail -1")
    assert end.exit_code == 0, err
    assert 40 * 1024 < int(out.split()[1]) <= limit // 1024, out
    # An ordinary failure on a disk with room is just an exit.
    _, _, end = await run(driver, A, "echo some > /workspace/small; exit 3")
    assert (end.reason, end.exit_code) == ("exited", 3)
    # Writing past the quota (anywhere in the root) fails, and says why.
    _, err, end = await run(driver, A, "dd if=/dev/zero of=/home/sandbox/big bs=1M count=200")
    assert end.reason == "resource_exhausted", (end, err)
    assert "disk quota reached" in end.detail and "MiB" in end.detail
    assert "No space left on device" in err
    # Files of the sandbox are on its disk, and nothing of them reached the host's.
    assert (driver.save_root(A) / "root" / "workspace" / "small").read_text() == "some\n"
    # The quota is that sandbox's: its neighbour writes on.
    _, err, end = await run(driver, B, "dd if=/dev/zero of=/workspace/big bs=1M count=80")
    assert (end.reason, end.exit_code) == ("exited", 0), err
    # Freed space is usable again, and destroying the sandbox ends its disk.
    _, _, end = await run(driver, A, "rm /home/sandbox/big && echo again > /workspace/again")
    assert (end.reason, end.exit_code) == ("exited", 0)
    await driver.destroy_sandbox(A)
    assert not fs_dir.is_mount() and not driver.layout.sandbox_dir(A).exists()


async def test_a_sandbox_disk_is_mounted_again_after_the_host_lost_its_mounts(
    driver: ProcessDriver,
) -> None:
    from sandhold.hostagent.driver import disk
    from sandhold.hostagent.driver.boxes import SandboxSettings

    if (why := disk.problem()) is not None:
        # .ci/run sets this where the machine has loop devices, so CI never skips it.
        assert not os.environ.get("SANDHOLD_REQUIRE_DISK_QUOTA"), why
        pytest.skip(why)
    await driver.create_sandbox(A, None, SandboxSettings(disk_limit_bytes=64 << 20))
    _, _, end = await run(driver, A, "echo kept > /workspace/kept")
    assert end.exit_code == 0
    await driver.stop_sandbox(A, grace=0)
    # A reboot: the box and the mount are gone, the image stays.
    disk.detach(driver.layout.sandbox_dir(A) / "fs")
    assert driver.has_local_copy(A)  # looks through the disk, mounting it again
    await driver.create_sandbox(A, None)
    out, _, end = await run(driver, A, "cat /workspace/kept; df -k / | tail -1")
    assert out.splitlines()[0] == "kept" and int(out.splitlines()[1].split()[1]) < 65536, out
