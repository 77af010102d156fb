"""Cgroup backends against a fake directory tree, and the pure helpers."""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

import pytest
from sandhold.hostagent.driver import NoCgroups, V1Cgroups, V2Cgroups, detect_cgroups
from sandhold.hostagent.driver.cgroups import (
    CgroupError,
    join_self,
    parse_frozen,
    parse_mounts,
    parse_oom_kills,
    parse_pids,
)
from sandhold.hostagent.driver.layout import HostLayout, check_id

V1_OOM_CONTROL = "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n"
V2_MEMORY_EVENTS = "low 0\nhigh 0\nmax 12\noom 1\noom_kill 3\noom_group_kill 0\n"


def test_parse_oom_kills_reads_v1_and_v2_files() -> None:
    assert parse_oom_kills(V1_OOM_CONTROL) == 2
    assert parse_oom_kills(V2_MEMORY_EVENTS) == 3
    # Old v1 kernels have no counter: no kill can be attributed.
    assert parse_oom_kills("oom_kill_disable 0\nunder_oom 0\n") == 0


def test_parse_helpers() -> None:
    assert parse_pids("12\n7\n") == [12, 7]
    assert parse_pids("") == []
    assert parse_frozen("populated 1\nfrozen 1\n")
    assert not parse_frozen("populated 1\nfrozen 0\n")
    [mount] = parse_mounts(r"cgroup /sys/fs/cgroup/with\040space cgroup rw,memory 0 0")
    assert mount.target == Path("/sys/fs/cgroup/with space")
    assert "memory" in mount.options


def _fake_mounts(tmp_path: Path, *, v2_controllers: str | None, v1: tuple[str, ...]) -> str:
    lines = []
    if v2_controllers is not None:
        unified = tmp_path / "unified"
        unified.mkdir()
        (unified / "cgroup.controllers").write_text(v2_controllers)
        lines.append(f"cgroup2 {unified} cgroup2 rw,relatime 0 0")
    for controller in v1:
        (tmp_path / controller).mkdir()
        lines.append(f"cgroup {tmp_path / controller} cgroup rw,relatime,{controller} 0 0")
    return "\n".join(lines) + "\n"


def test_detect_skips_a_unified_hierarchy_without_memory(tmp_path: Path) -> None:
    mounts = _fake_mounts(tmp_path, v2_controllers="cpu io", v1=("memory", "freezer"))
    backend = detect_cgroups("h1", mounts_text=mounts)
    assert isinstance(backend, V1Cgroups)
    assert backend.can_freeze


def test_detect_prefers_v2_with_memory(tmp_path: Path) -> None:
    mounts = _fake_mounts(tmp_path, v2_controllers="cpu memory pids", v1=())
    assert isinstance(detect_cgroups("h1", mounts_text=mounts), V2Cgroups)


def test_detect_v1_without_freezer_and_nothing_at_all(tmp_path: Path) -> None:
    backend = detect_cgroups(
        "h1", mounts_text=_fake_mounts(tmp_path, v2_controllers=None, v1=("memory",))
    )
    assert isinstance(backend, V1Cgroups) and not backend.can_freeze
    assert "freezer" in backend.message
    backend = detect_cgroups("h1", mounts_text="proc /proc proc rw 0 0\n")
    assert isinstance(backend, NoCgroups)
    assert "memory limits are not enforced" in backend.message


def test_v1_paths_limits_and_command_cgroups(tmp_path: Path) -> None:
    memory, freezer = tmp_path / "memory", tmp_path / "freezer"
    sandbox = memory / "sandhold" / "h1" / "sb"
    sandbox.mkdir(parents=True)
    (sandbox / "memory.memsw.limit_in_bytes").write_text("-1")
    backend = V1Cgroups(memory, freezer, "h1")
    backend.create_sandbox("sb", 32 << 20)
    assert (sandbox / "memory.limit_in_bytes").read_text() == str(32 << 20)
    assert (sandbox / "memory.memsw.limit_in_bytes").read_text() == str(32 << 20)
    assert (freezer / "sandhold" / "h1" / "sb").is_dir()
    command = backend.create_command("sb", "c1")
    # The process must join both hierarchies, or the freezer would miss it.
    assert command.procs == [
        str(sandbox / "c1" / "cgroup.procs"),
        str(freezer / "sandhold" / "h1" / "sb" / "c1" / "cgroup.procs"),
    ]
    assert command.oom_file == str(sandbox / "c1" / "memory.oom_control")
    Path(command.oom_file).write_text(V1_OOM_CONTROL)
    assert backend.oom_kills("sb", "c1") == 2
    Path(command.procs[0]).write_text("101\n102\n")
    (sandbox / "cgroup.procs").write_text("")
    assert backend.pids("sb") == [101, 102]
    backend.freeze("sb", timeout_s=0.1)  # a plain file reads back FROZEN at once
    assert (freezer / "sandhold" / "h1" / "sb" / "freezer.state").read_text() == "FROZEN"


