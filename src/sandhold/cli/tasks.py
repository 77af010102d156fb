"""`sandhold task submit|ls|show|watch|cancel`."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from pathlib import Path

import msgspec
from nats.aio.msg import Msg
from sandhold.bus.codec import STREAM_HEADER, decode_envelope
from sandhold.bus.follow import Follower
from sandhold.client import Client
from sandhold.domain import task as tk
from sandhold.domain.envelope import Envelope
from sandhold.domain.errors import Rejected
from sandhold.domain.task_manifest import ManifestError, parse_manifest
from sandhold.domain.task_views import TaskView, task_view
from sandhold.saves import SaveStore, artifacts

from sandhold.cli.report import print_json
from sandhold.cli.secret_args import secrets_of

# How `task watch` (and `submit --wait`) exit: 0 completed, like `exec` otherwise.
TASK_EXIT_CODES = {"completed": 0, "failed": 1, "timed_out": 124, "cancelled": 130}
EXIT_BAD_MANIFEST = 2


async def run(args: argparse.Namespace, client: Client) -> int:
    match args.action:
        case "submit":
            try:
                manifest = _read_manifest(args.manifest)
                secrets = secrets_of(args.secret, args.secret_file)
                # (refused before anything is sent when the secrets do not fit it)
                view = await client.submit_task(manifest, key=args.key, secrets=secrets)
            except ValueError as err:  # ManifestError, or the secrets for the manifest
                print(f"sandhold: {err}", file=sys.stderr)
                return EXIT_BAD_MANIFEST
            _print(view, args.json)
            if args.watch:
                return await watch(client, view.id, as_json=args.json)
            return 0
        case "ls":
            views = await client.list_tasks(state=args.state)
            if args.json:
                print_json(views)
            else:
                for view in views:
                    _print(view, False)
            return 0
        case "show":
            _print(await client.show_task(args.id), args.json)
            return 0
        case "watch":
            return await watch(client, args.id, as_json=args.json)
        case "cancel":
            _print(await client.cancel_task(args.id, key=args.key), args.json)
            return 0
        case "artifact":
            data = await read_artifact(client, args.id, args.path)
            if args.output:
                Path(args.output).write_bytes(data)
            else:
                sys.stdout.buffer.write(data)
                sys.stdout.flush()
            return 0
    raise AssertionError(args.action)


async def read_artifact(client: Client, task_id: str, path: str) -> bytes:
    """An artifact's bytes, from the task's Snapshot in the save store (each
    chunk checked against its digest)."""
    view = await client.show_task(task_id)
    return await artifacts.read_artifact(
        SaveStore(client.nc, client.names), task_id, view.artifacts, path
    )


def _read_manifest(path: str):
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except OSError as err:
        raise ManifestError(f"cannot read {path}: {err.strerror}") from None
    return parse_manifest(text)


def _print(view: TaskView, as_json: bool) -> None:
    if as_json:
        print_json(view)
        return
    extra = f" ({view.reason}: {view.detail})" if view.reason else ""
    print(f"{view.id}  {view.name}  {view.state}{extra}")
    for step in view.steps:
        print(f"  {step.id}  {step.kind}  attempt {step.attempt}  {step.status}  {step.reason}")
    for artifact in view.artifacts:
        print(f"  artifact {artifact.path} ({artifact.size} bytes, {artifact.save_id})")


async def watch(client: Client, task_id: str, *, as_json: bool) -> int:
    """Print the task's events as they happen (and its agent steps' output),
    until it ends; exit with its outcome."""
    state: tk.Task | None = None
    changed = asyncio.Event()
    seen: set[str] = set()  # the steps' commands whose output is being (or was) shown
    followers: list[Follower[bytes]] = []

    def on_event(_seq: int, _msg: object, envelope: Envelope) -> None:
        nonlocal state
        state = tk.evolve(state, envelope)
        if state is not None and state.tenant == client.tenant:
            _print_event(envelope, as_json)
        changed.set()

    def on_chunk(_seq: int, msg: Msg, data: bytes) -> None:
        stream = (msg.headers or {}).get(STREAM_HEADER, "stdout")
        target = sys.stderr if stream == "stderr" else sys.stdout
        target.write(data.decode("utf-8", "replace"))
        target.flush()

    events = Follower(
        client.js,
        client.names.events_stream,
        client.names.events("task", task_id),
        decode_envelope,
        on_event,
        what="task event",
    )
    try:
        await events.start()
        while True:
            changed.clear()
            if state is None or state.tenant != client.tenant:
                raise Rejected("task_not_found", f"no task {task_id}")
            for step in state.steps.values():
                if as_json or not step.command_id or step.command_id in seen:
                    continue
                seen.add(step.command_id)
                if step.done:  # ended before we looked: its recorded output
                    sys.stdout.write(step.output)
                    continue
                assert step.sandbox_id is not None
                output = Follower(
                    client.js,
                    client.names.output_stream,
                    client.names.output(step.sandbox_id, step.command_id) + ".*",
                    bytes,
                    on_chunk,
                    what="output",
                )
                followers.append(output)
                await output.start(timeout=None)
            if state.terminal:
                await client.nc.flush()
                break
            await changed.wait()
    finally:
        stopping: list[Follower[Envelope] | Follower[bytes]] = [events, *followers]
        for follower in stopping:
            with contextlib.suppress(Exception):
                await follower.stop()
    view = task_view(state)
    if not as_json:
        _print(view, False)
    return TASK_EXIT_CODES.get(view.state, 1)


def _print_event(envelope, as_json: bool) -> None:
    if as_json:
        print_json(envelope)
    else:
        stamp = time.strftime("%H:%M:%S", time.localtime(envelope.time))
        body = msgspec.json.encode(envelope.event).decode()
        print(f"{stamp} {envelope.type} {body if len(body) < 300 else body[:300] + '…'}")
    sys.stdout.flush()
