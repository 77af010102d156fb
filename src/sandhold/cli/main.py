"""The `sandhold` command line."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
from sandhold.bus import credentials as creds
from sandhold.bus.credentials import Credentials
from sandhold.bus.names import Names
from sandhold.bus.permissions import ROLES
from sandhold.client import Client, CommandResult, connect
from sandhold.domain.errors import InfraError, Rejected

from sandhold.cli import audit, cluster, tasks
from sandhold.cli.progress import progress
from sandhold.cli.secret_args import add_secret_option, secrets_of
from sandhold.cli.status import status_block
from sandhold.cli.top import top

# How `exec` exits when the command did not simply exit: shell conventions where
# one exists (124 timeout(1), 127 not found, 130 interrupted, 137 killed).
EXIT_CODES = {
    "timed_out": 124,
    "launch_failed": 127,
    "interrupted": 130,
    "resource_exhausted": 137,
    "not_launched": 125,
    "infrastructure_lost": 125,
    "unknown": 125,
}
EXIT_REJECTED = 2
EXIT_UNREACHABLE = 3


def _runtime(data_dir: Path) -> dict[str, Any]:  # `up`'s runtime.json: strings, numbers, maps
    try:
        return json.loads((data_dir / "runtime.json").read_text())
    except (OSError, ValueError):
        return {}


def _server(args: argparse.Namespace) -> tuple[str, str]:
    runtime = _runtime(Path(args.data_dir))
    url = args.nats or os.environ.get("SANDHOLD_NATS_URL") or runtime.get("nats_url")
    if not url:
        raise SystemExit(
            f"sandhold: no server found (no {Path(args.data_dir) / 'runtime.json'}): run "
            "`sandhold up`, or pass --nats URL (or set SANDHOLD_NATS_URL), or --data-dir DIR"
        )
    prefix = args.prefix or os.environ.get("SANDHOLD_PREFIX") or runtime.get("prefix") or "sh"
    return url, prefix


def _print_json(value: object) -> None:
    sys.stdout.write(msgspec.json.encode(value).decode() + "\n")


def _print_sandbox(view, as_json: bool) -> None:
    if as_json:
        _print_json(view)
    else:
        print(f"{view.id}  {view.phase}  host={view.host or '-'}  generation={view.generation}")


def _credentials(args: argparse.Namespace) -> Credentials | None:
    """Who this command connects as: --credentials, SANDHOLD_NATS_CREDENTIALS,
    or the operator of the data dir's `sandhold up`; else the user in the URL."""
    path = args.credentials or os.environ.get(creds.ENV)
    if path:
        return creds.load(Path(path))
    operator = creds.path_of(Path(args.data_dir) / "credentials", "operator")
    return creds.load(operator) if operator.exists() else None


