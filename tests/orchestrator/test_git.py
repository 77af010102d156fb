"""`clone` against a real `git daemon` on loopback, and the failures staging must tell apart."""

from __future__ import annotations

import asyncio
import os
import random
import select
import socket
from pathlib import Path

import pytest
import uvloop
from sandhold.domain.retry import backoff_delay, retry_budget
from sandhold.domain.task_manifest import RetryPolicy
from sandhold.orchestrator.git import CloneFailed, classify_stderr, clone

from tests.orchestrator.conftest import GitDaemon, GitRepo, ProxyFactory, git
from tests.support.waiting import wait_until

TIMEOUT_S = 60.0
# Real backoff, kept short: these tests are about which failures are retried.
FAST = RetryPolicy(base_delay=0.01, max_delay=0.05)


async def clone_with_retries(
    url: str, ref: str, dest: Path, failures: list[CloneFailed], *, timeout_s: float = TIMEOUT_S
) -> str:
    """Retry `clone` the way the orchestrator does: by error class, with backoff."""
    while True:
        try:
            return await clone(url, ref, dest, timeout_s=timeout_s)
        except CloneFailed as err:
            failures.append(err)
            if len(failures) > retry_budget(err.error_class, FAST):
                raise
            delay = backoff_delay(
                len(failures),
                base_s=float(FAST.base_delay),
                cap_s=float(FAST.max_delay),
                jitter=random.random(),
            )
            await asyncio.sleep(delay)


def readme(dest: Path) -> str:
    return (dest / "README").read_text().strip()


def assert_nothing_left(dest: Path) -> None:
    """Neither `dest` nor a hidden partial clone next to it."""
    assert not dest.exists()
    assert [p.name for p in dest.parent.iterdir() if p.name.startswith(f".{dest.name}")] == []


async def test_a_branch_is_checked_out_at_its_tip(
    git_repo: GitRepo, git_daemon: GitDaemon, tmp_path: Path
) -> None:
    dest = tmp_path / "work" / "repo"
    sha = await clone(git_daemon.url_for(git_repo.name), "main", dest, timeout_s=TIMEOUT_S)
    assert sha == git_repo.main
    assert readme(dest) == "three"
    assert git("rev-parse", "HEAD", cwd=dest) == sha
    assert git("status", "--porcelain", cwd=dest) == ""
    assert [p.name for p in dest.parent.iterdir()] == ["repo"]  # no partial clone beside it


async def test_a_tag_is_checked_out_at_the_commit_it_names(
    git_repo: GitRepo, git_daemon: GitDaemon, tmp_path: Path
) -> None:
    dest = tmp_path / "repo"
    sha = await clone(git_daemon.url_for(git_repo.name), "v1", dest, timeout_s=TIMEOUT_S)
    assert sha == git_repo.tagged
    assert readme(dest) == "two"


async def test_a_full_ref_name_works_too(
    git_repo: GitRepo, git_daemon: GitDaemon, tmp_path: Path
) -> None:
    dest = tmp_path / "repo"
    url = git_daemon.url_for(git_repo.name)
    assert await clone(url, "refs/tags/v1", dest, timeout_s=TIMEOUT_S) == git_repo.tagged


async def test_a_commit_no_ref_points_at_is_fetched_shallowly(
    git_repo: GitRepo, flaky_proxy: ProxyFactory, tmp_path: Path
) -> None:
    proxy = await flaky_proxy()  # only to count connections
    dest = tmp_path / "repo"
    sha = await clone(proxy.url_for(git_repo.name), git_repo.first, dest, timeout_s=TIMEOUT_S)
    assert sha == git_repo.first
    assert readme(dest) == "one"
    assert proxy.connections == 1  # protocol v2 serves any commit: no fallback needed
    assert (dest / ".git" / "shallow").exists()


async def test_a_v0_server_refuses_an_unadvertised_sha_so_everything_is_fetched(
    git_repo: GitRepo, flaky_proxy: ProxyFactory, tmp_path: Path
) -> None:
    proxy = await flaky_proxy(v0_only=True)
    dest = tmp_path / "repo"
    sha = await clone(proxy.url_for(git_repo.name), git_repo.first, dest, timeout_s=TIMEOUT_S)
    assert sha == git_repo.first
    assert readme(dest) == "one"
    assert proxy.connections == 2  # the refused shallow fetch, then the full one


