"""The command launcher (launcher.py): its program on its own, then a box's
command started through it and through the Python join it replaces, which
must give the same process and the same launch failures."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from sandhold.hostagent.driver import CommandExit, ProcessDriver, launcher
from sandhold.hostagent.driver.joining import (
    ROOT_CAPABILITIES,
    BoxTarget,
    Joiner,
    launch_failure,
)
from sandhold.hostagent.driver.process_identity import ProcessIdentity

from tests.hostagent.conftest import collect, init_pid, proc_status

pytestmark = pytest.mark.skipif(launcher.program() is None, reason="no launcher for this CPU")

SB = "sb-00000000000a0c01"


def _spawn(plan: launcher.Plan, path: str, report_w: int) -> subprocess.Popen[bytes]:
    """As the supervisor starts it; returns once the report's write end is the
    child's alone."""
    try:
        return launcher.start(path, plan.encode(), (report_w,), stdout=subprocess.PIPE)
    finally:
        os.close(report_w)


def _report(report_r: int, plan: launcher.Plan) -> tuple[str, int] | None:
    with os.fdopen(report_r, "rb") as report:
        return plan.failure(report.read())


@pytest.fixture
def path(tmp_path: Path) -> str:
    return launcher.install(str(tmp_path / "launcher"))  # (and proved to run here)


def _exec_plan(report_fd: int, candidates: list[str], argv: list[str]) -> launcher.Plan:
    plan = launcher.Plan(report_fd)
    plan.call(launcher.SYS_OPEN, plan.string(os.devnull), os.O_RDONLY, what="stdin")
    plan.call(launcher.SYS_FCNTL, report_fd, 2, 1, what="cloexec")
    args, envp = plan.strings(argv), plan.strings(["WHO=launched"])
    for n, candidate in enumerate(candidates):
        last = n == len(candidates) - 1
        flags = launcher.FAIL | launcher.LAST if last else 0
        plan.call(launcher.SYS_EXECVE, plan.string(candidate), args, envp, what="exec", flags=flags)
    return plan


def test_it_runs_its_steps_and_execs_the_first_candidate_that_runs(path: str) -> None:
    report_r, report_w = os.pipe()
    plan = _exec_plan(
        report_w, ["/nonexistent/sh", "/bin/sh"], ["sh", "-c", 'echo "$WHO"; ls /proc/self/fd']
    )
    child = _spawn(plan, path, report_w)
    assert _report(report_r, plan) is None  # end of file: the exec closed it
    out, _ = child.communicate(timeout=10)
    assert child.returncode == 0
    lines = out.decode().splitlines()
    assert lines[0] == "launched"  # the plan's environment, not ours
    # The shell's `ls` holds 0-2 and its directory: not the plan, not the report.
    assert sorted(int(line) for line in lines[1:]) == [0, 1, 2, 3]


def test_a_failing_step_is_reported_by_what_it_was_and_its_errno(path: str) -> None:
    report_r, report_w = os.pipe()
    plan = launcher.Plan(report_w)
    plan.call(launcher.SYS_FCNTL, report_w, 2, 1, what="cloexec")
    plan.call(launcher.SYS_CHDIR, plan.string("/no/such/dir"), what="passed over", flags=0)
    plan.call(launcher.SYS_CHDIR, plan.string("/no/such/dir/either"), what="the second chdir")
    plan.call(launcher.SYS_CHDIR, plan.string("/"), what="never run", flags=launcher.LAST)
    child = _spawn(plan, path, report_w)
    assert _report(report_r, plan) == ("the second chdir", 2)  # ENOENT
    child.communicate(timeout=10)
    assert child.returncode == 127


def test_a_step_marked_last_that_returns_is_reported_too(path: str) -> None:
    report_r, report_w = os.pipe()
    plan = launcher.Plan(report_w)
    plan.call(launcher.SYS_CHDIR, plan.string("/"), what="the end", flags=launcher.LAST)
    child = _spawn(plan, path, report_w)
    assert _report(report_r, plan) == ("the end", 0)
    child.communicate(timeout=10)
    assert child.returncode == 127


def test_a_plan_it_cannot_hold_is_refused_before_anything_starts() -> None:
    plan = launcher.Plan(4)
    with pytest.raises(ValueError, match="NUL"):
        plan.string("a\0b")
    plan.put(bytes(launcher.BUFFER_SIZE))
    with pytest.raises(ValueError, match="buffer"):
        plan.encode()
    many = launcher.Plan(4)
    for _ in range(launcher.MAX_STEPS):
        many.call(launcher.SYS_CLOSE, 9, what="close")
    with pytest.raises(ValueError, match="steps"):
        many.call(launcher.SYS_CLOSE, 9, what="close")