async def _with_client(args: argparse.Namespace, action: Callable[[Client], Awaitable[int]]) -> int:
    url, prefix = _server(args)
    try:
        client = await asyncio.wait_for(
            connect(url, prefix=prefix, credentials=_credentials(args)), 10
        )
    except (OSError, TimeoutError) as err:
        print(f"sandhold: cannot reach NATS at {url}: {err}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except ValueError as err:  # a credential this client cannot use (a tenant's)
        print(f"sandhold: {err}", file=sys.stderr)
        return EXIT_REJECTED
    try:
        return await action(client)
    except Rejected as err:
        print(f"sandhold: {err.code}: {err.message}", file=sys.stderr)
        return EXIT_REJECTED
    except InfraError as err:
        print(f"sandhold: {err}", file=sys.stderr)
        return EXIT_UNREACHABLE
    finally:
        await client.close()


# --- sandbox -----------------------------------------------------------------


async def _sandbox(args: argparse.Namespace, client: Client) -> int:
    match args.action:
        case "create":
            memory = args.memory_mb * 1024 * 1024 if args.memory_mb else None
            view = await client.create_sandbox(
                memory_limit_bytes=memory,
                key=args.key,
                from_snapshot=args.from_snapshot,
                save_interval_s=args.save_interval,
                stop_deadline_s=args.stop_deadline,
                recovery=args.recovery,
                network=args.network,
                image=args.image,
                pids_limit=args.pids_limit,
                cpu_limit=args.cpus,
                disk_limit_bytes=args.disk_mb * 1024 * 1024 if args.disk_mb else None,
            )
            if args.wait or args.from_snapshot:
                async with progress(client, view.id):
                    view = await client.wait_for_phase(view.id, {"running", "failed"}, timeout=600)
            _print_sandbox(view, args.json)
            return 0 if view.phase != "failed" else 1
        case "ls":
            views = await client.list_sandboxes(include_deleted=args.all)
            if args.json:
                _print_json(views)
            else:
                for view in views:
                    _print_sandbox(view, False)
        case "show":
            view = await client.show_sandbox(args.id)
            view.storage = await client.storage()
            if args.json:
                _print_json(view)
            else:
                print(status_block(view))
        case "start":
            _print_sandbox(await client.start_sandbox(args.id, key=args.key), args.json)
        case "stop":
            return await _stop(args, client)
        case "rm":
            view = await client.delete_sandbox(args.id, key=args.key)
            if args.wait:
                view = await client.wait_for_phase(args.id, {"deleted"}, timeout=120)
            _print_sandbox(view, args.json)
    return 0


async def _stop(args: argparse.Namespace, client: Client) -> int:
    """Stop, then report the stop and, separately, the final save's outcome."""
    view = await client.stop_sandbox(args.id, key=args.key)
    if args.no_wait:
        _print_sandbox(view, args.json)
        return 0
    async with progress(client, args.id):
        view = await client.wait_for_phase(
            args.id, {"stopped", "failed", "deleted"}, timeout=view.stop_deadline_s + 60
        )
        final = view.final_save
        if final is not None:
            final = await client.wait_for_save(args.id, final.id, timeout=view.stop_deadline_s + 60)
    outcome: dict[str, object] = {"stopped": view.phase == "stopped", "phase": view.phase}
    if final is not None:
        outcome["final_save"] = {
            "state": final.state,
            "id": final.id,
            "reason": final.reason,
            "bytes": final.bytes,
            "files": final.files,
        }
    else:
        outcome["final_save"] = None
    if args.json:
        _print_json(outcome)
    else:
        print(f"{args.id} {view.phase}")
        if final is None:
            print("final save: none (the sandbox never ran on a host)")
        elif final.state == "completed":
            print(f"final save: completed {final.id} ({final.files} files, {final.bytes} bytes)")
        else:
            print(
                f"final save: FAILED {final.id}: {final.reason} - the next start uses the "
                "save before it",
                file=sys.stderr,
            )
    return 0 if final is None or final.state == "completed" else 1


async def _host(args: argparse.Namespace, client: Client) -> int:
    hosts = await client.list_hosts()
    if args.json:
        _print_json(hosts)
    else:
        for h in hosts["hosts"]:
            age = h["last_renewal_age_s"]
            print(
                f"{h['host']}  {h['status']}  epoch={h['epoch']}  "
                f"renewed={'-' if age is None else f'{age:.1f}s ago'}  "
                f"sandboxes={h['sandboxes']}"
            )
    return 0


async def _admin(args: argparse.Namespace, client: Client) -> int:
    if args.action == "rebuild-read-model":
        services = _runtime(Path(args.data_dir)).get("services", {})
        gateways = sum(1 for name in services if name.split("-")[0] == "gateway") or 1
        return await audit.rebuild_read_model(client, timeout=args.timeout, gateways=gateways)
    body = {} if args.grace is None else {"grace_s": args.grace}
    reply = await client.nc.request(
        f"{client.names.prefix}.admin.gc", msgspec.json.encode(body), timeout=300
    )
    result = msgspec.json.decode(reply.data)
    _print_json(result)
    return 0 if result.get("ok") else 1


async def _connection(args: argparse.Namespace, client: Client) -> int:
    match args.action:
        case "set":
            try:
                value = _connection_value(args.from_file)
            except ValueError as err:
                print(f"sandhold: {err}", file=sys.stderr)
                return EXIT_REJECTED
            view = await client.set_connection(args.id, args.name, value, key=args.key)
        case "rm":
            view = await client.remove_connection(args.id, args.name, key=args.key)
        case _:
            view = await client.show_sandbox(args.id)
    if args.json:
        _print_json({"sandbox_id": view.id, "connections": view.connections,
                     "pending": view.connections_pending})  # fmt: skip
        return 0
    if args.action != "ls":
        print(f"{view.id}: Connection {args.name} {'set' if args.action == 'set' else 'removed'}")
    for name in view.connections:
        print(f"/run/connections/{name}")
    if view.connections_pending:
        print("(being delivered where it runs: commands wait for it)")
    return 0


def _connection_value(path: str) -> str:
    """A Connection's value: the file's text as it is (`-`: standard input)."""
    try:
        return sys.stdin.read() if path == "-" else Path(path).read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"--from-file {path}: {err} (a Connection is text)") from None


