"""Staging's one network operation: get a repository at a ref, with a real `git`.

`clone` runs `git init` + `git fetch --depth 1 origin <ref>` + `git checkout
--detach FETCH_HEAD` in a hidden sibling of `dest`, then renames it into place,
so a failure (or a crash of the orchestrator) never leaves a half-cloned `dest`.
Every git runs in its own process group, killed as a group on timeout or
cancellation, with no system or user configuration and no prompts.

Failures are classified for the retry policy: "network" (refused, reset, hung
up, timed out: worth retrying) or "permanent" (no such ref or repository, a bad
URL: retrying cannot help). `classify_stderr` reads git's stderr, so git runs
with ``LC_ALL=C`` to keep its messages in English; git prints nothing unrecognised
as "git_failed", permanent: an unknown failure is not retried blindly.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import secrets
import shutil
import signal
from pathlib import Path
from typing import Literal

from sandhold.domain.errors import InfraError
from sandhold.domain.retry import ErrorClass

CloneFailure = Literal[
    "timeout",  # the whole clone passed `timeout_s`
    "network",  # refused, reset, hung up: transient
    "ref_not_found",
    "repository_not_found",
    "access_denied",  # authentication or authorisation refused
    "bad_url",
    "bad_ref",
    "dest_not_empty",
    "git_failed",  # git failed in a way we do not recognise: not retried
]

_STDERR_LINES = 20
_FULL_SHA = re.compile(r"[0-9a-fA-F]{40}|[0-9a-fA-F]{64}")

# Checked in order, on git's lower-cased stderr. Permanent answers come first:
# a server that says "no such ref" has answered, even if the connection then
# closes abruptly ("hung up").
_PATTERNS: tuple[tuple[str, CloneFailure, ErrorClass], ...] = (
    ("couldn't find remote ref", "ref_not_found", "permanent"),
    ("not our ref", "ref_not_found", "permanent"),
    ("unadvertised object", "ref_not_found", "permanent"),
    ("access denied or repository not exported", "repository_not_found", "permanent"),
    ("no such repository", "repository_not_found", "permanent"),
    ("repository not found", "repository_not_found", "permanent"),
    ("does not appear to be a git repository", "repository_not_found", "permanent"),
    ("' not found", "repository_not_found", "permanent"),  # http: repository '…' not found
    ("permission denied", "access_denied", "permanent"),  # ssh
    ("host key verification failed", "access_denied", "permanent"),
    ("authentication failed", "access_denied", "permanent"),  # https
    ("terminal prompts disabled", "access_denied", "permanent"),  # https wanted a password
    ("returned error: 401", "access_denied", "permanent"),
    ("returned error: 403", "access_denied", "permanent"),
    ("is not a git command", "bad_url", "permanent"),  # no remote helper for the scheme
    ("unable to find remote helper", "bad_url", "permanent"),
    ("is not supported", "bad_url", "permanent"),
    ("not allowed", "bad_url", "permanent"),  # transport 'ext' not allowed
    ("strange hostname", "bad_url", "permanent"),
    ("strange pathname", "bad_url", "permanent"),
    ("invalid url", "bad_url", "permanent"),
    ("connection refused", "network", "network"),
    ("connection reset", "network", "network"),
    ("timed out", "network", "network"),
    ("early eof", "network", "network"),
    ("hung up", "network", "network"),
    ("unexpected disconnect", "network", "network"),
    ("unable to connect", "network", "network"),
    ("unable to look up", "network", "network"),  # DNS: often a passing outage
    ("could not resolve host", "network", "network"),
    ("network is unreachable", "network", "network"),
    ("no route to host", "network", "network"),
    ("broken pipe", "network", "network"),
    ("rpc failed", "network", "network"),
    ("returned error: 5", "network", "network"),  # http 5xx
    # Alone (no explanation above), this is a server that closed the connection
    # without a word: git:// then says nothing else, not even "hung up".
    ("could not read from remote repository", "network", "network"),
)


class CloneFailed(InfraError):
    """`git` could not get the repository at the ref.

    Attributes:
        reason: what went wrong, stable for events and metrics (`CloneFailure`).
        detail: the last lines of git's stderr, for people.
        error_class: "network" (retry with backoff) or "permanent" (do not).
    """

    def __init__(self, reason: CloneFailure, detail: str, error_class: ErrorClass) -> None:
        super().__init__(f"clone failed ({reason}): {detail}", retryable=error_class != "permanent")
        self.reason: CloneFailure = reason
        self.detail = detail
        self.error_class: ErrorClass = error_class


async def clone(url: str, ref: str, dest: Path, *, timeout_s: float) -> str:
    """Check out `url` at `ref` (a branch, tag or full commit sha) into `dest`.

    Args:
        url: any URL git fetches from (git://, https://, ssh, a path).
        ref: a branch or tag name (short or ``refs/…``), or a full commit sha.
        dest: must not exist or be an empty directory; its parent is created.
        timeout_s: for the whole clone; past it every git is killed.

    Returns:
        The sha of the commit checked out (detached HEAD) in `dest`.

    Raises:
        CloneFailed: `dest` is then as it was before the call.
    """
    _check_arguments(url, ref, dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = dest.parent / f".{dest.name}.partial-{secrets.token_hex(4)}"
    work.mkdir()
    git = _Git(work)
    try:
        try:
            async with asyncio.timeout(timeout_s):
                sha = await _fetch_and_check_out(git, url, ref)
        except TimeoutError as err:
            detail = f"no result within {timeout_s}s from `git {git.step}`"
            if tail := _tail(git.stderr):
                detail += f"; stderr: {tail}"
            raise CloneFailed("timeout", detail, "network") from err
        try:
            os.rename(work, dest)  # replaces an empty directory atomically
        except OSError as err:
            raise CloneFailed(
                "dest_not_empty", f"{dest} was filled meanwhile", "permanent"
            ) from err
    except BaseException:
        # Synchronous on purpose: it must finish even when the clone is cancelled.
        shutil.rmtree(work, ignore_errors=True)
        raise
    return sha


async def _fetch_and_check_out(git: _Git, url: str, ref: str) -> str:
    await git.run("init", "--quiet", "--template=")  # no template hooks
    await git.run("remote", "add", "origin", url)
    code = await git.run(
        "fetch", "--quiet", "--no-tags", "--depth", "1", "origin", ref, check=False
    )
    target = "FETCH_HEAD"
    if code != 0:
        reason, error_class = classify_stderr(git.stderr)
        if reason != "ref_not_found" or not _FULL_SHA.fullmatch(ref):
            raise CloneFailed(reason, _tail(git.stderr), error_class)
        # A server speaking protocol v0 (git < 2.18, some hosts) refuses to send
        # a commit no ref points at: fetch every branch and tag, then look.
        await git.run(
            "fetch",
            "--quiet",
            "origin",
            "+refs/heads/*:refs/remotes/origin/*",
            "+refs/tags/*:refs/tags/*",
        )
        if await git.run("cat-file", "-e", f"{ref}^{{commit}}", check=False) != 0:
            detail = f"{ref} is not reachable from any branch or tag of {url}"
            raise CloneFailed("ref_not_found", detail, "permanent")
        target = ref
    await git.run("-c", "advice.detachedHead=false", "checkout", "--quiet", "--detach", target)
    await git.run("rev-parse", "--verify", "HEAD")
    return git.stdout.strip()


def _check_arguments(url: str, ref: str, dest: Path) -> None:
    if not url or url.startswith("-") or "\n" in url:
        raise CloneFailed("bad_url", f"not a repository URL: {url!r}", "permanent")
    if not ref or ref.startswith("-") or any(c.isspace() for c in ref):
        raise CloneFailed("bad_ref", f"not a branch, tag or commit: {ref!r}", "permanent")
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise CloneFailed("dest_not_empty", f"{dest} exists and is not empty", "permanent")


def classify_stderr(stderr: bytes) -> tuple[CloneFailure, ErrorClass]:
    """Why a git talking to a remote failed, from what it wrote on stderr (``LC_ALL=C``)."""
    text = stderr.decode("utf-8", "replace").lower()
    for needle, reason, error_class in _PATTERNS:
        if needle in text:
            return reason, error_class
    return "git_failed", "permanent"


def _tail(stderr: bytes) -> str:
    lines = stderr.decode("utf-8", "replace").strip().splitlines()
    return "\n".join(lines[-_STDERR_LINES:])


def _environment() -> dict[str, str]:
    """The caller's environment without anything that configures git or prompts."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("GIT_") and k not in {"SSH_ASKPASS", "LANGUAGE"}
    }
    env.update(
        GIT_CONFIG_NOSYSTEM="1",
        GIT_CONFIG_GLOBAL=os.devnull,  # neither ~/.gitconfig nor $XDG_CONFIG_HOME/git
        GIT_TERMINAL_PROMPT="0",
        # Network transports only: never file:// or a local path (the orchestrator's
        # own disk), ext:: (a command line) or plain http.
        GIT_ALLOW_PROTOCOL="https:ssh:git",
        GIT_SSH_COMMAND="ssh -o BatchMode=yes",  # ssh must not prompt either
        LC_ALL="C",  # _classify reads English messages
    )
    return env