def test_its_reports_read_as_the_python_join_words_them() -> None:
    argv = ["tool", "--x"]
    assert launch_failure("chdir", 2, argv, "/w") == "working directory does not exist: /w"
    assert launch_failure("chdir", 13, argv, "/w") == "working directory /w: Permission denied"
    assert launch_failure("execve", 2, argv, "/w") == "executable not found: tool"
    assert launch_failure("execve", 13, argv, "/w") == "executable not found: tool"
    assert launch_failure("execve", 13, ["./s.sh"], "/w") == "not an executable file: ./s.sh"
    assert launch_failure("execve", 8, ["./s"], "/w") == "cannot start ./s: Exec format error"
    assert (
        launch_failure("joining the user namespace", 1, argv, "/w")
        == "joining the user namespace: Operation not permitted"
    )


def test_a_plan_joins_in_the_order_the_python_join_does() -> None:
    me = ProcessIdentity.of(os.getpid())
    assert me is not None
    target = BoxTarget(init=me.to_json(), uid=1000, gid=1000, groups=[1000], seccomp=None)
    joiner = Joiner(target)
    joiner._fds = {name: 20 + n for n, name in enumerate(("pid", *joining_order))}
    joiner._filter_program = bytes(8)  # one instruction: where the filter goes
    plan = joiner.plan(["prog"], "/w", {"PATH": "/a:/b"}, ["/cg/memory/x/cgroup.procs"], 9)
    numbers = [number for number, _, _ in plan.steps]
    first = {number: numbers.index(number) for number in reversed(numbers)}
    # stdin first, then the report closed on exec and dumpable off, before any join
    assert plan.steps[0][0] == launcher.SYS_OPEN and plan.steps[1][1][:3] == (9, 2, 1)
    assert plan.steps[2][1][:2] == (4, 0)  # PR_SET_DUMPABLE 0
    # cgroups (as host root) before the user namespace, which is joined first
    assert first[launcher.SYS_WRITE] < first[launcher.SYS_SETNS]
    setns = [args[0] for number, args, _ in plan.steps if number == launcher.SYS_SETNS]
    assert setns == [20 + n for n in range(1, 7)]  # user, mnt, net, ipc, uts, cgroup
    prctls = [args[:2] for number, args, _ in plan.steps if number == launcher.SYS_PRCTL]
    assert prctls.index((38, 1)) < prctls.index((22, 2))  # no_new_privs, then the filter
    assert first[launcher.SYS_SETRESUID] < numbers.index(launcher.SYS_CHDIR)
    # every step stops the launch on failure but the PATH candidates before the last
    execs = [flags for number, _, flags in plan.steps if number == launcher.SYS_EXECVE]
    assert execs == [0, launcher.FAIL | launcher.LAST]
    rest = [flags for number, _, flags in plan.steps if number != launcher.SYS_EXECVE]
    assert rest and all(flags == launcher.FAIL for flags in rest)


joining_order = ("user", "mnt", "net", "ipc", "uts", "cgroup")


# --- through the driver: the launcher and the Python join give the same command ---


@pytest.fixture(params=["launcher", "python"])
async def boxed(
    request: pytest.FixtureRequest,
    make_driver: Callable[..., Awaitable[ProcessDriver]],
    monkeypatch: pytest.MonkeyPatch,
) -> ProcessDriver:
    if request.param == "python":  # as on a CPU the launcher has no code for
        monkeypatch.setattr(launcher, "program", lambda machine=None: None)
    driver = await make_driver()
    driver.join = request.param  # type: ignore[attr-defined]
    await driver.create_sandbox(SB, None)
    return driver