async def _snapshot(args: argparse.Namespace, client: Client) -> int:
    save = await client.snapshot(args.id, args.name, key=args.key)
    async with progress(client, args.id):
        save = await client.wait_for_save(args.id, save.id, timeout=args.timeout)
    if args.json:
        _print_json(save)
    elif save.state == "completed":
        print(f"snapshot {save.id} ({save.name}): {save.files} files, {save.bytes} bytes")
    else:
        print(f"sandhold: snapshot {save.id} {save.state}: {save.reason}", file=sys.stderr)
    return 0 if save.state == "completed" else 1


# --- exec --------------------------------------------------------------------


async def _exec(args: argparse.Namespace, client: Client) -> int:
    argv = args.argv
    if not argv:
        print("sandhold: exec needs a command after --", file=sys.stderr)
        return EXIT_REJECTED
    env = dict(pair.split("=", 1) for pair in args.env)
    try:
        secrets = secrets_of(args.secret, args.secret_file)
    except ValueError as err:
        print(f"sandhold: {err}", file=sys.stderr)
        return EXIT_REJECTED

    def stream(name: str, data: bytes) -> None:
        out = sys.stdout if name == "stdout" else sys.stderr
        out.buffer.write(data)
        out.flush()

    result = await client.exec(
        args.id,
        argv,
        key=args.key,
        cwd=args.cwd,
        env=env,
        secrets=secrets,
        timeout_s=args.timeout,
        user=args.user,
        on_output=None if args.json else stream,
    )
    return _report_exec(result, args.json)


def _report_exec(result: CommandResult, as_json: bool) -> int:
    command = result.command
    if as_json:
        record = msgspec.to_builtins(command)
        record["output"] = (result.stdout + result.stderr).decode(errors="replace")
        record["stdout"] = result.stdout.decode(errors="replace")
        record["stderr"] = result.stderr.decode(errors="replace")
        _print_json(record)
    if command.state == "exited" and command.exit_code is not None:
        return command.exit_code
    if command.state == "exited" and command.signal is not None:
        if not as_json:
            print(
                f"sandhold: command {command.id} was killed by signal {command.signal}",
                file=sys.stderr,
            )
        return 128 + command.signal  # as a shell reports it
    if not as_json:
        print(
            f"sandhold: command {command.id} ended {command.state}"
            + (f": {command.reason}" if command.reason else ""),
            file=sys.stderr,
        )
    return EXIT_CODES.get(command.state, 125)


async def _command(args: argparse.Namespace, client: Client) -> int:
    match args.action:
        case "show":
            _print_json(await client.show_command(args.sandbox, args.command))
        case "output":
            output = await client.read_output(args.sandbox, args.command)
            sys.stdout.buffer.write(output.get("stdout", b""))
            sys.stderr.buffer.write(output.get("stderr", b""))
        case "cancel":
            _print_json(await client.cancel_command(args.sandbox, args.command, key=args.key))
    return 0


# --- parser ------------------------------------------------------------------


def _global_options(p: argparse.ArgumentParser, *, defaults: bool) -> None:
    """The options every command takes, before or after its name (`sandhold up
    --data-dir D` as well as `sandhold --data-dir D up`). Below the top level
    they default to "not given", so they never undo one given earlier."""

    def default(value: object) -> object:
        return value if defaults else argparse.SUPPRESS

    p.add_argument(
        "--nats",
        default=default(None),
        help="NATS URL (default: SANDHOLD_NATS_URL or <data-dir>/runtime.json)",
    )
    p.add_argument("--prefix", default=default(None), help="subject/stream prefix (default sh)")
    p.add_argument(
        "--credentials",
        default=default(None),
        help="NATS credential file (default: SANDHOLD_NATS_CREDENTIALS, or the operator's "
        "in <data-dir>/credentials)",
    )
    p.add_argument(
        "--data-dir",
        default=default(os.environ.get("SANDHOLD_DATA_DIR", ".sandhold")),
        help="where `sandhold up` keeps its state (default .sandhold, or SANDHOLD_DATA_DIR)",
    )


def _everywhere(p: argparse.ArgumentParser) -> None:
    for action in p._actions:  # argparse keeps its subcommands here
        if isinstance(action, argparse._SubParsersAction):
            for command in action.choices.values():
                _global_options(command, defaults=False)
                _everywhere(command)