async def test_a_v0_server_still_serves_a_branch_shallowly(
    git_repo: GitRepo, flaky_proxy: ProxyFactory, tmp_path: Path
) -> None:
    proxy = await flaky_proxy(v0_only=True)
    sha = await clone(proxy.url_for(git_repo.name), "main", tmp_path / "r", timeout_s=TIMEOUT_S)
    assert sha == git_repo.main
    assert proxy.connections == 1


@pytest.mark.parametrize("v0_only", [False, True])
async def test_an_unknown_sha_is_permanent(
    git_repo: GitRepo, flaky_proxy: ProxyFactory, tmp_path: Path, v0_only: bool
) -> None:
    proxy = await flaky_proxy(v0_only=v0_only)
    dest = tmp_path / "repo"
    with pytest.raises(CloneFailed) as caught:
        await clone(proxy.url_for(git_repo.name), "ab" * 20, dest, timeout_s=TIMEOUT_S)
    assert (caught.value.reason, caught.value.error_class) == ("ref_not_found", "permanent")
    assert_nothing_left(dest)


async def test_a_bad_ref_fails_at_once_without_retries(
    git_repo: GitRepo, flaky_proxy: ProxyFactory, tmp_path: Path
) -> None:
    proxy = await flaky_proxy()
    dest = tmp_path / "repo"
    failures: list[CloneFailed] = []
    with pytest.raises(CloneFailed) as caught:
        await clone_with_retries(proxy.url_for(git_repo.name), "no-such-branch", dest, failures)
    err = caught.value
    assert (err.reason, err.error_class, err.retryable) == ("ref_not_found", "permanent", False)
    assert "no-such-branch" in err.detail
    assert len(failures) == 1
    assert proxy.connections == 1
    assert_nothing_left(dest)


async def test_an_unknown_repository_is_permanent(git_daemon: GitDaemon, tmp_path: Path) -> None:
    dest = tmp_path / "repo"
    with pytest.raises(CloneFailed) as caught:
        await clone(git_daemon.url_for("nope.git"), "main", dest, timeout_s=TIMEOUT_S)
    assert (caught.value.reason, caught.value.error_class) == ("repository_not_found", "permanent")
    assert_nothing_left(dest)


@pytest.mark.parametrize(
    ("url", "ref", "reason"),
    [
        ("nosuchscheme://x/y", "main", "bad_url"),
        ("--upload-pack=touch /tmp/x", "main", "bad_url"),
        ("git://127.0.0.1:1/x", "--help", "bad_ref"),
        ("git://127.0.0.1:1/x", "", "bad_ref"),
    ],
)
async def test_a_malformed_url_or_ref_is_permanent(
    tmp_path: Path, url: str, ref: str, reason: str
) -> None:
    dest = tmp_path / "repo"
    with pytest.raises(CloneFailed) as caught:
        await clone(url, ref, dest, timeout_s=TIMEOUT_S)
    assert (caught.value.reason, caught.value.error_class) == (reason, "permanent")
    assert_nothing_left(dest)


async def test_connection_refused_is_a_network_error(tmp_path: Path) -> None:
    # Bound but not listening: connections are refused, and no one else can take the port.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        dest = tmp_path / "repo"
        with pytest.raises(CloneFailed) as caught:
            await clone(f"git://127.0.0.1:{port}/x.git", "main", dest, timeout_s=TIMEOUT_S)
    err = caught.value
    assert (err.reason, err.error_class, err.retryable) == ("network", "network", True)
    assert "refused" in err.detail.lower()
    assert_nothing_left(dest)


@pytest.mark.parametrize("how", ["reset", "close"])
async def test_dropped_connections_are_retried_until_a_clone_succeeds(
    git_repo: GitRepo, flaky_proxy: ProxyFactory, tmp_path: Path, how: str
) -> None:
    proxy = await flaky_proxy(fail_first=2, how=how)
    dest = tmp_path / "repo"
    failures: list[CloneFailed] = []
    sha = await clone_with_retries(proxy.url_for(git_repo.name), "main", dest, failures)
    assert sha == git_repo.main
    assert [(f.reason, f.error_class) for f in failures] == [("network", "network")] * 2
    assert proxy.connections == 3
    assert readme(dest) == "three"


