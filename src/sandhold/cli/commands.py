"""What the `sandhold` commands do, once parsed (`main.py` parses)."""

from __future__ import annotations

import argparse
import asyncio
import importlib
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
from sandhold.client import Client, connect
from sandhold.domain.errors import InfraError, Rejected

from sandhold.cli.main import _runtime, _server, credentials_of
from sandhold.cli.progress import progress
from sandhold.cli.report import EXIT_REJECTED, EXIT_UNREACHABLE, print_json, report_exec
from sandhold.cli.secret_args import secrets_of
from sandhold.cli.status import status_block


def _print_sandbox(view, as_json: bool) -> None:
    if as_json:
        print_json(view)
    else:
        print(f"{view.id}  {view.phase}  host={view.host or '-'}  generation={view.generation}")


async def _with_client(args: argparse.Namespace, action: Callable[[Client], Awaitable[int]]) -> int:
    url, prefix = _server(args)
    try:
        client = await asyncio.wait_for(
            connect(url, prefix=prefix, credentials=credentials_of(args)), 10
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
                idle_timeout_s=args.idle_timeout,
                keep_stopped_s=args.keep_stopped,
            )
            if args.wait or args.from_snapshot:
                async with progress(client, view.id):
                    view = await client.wait_for_phase(view.id, {"running", "failed"}, timeout=600)
            _print_sandbox(view, args.json)
            return 0 if view.phase != "failed" else 1
        case "ls":
            views = await client.list_sandboxes(include_deleted=args.all)
            if args.json:
                print_json(views)
            else:
                for view in views:
                    _print_sandbox(view, False)
        case "show":
            view = await client.show_sandbox(args.id)
            view.storage = await client.storage()
            if args.json:
                print_json(view)
            else:
                print(status_block(view))
        case "start":
            _print_sandbox(await client.start_sandbox(args.id, key=args.key), args.json)
        case "stop":
            return await _stop(args, client)
        case "touch":
            _print_sandbox(await client.touch_sandbox(args.id, key=args.key), args.json)
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
        print_json(outcome)
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
        print_json(hosts)
    else:
        for h in hosts["hosts"]:
            age = h["last_renewal_age_s"]
            cache: dict[str, Any] | None = h.get("chunk_cache")  # type: ignore[assignment]
            held = "none"
            if cache:
                ratio = cache["hit_ratio"]
                held = (
                    f"{cache['bytes'] / 2**20:.0f}/{cache['limit_bytes'] / 2**20:.0f}MiB "
                    f"hits={'-' if ratio is None else f'{ratio:.0%}'}"
                )
            print(
                f"{h['host']}  {h['status']}  epoch={h['epoch']}  "
                f"renewed={'-' if age is None else f'{age:.1f}s ago'}  "
                f"sandboxes={h['sandboxes']}  cache={held}"
            )
    return 0