def _parser() -> argparse.ArgumentParser:
    p = _build_parser()
    _everywhere(p)
    return p


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sandhold", description=__doc__)
    _global_options(p, defaults=True)
    sub = p.add_subparsers(dest="group", required=True)

    up = sub.add_parser("up", help="run NATS and every service here (the embedded default)")
    up.add_argument("--hosts", type=int, default=1, help="how many local host-agents")
    up.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="nats-server nodes: 1 (default), or 3 for one JetStream cluster on this "
        "machine with every stream replicated three times",
    )
    up.add_argument(
        "--instances",
        type=int,
        default=None,
        help="instances of every control-plane service (default 1; 2 with --nodes 3)",
    )
    up.add_argument(
        "--save-interval",
        type=float,
        default=30.0,
        help="seconds between saves of each running sandbox (default 30)",
    )
    up.add_argument(
        "--stop-deadline",
        type=float,
        default=60.0,
        help="seconds a stop's final save may take (default 60)",
    )
    up.add_argument(
        "--lease-ttl",
        type=float,
        default=5.0,
        help="seconds without a lease renewal before a host is lost (default 5)",
    )
    up.add_argument(
        "--fence-margin",
        type=float,
        default=2.0,
        help="extra seconds before a lost host counts as fenced (default 2)",
    )
    up.add_argument(
        "--gateway-port",
        type=int,
        default=None,
        help="the HTTP gateway's port on 127.0.0.1 (default: a free one)",
    )
    up.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="the metrics service's Prometheus /metrics port (default: a free one; "
        "every endpoint is listed in runtime.json)",
    )
    up.add_argument(
        "--driver",
        choices=["namespaces", "process"],
        default="namespaces",
        help="how host-agents isolate sandboxes: namespaces (default; docs/isolation.md) or "
        "process: UNISOLATED, commands run as this machine's root — development only",
    )
    up.add_argument(
        "--save-timeout",
        type=float,
        default=600.0,
        help="a save not completed within this many seconds fails (default 600)",
    )
    up.add_argument(
        "--http-egress",
        choices=["public", "any"],
        default="public",
        help="where task http steps may go: public addresses only (default), or any, "
        "this machine's loopback and private networks included (hooks of your own)",
    )

    run = sub.add_parser("run", help="run one service alone against --nats URL")
    run.add_argument(
        "service",
        choices=[
            "scheduler",
            "host-agent",
            "saver",
            "recovery",
            "metrics",
            "orchestrator",
            "gateway",
        ],
    )
    run.add_argument("service_args", nargs=argparse.REMAINDER)

    top_parser = sub.add_parser("top", help="key numbers live from the log (tasks, saves, hosts)")
    top_parser.add_argument("--interval", type=float, default=1.0, help="seconds between updates")
    top_parser.add_argument("--once", action="store_true", help="print once and exit")
    top_parser.add_argument("--json", action="store_true", help="the numbers as JSON lines")

    tasks.add_parser(sub)

    completion = sub.add_parser(
        "completion",
        help="print a shell completion script",
        description="Print a completion script for SHELL. Bash: "
        "`sandhold completion bash > ~/.local/share/bash-completion/completions/sandhold`; "
        "zsh: `sandhold completion zsh > ~/.zfunc/_sandhold`.",
    )
    completion.add_argument("shell", choices=["bash", "zsh", "tcsh"])

    sandbox = sub.add_parser("sandbox", help="create, list, show, start, stop, remove")
    actions = sandbox.add_subparsers(dest="action", required=True)
    for name in ("create", "ls", "show", "start", "stop", "rm"):
        a = actions.add_parser(name)
        a.add_argument("--json", action="store_true")
        if name in ("show", "start", "stop", "rm"):
            a.add_argument("id")
        if name in ("create", "start", "stop", "rm"):
            a.add_argument("--key", help="idempotency key (default: a new one)")
        if name in ("create", "rm"):
            a.add_argument("--wait", action="store_true", help="wait for the phase to settle")
    create = actions.choices["create"]
    create.add_argument("--memory-mb", type=int, help="memory limit")
    create.add_argument(
        "--from-snapshot",
        metavar="SNAPSHOT_ID",
        help="start from a Snapshot's files (waits for the restore)",
    )
    create.add_argument(
        "--network",
        choices=["none", "egress"],
        default="none",
        help="none (default): its own loopback only; egress: outbound through user-mode "
        "networking. The host's loopback (NATS, the gateway) is unreachable either way",
    )
    create.add_argument(
        "--image",
        help="a root file system directory (or its name) under the host's image directory "
        "(default .sandhold/images) as the read-only base; default: the host's /usr and a "
        "minimal /etc",
    )
    create.add_argument(
        "--pids-limit",
        type=int,
        help="processes and threads at once (default: the host's, 4096); past it a "
        "command ends resource_exhausted",
    )
    create.add_argument(
        "--cpus",
        type=float,
        help="CPU time per period, in CPUs (0.5: half a core); a throttle (default: none)",
    )
    create.add_argument(
        "--disk-mb",
        type=int,
        help="size of the persistent root (a file system of its own, at least 64); past "
        "it writes fail and the command ends resource_exhausted (default: no quota)",
    )
    create.add_argument("--save-interval", type=float, help="seconds between saves")
    create.add_argument("--stop-deadline", type=float, help="seconds a stop may take")
    create.add_argument(
        "--recovery",
        choices=["lazy", "eager"],
        help="after a host failure: come back on the next start or command "
        "(lazy, default), or as soon as the failed host is fenced (eager)",
    )
    actions.choices["stop"].add_argument(
        "--no-wait",
        action="store_true",
        help="return once the stop is accepted, without waiting for the final save",
    )

    rp = sub.add_parser("replay", help="a sandbox's state rebuilt from the log, as of any point")
    rp.add_argument("kind", choices=["sandbox", "task"])
    rp.add_argument("id")
    rp.add_argument("--at", help="a stream sequence or an ISO-8601 time (default: now)")
    rp.add_argument("--json", action="store_true")
    rp.add_argument(
        "--verify",
        action="store_true",
        help="compare the rebuilt state with the gateway's read model; exit 1 on any difference",
    )
    rp.add_argument("--read-model", help="the read model file (default: from runtime.json)")

    hist = sub.add_parser("history", help="a readable timeline of a sandbox's or a task's events")
    hist.add_argument("kind", choices=["sandbox", "task"])
    hist.add_argument("id")

    audit = sub.add_parser("audit", help="export events with their envelopes")
    audit_actions = audit.add_subparsers(dest="action", required=True)
    exp = audit_actions.add_parser("export", help="JSON Lines on stdout")
    exp.add_argument("--sandbox", help="only this sandbox's events")
    exp.add_argument("--since", help="ISO-8601 time")

    events = sub.add_parser("events", help="follow live events")
    events_actions = events.add_subparsers(dest="action", required=True)
    tail = events_actions.add_parser("tail")
    tail.add_argument("--sandbox", help="only this sandbox's events")
    tail.add_argument("--count", type=int, help="exit after this many events")

    host = sub.add_parser("host", help="hosts, their leases and the lease settings")
    host_actions = host.add_subparsers(dest="action", required=True)
    host_ls = host_actions.add_parser("ls")
    host_ls.add_argument("--json", action="store_true")

    deploy = sub.add_parser(
        "deploy", help="the distributed deployment's files (compose.yaml, node configs)"
    )
    deploy_actions = deploy.add_subparsers(dest="action", required=True)
    render = deploy_actions.add_parser(
        "render", help="credentials and every nats-server node's config, for compose.yaml"
    )
    render.add_argument("--out", type=Path, default=Path("deploy/cluster"))
    render.add_argument("--nodes", type=int, default=3)
    render.add_argument("--host", action="append", dest="hosts", help="a host-agent's id")
    deploy_actions.add_parser("compose", help="print compose.yaml (what `up --nodes 3` runs)")

    cluster = sub.add_parser(
        "cluster", help="nodes, stream leaders and replicas, service instances, leases"
    )
    cluster_actions = cluster.add_subparsers(dest="action", required=True)
    cluster_status = cluster_actions.add_parser("status")
    cluster_status.add_argument("--json", action="store_true")

    admin = sub.add_parser("admin", help="operator tasks")
    admin_actions = admin.add_subparsers(dest="action", required=True)
    gc = admin_actions.add_parser("gc", help="collect save-store chunks no retained save needs")
    rebuild = admin_actions.add_parser(
        "rebuild-read-model", help="drop the gateway's read model and rebuild it from the log"
    )
    rebuild.add_argument("--timeout", type=float, default=600.0)
    tokens = sub.add_parser("token", help="bearer tokens for the HTTP gateway")
    token_actions = tokens.add_subparsers(dest="action", required=True)
    token_create = token_actions.add_parser("create", help="make a token; it is shown once")
    token_create.add_argument("--tenant", required=True)
    token_create.add_argument("--name", help="a name to revoke it by (default: generated)")
    token_ls = token_actions.add_parser("ls", help="tokens by name and tenant (never the secret)")
    token_ls.add_argument("--json", action="store_true")
    token_actions.add_parser("revoke", help="revoke a token by name").add_argument("name")
    streams = sub.add_parser("streams", help="the streams and buckets (made by the admin)")
    streams_actions = streams.add_subparsers(dest="action", required=True)
    ensure = streams_actions.add_parser(
        "ensure",
        help="make (or update) every stream and bucket, as the admin: what `sandhold up` does "
        "first, for a deployment whose server it does not start",
    )
    ensure.add_argument("--replicas", type=int, default=1, help="3 on a JetStream cluster")
    creds_parser = sub.add_parser(
        "credentials", help="NATS users of this data dir's server (docs/security.md)"
    )
    creds_actions = creds_parser.add_subparsers(dest="action", required=True)
    creds_create = creds_actions.add_parser(
        "create", help="a credential for a service run elsewhere (the server takes it at once)"
    )
    who = creds_create.add_mutually_exclusive_group(required=True)
    who.add_argument("--role", choices=[r for r in ROLES if r not in ("admin", "tenant")])
    who.add_argument(
        "--tenant",
        help="a user for this tenant's own clients: its NATS API and nothing else (docs/api.md)",
    )
    creds_create.add_argument("--host", help="the host id, for --role host-agent")
    creds_create.add_argument("--out", help="also copy it here (0600)")
    creds_ls = creds_actions.add_parser("ls", help="users by name and role (never the password)")
    creds_ls.add_argument("--json", action="store_true")
    creds_actions.add_parser(
        "revoke", help="remove a user; its connections are closed by the server"
    ).add_argument("user")
    gc.add_argument(
        "--grace",
        type=float,
        default=None,
        help="only chunks older than this many seconds (default: the saver's)",
    )

    conn = sub.add_parser(
        "connection", help="credentials delivered as files at /run/connections, never saved"
    )
    conn_actions = conn.add_subparsers(dest="action", required=True)
    conn_set = conn_actions.add_parser(
        "set", help="attach or replace one: delivered wherever the sandbox runs, never recorded"
    )
    conn_rm = conn_actions.add_parser("rm", help="remove one (its file goes at once)")
    conn_ls = conn_actions.add_parser("ls", help="a sandbox's Connections by name")
    for a in (conn_set, conn_rm, conn_ls):
        a.add_argument("id")
        if a is not conn_ls:
            a.add_argument("name", help="the file name under /run/connections")
            a.add_argument("--key", help="idempotency key (default: a new one)")
        a.add_argument("--json", action="store_true")
    conn_set.add_argument(
        "--from-file",
        required=True,
        metavar="PATH",
        help="the value: this file's text as it is (- for standard input)",
    )

    snap = sub.add_parser("snapshot", help="take a named, retained save of a running sandbox")
    snap.add_argument("id")
    snap.add_argument("--name", required=True)
    snap.add_argument("--key", help="idempotency key (default: a new one)")
    snap.add_argument("--timeout", type=float, default=600.0)
    snap.add_argument("--json", action="store_true")
    actions.choices["ls"].add_argument("--all", action="store_true", help="include deleted")

    ex = sub.add_parser("exec", help="run a command in a sandbox and wait for its end state")
    ex.add_argument("id")
    ex.add_argument("--key", help="idempotency key (default: a new one)")
    ex.add_argument("--timeout", type=float, help="seconds before TERM, grace, KILL")
    ex.add_argument("--cwd", help="inside the sandbox; relative to /workspace (the default)")
    ex.add_argument(
        "--user",
        choices=["user", "root"],
        default="user",
        help="the sandbox's unprivileged user (default) or its root, which holds no "
        "capability outside the sandbox",
    )
    ex.add_argument("--env", action="append", default=[], metavar="K=V", help="recorded")
    add_secret_option(ex, "the command's")
    ex.add_argument("--json", action="store_true", help="print the command record as JSON")
    ex.add_argument("argv", nargs="*", help="the command, after --")

    command = sub.add_parser("command", help="show, read the output of, or cancel a command")
    cactions = command.add_subparsers(dest="action", required=True)
    for name in ("show", "output", "cancel"):
        a = cactions.add_parser(name)
        a.add_argument("sandbox")
        a.add_argument("command")
        if name == "cancel":
            a.add_argument("--key")
    return p


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    command: list[str] | None = None
    if "exec" in argv and "--" in argv:
        # Everything after `--` is the program's, options included.
        split = argv.index("--")
        argv, command = argv[:split], argv[split + 1 :]
    args = _parser().parse_args(argv)
    if command is not None:
        args.argv = [*args.argv, *command]
    if args.group == "up":
        from sandhold.cli.up import up

        prefix = args.prefix or os.environ.get("SANDHOLD_PREFIX") or "sh"
        service_args = {
            "scheduler": [
                "--save-interval",
                str(args.save_interval),
                "--stop-deadline",
                str(args.stop_deadline),
            ],
            "saver": ["--save-timeout", str(args.save_timeout)],
            "recovery": [
                "--lease-ttl",
                str(args.lease_ttl),
                "--fence-margin",
                str(args.fence_margin),
            ],
            "host-agent": ["--lease-ttl", str(args.lease_ttl), "--driver", args.driver],
            "metrics": ["--metrics-port", str(args.metrics_port)],
            # The same lease settings as hosts: a task's driver is taken over as
            # a host is declared fenced (decision 036).
            "orchestrator": [
                "--http-egress",
                args.http_egress,
                "--lease-ttl",
                str(args.lease_ttl),
                "--fence-margin",
                str(args.fence_margin),
            ],
        }
        service_args["scheduler"] += ["--lease-ttl", str(args.lease_ttl)]
        raise SystemExit(
            up(
                Path(args.data_dir),
                prefix,
                args.hosts,
                service_args,
                args.gateway_port,
                nodes=args.nodes,
                instances=args.instances,
            )
        )
    if args.group == "deploy":
        from sandhold.cli import deploy

        if args.action == "compose":
            sys.stdout.write(deploy.compose())
        else:
            prefix = args.prefix or os.environ.get("SANDHOLD_PREFIX") or "sh"
            deploy.render(args.out, nodes=args.nodes, hosts=args.hosts, prefix=prefix)
            print(f"rendered {args.nodes} node configs and the credentials in {args.out}")
        return
    if args.group == "completion":
        import shtab

        print(shtab.complete(_parser(), shell=args.shell))
        return
    if args.group == "token":
        raise SystemExit(_token(args))
    if args.group == "credentials":
        raise SystemExit(_credentials_command(args))
    if args.group == "streams":
        raise SystemExit(asyncio.run(_ensure_streams(args)))
    if args.group == "run":
        _run_service(args)
        return
    handlers = {
        "sandbox": _sandbox,
        "task": tasks.run,
        "exec": _exec,
        "command": _command,
        "snapshot": _snapshot,
        "connection": _connection,
        "admin": _admin,
        "host": _host,
        "cluster": lambda a, c: cluster.status(c, _runtime(Path(a.data_dir)), as_json=a.json),
        "replay": lambda a, c: audit.replay(
            c, a.id, a.at, a.json, kind=a.kind, verify=a.verify, read_model=_read_model(a)
        ),
        "history": lambda a, c: audit.history(c, a.id, kind=a.kind),
        "audit": lambda a, c: audit.export(c, a.sandbox, a.since),
        "events": lambda a, c: audit.tail(c, a.sandbox, a.count),
        "top": lambda a, c: top(c, interval=a.interval, once=a.once, as_json=a.json),
    }
    handler = handlers[args.group]
    from sandhold.telemetry import tracing

    tracing.configure("cli")  # a request made here starts its trace here, if tracing is on
    import uvloop

    code = uvloop.run(_with_client(args, lambda client: handler(args, client)))
    raise SystemExit(code)