async def test_a_boxed_command_is_the_same_process_either_way(boxed: ProcessDriver) -> None:
    for user in ("user", "root"):
        shell = await boxed.launch(SB, f"fds-{user}", ["sh", "-c", "ls /proc/self/fd"], user=user)  # type: ignore[arg-type]
        out, err, end = await collect(shell)
        assert (end.reason, end.exit_code) == ("exited", 0), err
        assert sorted(int(x) for x in out.split()) == [0, 1, 2, 3]  # `ls` and its directory
        handle = await boxed.launch(SB, f"sleep-{user}", ["sleep", "30"], user=user)  # type: ignore[arg-type]
        pid = await handle.started()
        assert isinstance(pid, int)
        try:
            fields = proc_status(pid)
            offset = boxed.id_offset(SB)
            expected = offset if user == "root" else offset + 1000
            assert [int(v) for v in fields["Uid"].split()] == [expected] * 4
            assert [int(v) for v in fields["Gid"].split()] == [expected] * 4
            assert [int(g) for g in fields["Groups"].split()] == [expected]
            assert fields["NoNewPrivs"].strip() == "1"
            assert fields["Seccomp"].strip() == "2"  # a filter
            kept = ROOT_CAPABILITIES if user == "root" else frozenset()
            assert int(fields["CapBnd"], 16) == sum(1 << cap for cap in kept)
            assert int(fields["CapEff"], 16) == sum(1 << cap for cap in kept)
            # None blocked; none of the standard ones ignored (SIGPIPE, SIGXFSZ: Python's)
            assert int(fields["SigBlk"], 16) == 0
            assert int(fields["SigIgn"], 16) & (1 << 31) - 1 == 0
            assert len(fields["NSpid"].split()) == 2  # born in the box's pid namespace
            assert os.getsid(pid) == pid  # a session of its own
            init = init_pid(boxed, SB)
            for ns in ("pid", "user", "mnt", "net", "ipc", "uts", "cgroup"):
                assert os.readlink(f"/proc/{pid}/ns/{ns}") == os.readlink(f"/proc/{init}/ns/{ns}")
            # In each of the command's own cgroups, as the spec names them.
            spec = json.loads(boxed.layout.command(SB, f"sleep-{user}").spec.read_text())
            assert (spec["box"]["launcher"] is None) == (boxed.join == "python")  # type: ignore[attr-defined]
            assert spec["cgroup_procs"]
            for procs in spec["cgroup_procs"]:
                assert pid in [int(p) for p in Path(procs).read_text().split()]
        finally:
            await boxed.interrupt(SB, f"sleep-{user}", grace_s=0)
            await handle.wait()


@pytest.mark.parametrize(
    ("argv", "cwd", "detail"),
    [
        (["nosuchprog", "--flag"], None, "executable not found: nosuchprog"),
        (["./script.sh"], None, "not an executable file: ./script.sh"),
        (["/bin/true"], "/x/does/not/exist", "working directory does not exist: /x/does/not/exist"),
    ],
)
async def test_a_launch_fails_in_the_same_words_either_way(
    boxed: ProcessDriver, argv: list[str], cwd: str | None, detail: str
) -> None:
    (boxed.workspace(SB) / "script.sh").write_text("echo hi\n")
    end = await (await boxed.launch(SB, "c1", argv, cwd=cwd)).wait()
    assert isinstance(end, CommandExit)
    assert (end.reason, end.detail) == ("launch_failed", detail)


async def test_a_launcher_gone_from_the_host_is_a_launch_failure_that_says_so(
    make_driver: Callable[..., Awaitable[ProcessDriver]],
) -> None:
    driver = await make_driver()
    await driver.create_sandbox(SB, None)
    gone = driver.layout.root / "launcher"
    gone.unlink()
    end = await (await driver.launch(SB, "c1", ["/bin/true"])).wait()
    assert (end.reason, end.detail) == (
        "launch_failed",
        f"cannot start the launcher {gone}: No such file or directory",
    )


async def test_a_step_that_fails_midway_stops_the_command_before_it_runs(
    boxed: ProcessDriver,
) -> None:
    # A filter the kernel refuses (one instruction, an unknown opcode): the
    # launch stops at that step, after every join before it, and says so.
    (boxed.layout.root / "seccomp.bpf").write_bytes(b"\xff\xff" + bytes(6))
    marker = boxed.workspace(SB) / "ran"
    end = await (await boxed.launch(SB, "c1", ["sh", "-c", f"touch {marker.name}"])).wait()
    assert (end.reason, end.detail) == (
        "launch_failed",
        "installing the seccomp filter: Invalid argument",
    )
    assert not marker.exists()


async def test_a_launcher_that_cannot_run_here_leaves_the_python_join(
    make_driver: Callable[..., Awaitable[ProcessDriver]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Written, but the kernel will not exec it (as on a host root mounted noexec).
    monkeypatch.setattr(launcher, "program", lambda machine=None: b"not an ELF image")
    driver = await make_driver()
    assert driver.capabilities()["launcher"] is False
    await driver.create_sandbox(SB, None)
    handle = await driver.launch(SB, "c1", ["sh", "-c", "echo ran"])
    out, _, end = await collect(handle)
    assert (end.reason, end.exit_code, out) == ("exited", 0, b"ran\n")
    spec = json.loads(driver.layout.command(SB, "c1").spec.read_text())
    assert spec["box"]["launcher"] is None