async def test_more_drops_than_the_budget_fail_as_network(
    git_repo: GitRepo, flaky_proxy: ProxyFactory, tmp_path: Path
) -> None:
    proxy = await flaky_proxy(fail_first=100)
    dest = tmp_path / "repo"
    failures: list[CloneFailed] = []
    with pytest.raises(CloneFailed) as caught:
        await clone_with_retries(proxy.url_for(git_repo.name), "main", dest, failures)
    assert caught.value.error_class == "network"
    assert len(failures) == 1 + FAST.network
    assert proxy.connections == 1 + FAST.network
    assert_nothing_left(dest)


def git_processes_for(dest: Path) -> list[int]:
    """Pids of the gits working on `dest`'s hidden partial clone (from their command lines)."""
    marker = str(dest.parent / f".{dest.name}.partial-").encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(arg.startswith(marker) for arg in argv):
            found.append(int(entry))
    return found


def group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


async def hanging_git_group(dest: Path) -> int:
    pids = await wait_until(lambda: git_processes_for(dest), what="git to be running")
    pgid = os.getpgid(pids[0])
    assert pgid == pids[0] != os.getpgrp()  # git leads a process group of its own
    return pgid


async def test_a_server_that_never_answers_times_out_and_git_is_killed(
    git_repo: GitRepo, flaky_proxy: ProxyFactory, tmp_path: Path
) -> None:
    proxy = await flaky_proxy(fail_first=100, how="hang")
    dest = tmp_path / "repo"
    # Long enough to see git hanging first; the test does not measure it.
    task = asyncio.create_task(clone(proxy.url_for(git_repo.name), "main", dest, timeout_s=5.0))
    await wait_until(lambda: proxy.connections == 1 or task.done(), what="git to connect")
    assert not task.done()
    pgid = await hanging_git_group(dest)
    with pytest.raises(CloneFailed) as caught:
        await task
    err = caught.value
    assert (err.reason, err.error_class, err.retryable) == ("timeout", "network", True)
    assert "fetch" in err.detail
    await wait_until(lambda: not group_exists(pgid), what="git's process group to be gone")
    assert proxy.connections == 1
    assert_nothing_left(dest)


async def test_a_cancelled_clone_kills_git_and_leaves_nothing(
    git_repo: GitRepo, flaky_proxy: ProxyFactory, tmp_path: Path
) -> None:
    proxy = await flaky_proxy(fail_first=100, how="hang")
    dest = tmp_path / "repo"
    task = asyncio.create_task(clone(proxy.url_for(git_repo.name), "main", dest, timeout_s=600))
    await wait_until(lambda: proxy.connections == 1, what="git to connect")
    pgid = await hanging_git_group(dest)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_until(lambda: not group_exists(pgid), what="git's process group to be gone")
    assert_nothing_left(dest)


def test_under_uvloop_as_in_the_service_a_hung_clone_is_killed_too(tmp_path: Path) -> None:
    async def scenario() -> None:
        # Listening but never accepting: the kernel completes the handshake, no one answers.
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen()
            url = f"git://127.0.0.1:{listener.getsockname()[1]}/x.git"
            dest = tmp_path / "repo"
            task = asyncio.create_task(clone(url, "main", dest, timeout_s=5.0))
            await wait_until(
                lambda: select.select([listener], [], [], 0)[0] or task.done(),
                what="git to connect",
            )
            assert not task.done()
            pgid = await hanging_git_group(dest)
            with pytest.raises(CloneFailed) as caught:
                await task
            assert caught.value.reason == "timeout"
            await wait_until(lambda: not group_exists(pgid), what="git's group to be gone")
            assert_nothing_left(dest)

    uvloop.run(scenario())


async def test_an_empty_dest_is_filled(
    git_repo: GitRepo, git_daemon: GitDaemon, tmp_path: Path
) -> None:
    dest = tmp_path / "repo"
    dest.mkdir()
    sha = await clone(git_daemon.url_for(git_repo.name), "main", dest, timeout_s=TIMEOUT_S)
    assert sha == git_repo.main
    assert readme(dest) == "three"


