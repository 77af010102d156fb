"""Fixtures for staging: a real bare repository, a real `git daemon` serving it
on loopback, and a loopback proxy in front of the daemon that fails on purpose.

Every process started here is stopped by its pid (its process group, so
`git daemon`'s per-connection `upload-pack` children go too), also when the
test fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import struct
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest

# Git for the fixtures themselves: no system or user configuration, fixed authors.
GIT_ENV = {
    **{k: v for k, v in os.environ.items() if not k.startswith("GIT_")},
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_AUTHOR_NAME": "Sandhold Test",
    "GIT_AUTHOR_EMAIL": "test@sandhold.invalid",
    "GIT_COMMITTER_NAME": "Sandhold Test",
    "GIT_COMMITTER_EMAIL": "test@sandhold.invalid",
    "LC_ALL": "C",
}


def git(*args: str, cwd: Path) -> str:
    done = subprocess.run(
        ["git", *args], cwd=cwd, env=GIT_ENV, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed: {done.stderr}")
    return done.stdout.strip()


@dataclass(frozen=True)
class GitRepo:
    """A bare repository with three commits on `main`; README holds "one", "two", "three".

    `first` is reachable only through `main` (no ref points at it); the
    annotated tag `v1` points at the second commit, `tagged`.
    """

    path: Path  # the bare repository, inside the daemon's base path
    name: str  # its name in a URL: git_daemon.url_for(git_repo.name)
    first: str
    tagged: str
    main: str
    branch: str = "main"
    tag: str = "v1"


@pytest.fixture
def git_repo(tmp_path: Path) -> GitRepo:
    source = tmp_path / "source"
    source.mkdir()
    git("init", "--quiet", "--template=", "--initial-branch=main", ".", cwd=source)
    shas = []
    for content in ("one", "two", "three"):
        (source / "README").write_text(f"{content}\n")
        git("add", "README", cwd=source)
        git("commit", "--quiet", "-m", f"README: {content}", cwd=source)
        shas.append(git("rev-parse", "HEAD", cwd=source))
        if content == "two":
            git("tag", "--annotate", "-m", "release 1", "v1", cwd=source)
    bare = tmp_path / "served" / "project.git"
    bare.mkdir(parents=True)
    git("init", "--quiet", "--template=", "--bare", ".", cwd=bare)
    git("push", "--quiet", str(bare), "main", "v1", cwd=source)
    return GitRepo(path=bare, name=bare.name, first=shas[0], tagged=shas[1], main=shas[2])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_port(port: int, *, deadline: float, server: subprocess.Popen[bytes]) -> None:
    """Connect until something accepts on `port`; fail at `deadline` or if `server` exits."""
    while True:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        if server.poll() is not None:
            raise RuntimeError("the server exited before it listened")
        if time.monotonic() > deadline:
            raise TimeoutError(f"nothing listened on 127.0.0.1:{port} in time")
        time.sleep(0.02)


def stop_group(proc: subprocess.Popen[bytes], *, grace: float = 5.0) -> None:
    """Stop the process group `proc` leads: SIGTERM, then SIGKILL after `grace`."""
    if proc.poll() is None:
        # Not reaped yet, so its process group id is still ours.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


class GitDaemon:
    """`git daemon` exporting every repository under `base_path` on 127.0.0.1."""

    def __init__(self, base_path: Path, log_path: Path) -> None:
        self.base_path = base_path
        self.log_path = log_path
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    def url_for(self, repo_name: str) -> str:
        return f"git://127.0.0.1:{self.port}/{repo_name}"

    def start(self, *, timeout: float = 15.0) -> None:
        # Another process may take the free port before the daemon binds it: try again.
        for _ in range(3):
            self.port = free_port()
            with self.log_path.open("ab") as log:
                self.proc = subprocess.Popen(
                    [
                        "git",
                        "daemon",
                        "--reuseaddr",
                        f"--base-path={self.base_path}",
                        "--export-all",
                        "--listen=127.0.0.1",
                        f"--port={self.port}",
                        str(self.base_path),
                    ],
                    env=GIT_ENV,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    process_group=0,
                )
            proc = self.proc
            try:
                wait_for_port(
                    self.port,
                    deadline=time.monotonic() + timeout,
                    server=proc,
                )
                return
            except RuntimeError:
                stop_group(proc)
        raise RuntimeError(f"git daemon did not start: {self.log_path.read_text()}")

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc)


@pytest.fixture
def git_daemon(git_repo: GitRepo, tmp_path: Path) -> Iterator[GitDaemon]:
    daemon = GitDaemon(git_repo.path.parent, tmp_path / "git-daemon.log")
    try:
        daemon.start()
        yield daemon
    finally:
        daemon.stop()


FailureMode = Literal["reset", "close", "hang"]


class FlakyProxy:
    """A loopback TCP proxy in front of `upstream_port` that fails on purpose.

    The first `fail_first` connections fail as `how`: "reset" (accepted, then a
    TCP RST), "close" (the request read, then a clean close without a reply:
    git sees the remote hang up), "hang" (accepted, never answered, held open
    until the proxy stops). Later connections are
    forwarded. With `v0_only` the proxy drops the client's request for
    protocol v2, so the daemon behind it speaks v0 like a git older than 2.18.
    """

    def __init__(
        self, upstream_port: int, *, fail_first: int, how: FailureMode, v0_only: bool
    ) -> None:
        self.upstream_port = upstream_port
        self.fail_first = fail_first
        self.how = how
        self.v0_only = v0_only
        self.connections = 0  # every connection accepted, failed or forwarded
        self.port = 0
        self._server: asyncio.Server | None = None
        self._stopping = asyncio.Event()
        self._handlers: set[asyncio.Task[None]] = set()

    def url_for(self, repo_name: str) -> str:
        return f"git://127.0.0.1:{self.port}/{repo_name}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        self._stopping.set()
        if self._server is not None:
            self._server.close()
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        self.connections += 1
        try:
            if self.connections <= self.fail_first:
                await self._fail(reader, writer)
            else:
                await self._forward(reader, writer)
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
            self._handlers.discard(task)

    async def _fail(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.how == "close":
            # Closing with the request unread would make the kernel send a RST.
            await reader.read(65536)
        elif self.how == "reset":
            # Linger 0: close sends a RST instead of a FIN.
            writer.get_extra_info("socket").setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
            )
            writer.transport.abort()
        elif self.how == "hang":
            await self._stopping.wait()

    async def _forward(
        self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter
    ) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        try:
            if self.v0_only:
                up_writer.write(await _request_without_v2(client_reader))
            await asyncio.gather(_pipe(client_reader, up_writer), _pipe(up_reader, client_writer))
        finally:
            up_writer.close()
            with contextlib.suppress(Exception):
                await up_writer.wait_closed()


async def _request_without_v2(reader: asyncio.StreamReader) -> bytes:
    """The git:// request pkt-line without its extra parameters (``\\0\\0version=2\\0``)."""
    length = int(await reader.readexactly(4), 16)
    payload = await reader.readexactly(length - 4)
    payload = payload.split(b"\0\0", 1)[0].rstrip(b"\0") + b"\0"
    return b"%04x" % (len(payload) + 4) + payload


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()


ProxyFactory = Callable[..., Awaitable[FlakyProxy]]


@pytest.fixture
async def flaky_proxy(git_daemon: GitDaemon) -> AsyncIterator[ProxyFactory]:
    """Start proxies in front of `git_daemon`: ``await flaky_proxy(fail_first=2)``.

    Keywords: fail_first (default 0), how ("reset", "close" or "hang"; default
    "reset"), v0_only (default False). Returns a started `FlakyProxy`.
    """
    proxies: list[FlakyProxy] = []

    async def start(
        *, fail_first: int = 0, how: FailureMode = "reset", v0_only: bool = False
    ) -> FlakyProxy:
        proxy = FlakyProxy(git_daemon.port, fail_first=fail_first, how=how, v0_only=v0_only)
        proxies.append(proxy)
        await proxy.start()
        return proxy

    try:
        yield start
    finally:
        for proxy in proxies:
            await proxy.stop()