class _Git:
    """Runs git commands in one work tree; keeps the last one's name and output."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.env = _environment()
        self.step = ""
        self.stdout = ""
        self.stderr = b""

    async def run(self, *args: str, check: bool = True) -> int:
        """Run ``git -C work *args``; raise `CloneFailed` on failure if `check`."""
        self.step = next(a for a in args if not a.startswith("-") and "=" not in a)
        stdout, stderr = bytearray(), bytearray()
        self.stderr = b""
        proc = await asyncio.create_subprocess_exec(
            "git",
            "-C",
            str(self.work),
            *args,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=self.env,
            start_new_session=True,  # its own group (uvloop has no process_group=)
        )
        try:
            assert proc.stdout is not None and proc.stderr is not None
            await asyncio.gather(_drain(proc.stdout, stdout), _drain(proc.stderr, stderr))
            code = await proc.wait()
        finally:
            self.stderr = bytes(stderr)  # what git said so far, even on timeout
            if proc.returncode is None:
                # Not reaped yet, so its process group id cannot have been reused.
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
        self.stdout = stdout.decode("utf-8", "replace")
        if check and code != 0:
            reason, error_class = classify_stderr(self.stderr)
            raise CloneFailed(reason, _tail(self.stderr), error_class)
        return code


async def _drain(stream: asyncio.StreamReader, sink: bytearray) -> None:
    while chunk := await stream.read(65536):
        sink += chunk