async def test_a_dest_with_files_is_refused_and_left_alone(
    git_repo: GitRepo, git_daemon: GitDaemon, tmp_path: Path
) -> None:
    dest = tmp_path / "repo"
    dest.mkdir()
    (dest / "mine").write_text("keep me")
    with pytest.raises(CloneFailed) as caught:
        await clone(git_daemon.url_for(git_repo.name), "main", dest, timeout_s=TIMEOUT_S)
    assert (caught.value.reason, caught.value.error_class) == ("dest_not_empty", "permanent")
    assert [p.name for p in dest.iterdir()] == ["mine"]


async def test_the_callers_git_configuration_does_not_reach_git(
    git_repo: GitRepo, git_daemon: GitDaemon, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = git_daemon.url_for(git_repo.name)
    home = tmp_path / "home"
    (home / ".config" / "git").mkdir(parents=True)
    rewrite = f'[url "git://127.0.0.1:1/"]\n\tinsteadOf = {url}\n'
    (home / ".gitconfig").write_text(rewrite)
    (home / ".config" / "git" / "config").write_text(rewrite)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home / ".config"))
    monkeypatch.setenv("GIT_DIR", str(tmp_path / "elsewhere"))  # as inside a git hook
    monkeypatch.setenv("GIT_CONFIG_PARAMETERS", "'protocol.git.allow'='never'")
    monkeypatch.setenv("LC_ALL", "de_DE.UTF-8")
    assert await clone(url, "main", tmp_path / "repo", timeout_s=TIMEOUT_S) == git_repo.main


@pytest.mark.parametrize(
    ("stderr", "reason", "error_class"),
    [
        ("fatal: couldn't find remote ref nope", "ref_not_found", "permanent"),
        (
            "fatal: remote error: upload-pack: not our ref " + "ab" * 20,
            "ref_not_found",
            "permanent",
        ),
        (
            "ERROR: Repository not found.\nfatal: Could not read from remote repository.\n\n"
            "Please make sure you have the correct access rights\nand the repository exists.",
            "repository_not_found",
            "permanent",
        ),
        (
            "remote: Repository not found.\nfatal: repository 'https://h/x/' not found",
            "repository_not_found",
            "permanent",
        ),
        (
            "git@h: Permission denied (publickey).\nfatal: Could not read from remote repository.",
            "access_denied",
            "permanent",
        ),
        (
            "fatal: could not read Username for 'https://h': terminal prompts disabled",
            "access_denied",
            "permanent",
        ),
        ("fatal: unable to access 'https://h/x/': Could not resolve host: h", "network", "network"),
        ("fatal: the remote end hung up unexpectedly\nfatal: early EOF", "network", "network"),
        (
            "error: RPC failed; HTTP 502 curl 22 The requested URL returned error: 502",
            "network",
            "network",
        ),
        ("fatal: Could not read from remote repository.", "network", "network"),
        ("fatal: something nobody has seen", "git_failed", "permanent"),
    ],
)
def test_stderr_is_classified(stderr: str, reason: str, error_class: str) -> None:
    assert classify_stderr(stderr.encode()) == (reason, error_class)


@pytest.mark.parametrize("scheme", ["file", "http"])
async def test_only_network_transports_with_tls_or_ssh_are_allowed(
    git_repo: GitRepo, tmp_path: Path, scheme: str
):
    """A manifest's repository must not read the orchestrator's own disk (file://)
    nor go in the clear (http://): git runs with https, ssh and git only (ext::,
    a command line, is git's own default refusal and stays refused)."""
    with socket.socket() as nowhere:
        nowhere.bind(("127.0.0.1", 0))
        port = nowhere.getsockname()[1]
        url = f"file://{git_repo.path}" if scheme == "file" else f"http://127.0.0.1:{port}/r.git"
        with pytest.raises(CloneFailed) as failed:
            await clone(url, "main", tmp_path / "r", timeout_s=TIMEOUT_S)
    assert failed.value.reason == "bad_url", failed.value
    assert f"transport '{scheme}' not allowed" in failed.value.detail
