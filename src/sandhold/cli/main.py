"""The `sandhold` command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sandhold.bus.roles import ROLES

from sandhold.cli import task_args
from sandhold.cli.secret_args import add_secret_option

if TYPE_CHECKING:
    from sandhold.bus.credentials import Credentials

# Everything that talks to NATS (nats-py, msgspec, the client, the domain) is
# imported by `commands`, once a command needs it: `sandhold --help`, a typo
# and `sandhold up` do not pay for it (bench/cli.py measures the start-up).


# The domain's DEFAULT_IDLE_TIMEOUT_S (a test keeps them equal): importing the
# domain would cost every start of the CLI msgspec's import.
DEFAULT_IDLE_TIMEOUT_S = 1800.0


def _duration(text: str, *, most_days: int = 30) -> float:
    """Seconds from `900`, `15m`, `2h`, `1h30m`; 0 allowed (never)."""
    try:
        seconds = float(text)
    except ValueError:
        from sandhold.domain.task_manifest import parse_duration  # only when given

        try:
            seconds = parse_duration(text, "duration", check_range=False)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    if not 0 <= seconds <= most_days * 86400:
        raise argparse.ArgumentTypeError(f"must be 0 (never) to {most_days} days, got {text!r}")
    return seconds


def _long_duration(text: str) -> float:
    return _duration(text, most_days=365)


# sandhold.saves.DEFAULT_CACHE_BYTES (a test keeps them equal), as for the idle timeout.
DEFAULT_CHUNK_CACHE_MB = 2048


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


def credentials_of(args: argparse.Namespace) -> Credentials | None:
    """Who a command connects as: --credentials, SANDHOLD_NATS_CREDENTIALS,
    or the operator of the data dir's `sandhold up`; else the user in the URL."""
    from sandhold.bus import credentials as creds

    path = args.credentials or os.environ.get(creds.ENV)
    if path:
        return creds.load(Path(path))
    operator = creds.path_of(Path(args.data_dir) / "credentials", "operator")
    return creds.load(operator) if operator.exists() else None


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


def _parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; `only="exec"`: the top level and `exec` alone, which
    parses an exec's argv as the whole one does (building every command's
    parser costs ~13 ms, a tenth of a short exec, bench l)."""
    p = _build_parser(only)
    _everywhere(p)
    return p


def _group_of(argv: list[str]) -> str | None:
    """The command named in `argv`: its first word that is not a global option
    or a global option's value."""
    takes_value = {"--nats", "--prefix", "--credentials", "--data-dir"}
    words = iter(argv)
    for word in words:
        if word in takes_value:
            next(words, None)
        elif not word.startswith("-"):
            return word
    return None


def _add_exec(sub: Any) -> None:
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


def _build_parser(only: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sandhold", description=__doc__)
    _global_options(p, defaults=True)
    sub = p.add_subparsers(dest="group", required=True)
    if only == "exec":
        _add_exec(sub)
        return p

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
        "--idle-timeout",
        type=_duration,
        default=DEFAULT_IDLE_TIMEOUT_S,
        help="how long a sandbox may be idle (no command queued or running, none ended, "
        "no touch) before it is stopped with its final save; the next command starts it "
        "again from that save. A sandbox may set its own; 0: never (default 30m)",
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
        "--chunk-cache-mb",
        type=int,
        default=DEFAULT_CHUNK_CACHE_MB,
        help="MiB of restored chunks each host keeps for its next restores, least "
        "recently used evicted first; 0: none (default 2048)",
    )
    up.add_argument(
        "--host-capacity",
        type=int,
        default=64,
        help="how many sandboxes each host-agent runs at most (default 64)",
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

    task_args.add_parser(sub)

    completion = sub.add_parser(
        "completion",
        help="print a shell completion script",
        description="Print a completion script for SHELL. Bash: "
        "`sandhold completion bash > ~/.local/share/bash-completion/completions/sandhold`; "
        "zsh: `sandhold completion zsh > ~/.zfunc/_sandhold`.",
    )
    completion.add_argument("shell", choices=["bash", "zsh", "tcsh"])

    sandbox = sub.add_parser(
        "sandbox", help="create, list, show, start, stop, touch (keep alive), remove"
    )
    actions = sandbox.add_subparsers(dest="action", required=True)
    for name in ("create", "ls", "show", "start", "stop", "touch", "rm"):
        a = actions.add_parser(name)
        a.add_argument("--json", action="store_true")
        if name in ("show", "start", "stop", "touch", "rm"):
            a.add_argument("id")
        if name in ("create", "start", "stop", "touch", "rm"):
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
    create.add_argument(
        "--idle-timeout",
        type=_duration,
        help="stop it (with its final save) after this long idle, e.g. 900, 15m, 2h; "
        "0: never (default: the installation's, 30m)",
    )
    create.add_argument(
        "--keep-stopped",
        type=_long_duration,
        help="delete it once it has been stopped (or failed) this long, e.g. 7d; its "
        "Snapshots stay. 0: kept until deleted (the default)",
    )
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
        help="compare the rebuilt state with the gateway's read model and the services' "
        "checkpoints; exit 1 on any difference",
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
        help=(
            "only chunks older than this many seconds (default: the saver's); a short one "
            "also takes the chunks of saves and task checkouts still being stored"
        ),
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

    snap = sub.add_parser(
        "snapshot", help="take a named, retained save of a running sandbox (or delete one)"
    )
    snap.add_argument("id")
    what = snap.add_mutually_exclusive_group(required=True)
    what.add_argument("--name", help="take a Snapshot with this name")
    what.add_argument(
        "--delete",
        metavar="SAVE_ID",
        help="delete this Snapshot: retention then drops it like any save (decision 069)",
    )
    snap.add_argument("--key", help="idempotency key (default: a new one)")
    snap.add_argument("--timeout", type=float, default=600.0)
    snap.add_argument("--json", action="store_true")
    actions.choices["ls"].add_argument("--all", action="store_true", help="include deleted")

    _add_exec(sub)

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
    args = _parser("exec" if _group_of(argv) == "exec" else None).parse_args(argv)
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
                "--idle-timeout",
                str(args.idle_timeout),
            ],
            "saver": ["--save-timeout", str(args.save_timeout)],
            "recovery": [
                "--lease-ttl",
                str(args.lease_ttl),
                "--fence-margin",
                str(args.fence_margin),
            ],
            "host-agent": [
                "--lease-ttl",
                str(args.lease_ttl),
                "--driver",
                args.driver,
                "--capacity",
                str(args.host_capacity),
                "--chunk-cache-mb",
                str(args.chunk_cache_mb),
            ],
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
    if args.group == "exec":
        # Most commands end within moments: the quick path spares the import of
        # a NATS client and asyncio (decision 058); it hands over otherwise.
        from sandhold.cli import quick_exec

        code = quick_exec.run(args)
        if code is not None:
            raise SystemExit(code)
    from sandhold.cli import commands

    commands.dispatch(args)