def test_v2_delegates_memory_down_to_command_cgroups(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("cpu memory")
    (tmp_path / "cgroup.subtree_control").write_text("cpu")
    backend = V2Cgroups(tmp_path, "h1")
    assert backend.enforces_memory_limit
    backend.create_sandbox("sb", 64 << 20)
    sandbox = tmp_path / "sandhold" / "h1" / "sb"
    for level in (tmp_path, tmp_path / "sandhold", tmp_path / "sandhold" / "h1", sandbox):
        assert (level / "cgroup.subtree_control").read_text() == "+memory"
    assert (sandbox / "memory.max").read_text() == str(64 << 20)
    backend.create_sandbox("sb", None)
    assert (sandbox / "memory.max").read_text() == "max"
    command = backend.create_command("sb", "c1")
    assert command.procs == [str(sandbox / "c1" / "cgroup.procs")]
    Path(command.oom_file or "").write_text(V2_MEMORY_EVENTS)
    assert backend.oom_kills("sb", "c1") == 3


@pytest.mark.parametrize("bad", ["", "..", "a/b", ".hidden", "a..b", "x" * 200, "sp ace"])
def test_ids_that_could_escape_their_directory_are_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        check_id("sandbox id", bad)


def test_layout(tmp_path: Path) -> None:
    layout = HostLayout(tmp_path)
    assert layout.workspace("sb") == tmp_path / "sandboxes" / "sb" / "workspace"
    paths = layout.command("sb", "c-1.2")
    assert paths.exit == tmp_path / "sandboxes" / "sb" / "commands" / "c-1.2" / "exit.json"
    assert layout.sandbox_ids() == [] and layout.command_ids("sb") == []


def test_pids_events_max_count_is_read() -> None:
    from sandhold.hostagent.driver.cgroups import parse_pids_max_events

    assert parse_pids_max_events("max 3\n") == 3
    assert parse_pids_max_events("max 0\n") == 0
    assert parse_pids_max_events("") == 0


def test_detect_passes_over_mounts_that_are_files(tmp_path: Path) -> None:
    """A network namespace kept by `ip netns add` is a file mounted on a file: a
    machine with one still finds its cgroups (it once made the agent crash)."""
    netns = tmp_path / "netns-h1"
    netns.write_text("")
    mounts = f"nsfs {netns} nsfs rw 0 0\n" + _fake_mounts(
        tmp_path, v2_controllers="cpu memory pids", v1=()
    )
    assert isinstance(detect_cgroups("h1", mounts_text=mounts), V2Cgroups)


def test_join_self_moves_only_the_caller_on_v1_and_names_the_file_it_could_not(
    tmp_path: Path,
) -> None:
    """v1 (a `tasks` file beside cgroup.procs): "0" into `tasks`, which skips the
    kernel's global lock (decision 052); v2 (none): the pid into cgroup.procs."""
    v1, v2 = tmp_path / "v1", tmp_path / "v2"
    for directory in (v1, v2):
        directory.mkdir()
        (directory / "cgroup.procs").write_text("")
    (v1 / "tasks").write_text("")
    assert join_self([str(v1 / "cgroup.procs"), str(v2 / "cgroup.procs")]) is None
    assert (v1 / "tasks").read_text() == "0"
    assert (v1 / "cgroup.procs").read_text() == ""
    assert (v2 / "cgroup.procs").read_text() == str(os.getpid())
    gone = str(tmp_path / "gone" / "cgroup.procs")
    assert join_self([gone]) == f"cannot join cgroup {gone}: No such file or directory"


def test_a_cgroup_the_kernel_will_not_make_says_the_machine_may_be_out_of_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """mkdir answers EBUSY once a controller has 65,535 cgroups (seen on this
    machine, with those of thrown-away data dirs): the error says so and counts."""
    memory = tmp_path / "memory"
    memory.mkdir()
    backend = V1Cgroups(memory, None, "h1")

    def refuse(self: Path, *args: object, **kwargs: object) -> None:
        raise OSError(errno.EBUSY, os.strerror(errno.EBUSY))

    monkeypatch.setattr(Path, "mkdir", refuse)
    with pytest.raises(CgroupError) as refused:
        backend.create_sandbox("sb", None)
    message = str(refused.value)
    assert f"cannot create cgroup {memory / 'sandhold' / 'h1' / 'sb'}" in message
    assert "the machine may have no more cgroups" in message
    assert re.search(r"\(\w+ \d+(, \w+ \d+)* exist\)", message), message