def _read_model(args: argparse.Namespace) -> Path | None:
    if args.read_model:
        return Path(args.read_model)
    found = _runtime(Path(args.data_dir)).get("gateway", {})
    return Path(found["read_model"]) if isinstance(found, dict) and "read_model" in found else None


def _token(args: argparse.Namespace) -> int:
    from sandhold.gateway import tokens

    path = Path(args.data_dir) / "tokens.json"
    match args.action:
        case "create":
            try:
                entry, token = tokens.create(path, args.tenant, args.name)
            except ValueError as err:
                print(f"sandhold: {err}", file=sys.stderr)
                return EXIT_REJECTED
            print(f"token {entry.name} for tenant {entry.tenant} (shown once):", file=sys.stderr)
            print(token)
        case "ls":
            entries = tokens.read(path).tokens
            if args.json:
                _print_json([{"name": t.name, "tenant": t.tenant} for t in entries])
            for t in [] if args.json else entries:
                print(f"{t.name}  tenant={t.tenant}")
        case "revoke":
            if not tokens.revoke(path, args.name):
                print(f"sandhold: no token named {args.name!r}", file=sys.stderr)
                return EXIT_REJECTED
    return 0


async def _ensure_streams(args: argparse.Namespace) -> int:
    """As the admin (--credentials, or the data dir's admin.json)."""
    from sandhold.bus.service import connect as bus_connect
    from sandhold.bus.streams import ensure_streams

    url, prefix = _server(args)
    path = args.credentials or os.environ.get(creds.ENV)
    admin = creds.load(Path(path) if path else Path(args.data_dir) / "credentials" / "admin.json")
    nc = await bus_connect(url, name="sandhold-streams", credentials=admin)
    try:
        await ensure_streams(nc.jetstream(), Names(prefix), replicas=args.replicas)
    finally:
        await nc.close()
    print(f"streams of prefix {prefix!r} ready ({args.replicas} replica(s))")
    return 0