async def _admin(args: argparse.Namespace, client: Client) -> int:
    if args.action == "rebuild-read-model":
        services = _runtime(Path(args.data_dir)).get("services", {})
        gateways = sum(1 for name in services if name.split("-")[0] == "gateway") or 1
        return await _cli("audit").rebuild_read_model(
            client, timeout=args.timeout, gateways=gateways
        )
    body = {} if args.grace is None else {"grace_s": args.grace}
    reply = await client.nc.request(
        f"{client.names.prefix}.admin.gc", msgspec.json.encode(body), timeout=300
    )
    result = msgspec.json.decode(reply.data)
    print_json(result)
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
        print_json({"sandbox_id": view.id, "connections": view.connections,
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
    if args.delete is not None:
        save = await client.delete_snapshot(args.id, args.delete, key=args.key)
        if args.json:
            print_json(save)
        else:
            print(f"snapshot {save.id} deleted: a {save.state} save, kept while retention keeps it")
        return 0
    save = await client.snapshot(args.id, args.name, key=args.key)
    async with progress(client, args.id):
        save = await client.wait_for_save(args.id, save.id, timeout=args.timeout)
    if args.json:
        print_json(save)
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

    # What the quick path printed before it handed over (`quick_exec`): not again.
    skip = dict(getattr(args, "printed", None) or {})

    def stream(name: str, data: bytes) -> None:
        left = skip.get(name, 0)
        if left:
            skip[name] = left - min(left, len(data))
            data = data[left:]
        if not data:
            return
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
    return report_exec(result.command, result.stdout, result.stderr, args.json)


async def _command(args: argparse.Namespace, client: Client) -> int:
    match args.action:
        case "show":
            print_json(await client.show_command(args.sandbox, args.command))
        case "output":
            output = await client.read_output(args.sandbox, args.command)
            sys.stdout.buffer.write(output.get("stdout", b""))
            sys.stderr.buffer.write(output.get("stderr", b""))
        case "cancel":
            print_json(await client.cancel_command(args.sandbox, args.command, key=args.key))
    return 0


# --- parser ------------------------------------------------------------------


def _cli(module: str) -> Any:
    """`sandhold.cli.<module>`, imported when its command runs: `task` and `top`
    pull in the save store and the metrics fold, which an `exec` needs not."""
    return importlib.import_module(f"sandhold.cli.{module}")


def dispatch(args: argparse.Namespace) -> None:
    """Run the parsed command (every group but `up`, `deploy`, `completion`)."""
    if args.group == "token":
        raise SystemExit(_token(args))
    if args.group == "credentials":
        raise SystemExit(_credentials_command(args))
    if args.group == "streams":
        raise SystemExit(asyncio.run(_ensure_streams(args)))
    if args.group == "run":
        _run_service(args)
        return
    handlers: dict[str, Callable[[argparse.Namespace, Client], Awaitable[int]]] = {
        "sandbox": _sandbox,
        "task": lambda a, c: _cli("tasks").run(a, c),
        "exec": _exec,
        "command": _command,
        "snapshot": _snapshot,
        "connection": _connection,
        "admin": _admin,
        "host": _host,
        "cluster": lambda a, c: _cli("cluster").status(
            c, _runtime(Path(a.data_dir)), as_json=a.json
        ),
        "replay": lambda a, c: _cli("audit").replay(
            c,
            a.id,
            a.at,
            a.json,
            kind=a.kind,
            verify=a.verify,
            read_model=_read_model(a),
            checkpoints=_checkpoints(a),
        ),
        "history": lambda a, c: _cli("audit").history(c, a.id, kind=a.kind),
        "audit": lambda a, c: _cli("audit").export(c, a.sandbox, a.since),
        "events": lambda a, c: _cli("audit").tail(c, a.sandbox, a.count),
        "top": lambda a, c: _cli("top").top(
            c, interval=a.interval, once=a.once, as_json=a.json, checkpoints=_checkpoints(a)
        ),
    }
    handler = handlers[args.group]
    from sandhold.telemetry import tracing

    tracing.configure("cli")  # a request made here starts its trace here, if tracing is on
    import uvloop

    code = uvloop.run(_with_client(args, lambda client: handler(args, client)))
    raise SystemExit(code)


def _checkpoints(args: argparse.Namespace) -> Path | None:
    """The services' checkpoints `sandhold up` keeps (decision 039), if any."""
    found = Path(args.data_dir) / "checkpoints"
    try:
        return found if found.is_dir() else None
    except OSError:  # another user's data dir (0700): none of its checkpoints here
        return None


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
                print_json([{"name": t.name, "tenant": t.tenant} for t in entries])
            for t in [] if args.json else entries:
                print(f"{t.name}  tenant={t.tenant}")
        case "revoke":
            if not tokens.revoke(path, args.name):
                print(f"sandhold: no token named {args.name!r}", file=sys.stderr)
                return EXIT_REJECTED
    return 0


async def _ensure_streams(args: argparse.Namespace) -> int:
    """As the admin (--credentials, or the data dir's admin.json)."""
    from sandhold.bus.connection import connect as bus_connect
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
                print_json(
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