def _credentials_command(args: argparse.Namespace) -> int:
    data_dir = Path(args.data_dir)
    directory = data_dir / "credentials"
    match args.action:
        case "create":
            if (args.role == "host-agent") != (args.host is not None):
                print("sandhold: --host H goes with --role host-agent, and only", file=sys.stderr)
                return EXIT_REJECTED
            role = "tenant" if args.tenant is not None else args.role
            try:
                made = creds.issue(directory, role, host=args.host, tenant=args.tenant)
            except ValueError as err:
                print(f"sandhold: {err}", file=sys.stderr)
                return EXIT_REJECTED
            _reload_server(data_dir, made)
            path = creds.path_of(directory, made.user)
            if args.out:
                creds.copy_private(path, Path(args.out))
                path = Path(args.out)
            print(path)
        case "ls":
            users = creds.every(directory)
            if args.json:
                _print_json(
                    [{"user": c.user, "role": c.role, "host": c.host, "tenant": c.tenant}
                     for c in users]
                )  # fmt: skip
            for c in [] if args.json else users:
                print(
                    f"{c.user}  role={c.role}"
                    + (f"  host={c.host}" if c.host else "")
                    + (f"  tenant={c.tenant}" if c.tenant else "")
                )
        case "revoke":
            path = creds.path_of(directory, args.user)
            if args.user == "admin" or not path.exists():
                print(f"sandhold: no user {args.user!r} to revoke", file=sys.stderr)
                return EXIT_REJECTED
            path.unlink()
            _reload_server(data_dir, None)
    return 0


def _service_credentials(args: argparse.Namespace, service_args: list[str]) -> Path | None:
    """A service run next to a local `sandhold up` gets its own credential from
    the data dir, issued (and the server told) the first time; a service run
    elsewhere is given one (`--credentials`, made by `sandhold credentials`)."""
    directory = Path(args.data_dir) / "credentials"
    if args.credentials or not directory.is_dir():
        return Path(args.credentials) if args.credentials else None
    role = "host-agent" if args.service == "host-agent" else args.service
    host = None
    if role == "host-agent":  # the host-agent's own default, when not given
        host = _option(service_args, "--host-id") or socket.gethostname().split(".")[0].lower()
    known = creds.path_of(directory, creds.user_for(role, host)).exists()
    made = creds.issue(directory, role, host=host)
    if not known:
        _reload_server(Path(args.data_dir), made)
    return creds.path_of(directory, made.user)


def _option(argv: list[str], name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def _reload_server(data_dir: Path, made: Credentials | None) -> None:
    """Make the data dir's running nats-server (every node of a cluster) take its
    credentials as they are now: `sandhold up` rewrites each node's config and has
    it reread on SIGHUP. Not running, it writes them when it starts."""
    runtime = _runtime(data_dir)
    pid = runtime.get("pid")
    if not pid:
        return
    try:
        os.kill(int(pid), signal.SIGHUP)
    except ProcessLookupError:
        return
    if made is not None:
        for node in runtime.get("nats_nodes") or [{"url": runtime.get("nats_url")}]:
            asyncio.run(_until_accepted(node["url"], made))


async def _until_accepted(url: str, user: Credentials, timeout: float = 10.0) -> None:
    """Wait until the server, rereading its config, takes `user` (a reload is quick,
    but not done when the signal is sent)."""
    import nats

    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            nc = await nats.connect(
                url, user=user.user, password=user.password, allow_reconnect=False,
                max_reconnect_attempts=0, connect_timeout=2,
            )  # fmt: skip
        except Exception:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.05)
        else:
            await nc.close()
            return


def _run_service(args: argparse.Namespace) -> None:
    service_args = list(args.service_args)
    asks_for_help = "-h" in service_args or "--help" in service_args
    if "--nats" not in service_args and not asks_for_help:
        url, prefix = _server(args)
        service_args += ["--nats", url]
        if "--prefix" not in service_args:
            service_args += ["--prefix", prefix]
    if "--credentials" not in service_args and not asks_for_help:
        own = _service_credentials(args, service_args)
        if own is not None:
            service_args += ["--credentials", str(own)]
    if args.service == "scheduler":
        from sandhold.scheduler.__main__ import main as service_main
    elif args.service == "saver":
        from sandhold.saver.__main__ import main as service_main
    elif args.service == "recovery":
        from sandhold.recovery.__main__ import main as service_main
    elif args.service == "metrics":
        from sandhold.metrics.__main__ import main as service_main
    elif args.service == "orchestrator":
        from sandhold.orchestrator.__main__ import main as service_main
    elif args.service == "gateway":
        from sandhold.gateway.__main__ import main as service_main
    else:
        from sandhold.hostagent.__main__ import main as service_main
    service_main(service_args)
