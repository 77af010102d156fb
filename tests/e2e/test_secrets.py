"""Secrets (issue 13 part 4): a value given to `exec --secret` reaches the
command's environment and nothing else — no event, no read model, no audit
export, no file anywhere under the data dir (the JetStream store included:
it is encrypted at rest, so a message that carried the value in transit
leaves no plaintext behind). Against a real `sandhold up`."""

from __future__ import annotations

import hashlib
import os
import secrets
import stat
import uuid
from pathlib import Path

import httpx
from nats.js.errors import NotFoundError
from sandhold.bus.names import Names
from sandhold.client import Client, connect
from sandhold.domain import requests as rq
from sandhold.domain.task_manifest import load_manifest

from tests.e2e.conftest import running_sandbox
from tests.e2e.harness import Host, Up
from tests.orchestrator.test_tasks import released
from tests.support.bus import assert_refused_as_malformed
from tests.support.waiting import wait_until


def files_holding(root: Path, needle: bytes) -> list[Path]:
    """Every regular file under `root` whose bytes contain `needle`."""
    found = []
    for directory, _, names in os.walk(root):
        for name in names:
            path = Path(directory) / name
            try:
                if not stat.S_ISREG(path.lstat().st_mode):
                    continue
                if needle in path.read_bytes():
                    found.append(path)
            except (FileNotFoundError, PermissionError):
                continue  # gone meanwhile (a temporary file)
    return found


async def test_a_secret_reaches_the_command_and_no_trace_of_it_is_left(up: Up, client: Client):
    value = f"ghp_{secrets.token_hex(20)}"
    sandbox_id = await running_sandbox(client)
    done = up.cli(
        "exec", sandbox_id, "--secret", f"GITHUB_TOKEN={value}", "--env", "PLAIN=seen",
        "--", "sh", "-c", 'printf %s "$GITHUB_TOKEN" | sha256sum; echo "plain=$PLAIN"',
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert hashlib.sha256(value.encode()).hexdigest() in done.stdout  # it arrived, whole
    assert "plain=seen" in done.stdout

    queued = [
        r.envelope.event
        for r in await client.sandbox_records(sandbox_id)
        if r.envelope.event.__struct_config__.tag == "command.queued"
    ]
    assert [q.secret_names for q in queued] == [["GITHUB_TOKEN"]]  # the name, recorded
    assert queued[0].env == {"PLAIN": "seen"}

    exported = up.cli("audit", "export", "--sandbox", sandbox_id)
    assert exported.returncode == 0 and "command.queued" in exported.stdout
    assert value not in exported.stdout
    shown = up.cli("history", "sandbox", sandbox_id)
    assert shown.returncode == 0 and value not in shown.stdout

    # Nowhere on disk: the bus's store, the read model, the host's records and logs.
    assert files_holding(up.data_dir, value.encode()) == []
    # ...while the same search finds a value that was recorded (it can fail).
    assert files_holding(up.data_dir, b"plain=seen") != []


async def test_a_retry_with_the_same_key_is_the_same_command_and_keeps_nothing(
    up: Up, client: Client
):
    sandbox_id = await running_sandbox(client)
    value = secrets.token_hex(16)
    key = f"run-{uuid.uuid4().hex}"
    argv = ["sh", "-c", 'test -n "$T" && echo got-it']
    first = await client.exec(sandbox_id, argv, key=key, secrets={"T": value})
    again = await client.exec(sandbox_id, argv, key=key, secrets={"T": value})
    assert first.command.id == again.command.id
    assert first.command.state == "exited" and first.command.exit_code == 0
    assert files_holding(up.data_dir, value.encode()) == []


async def test_each_commands_secrets_leave_the_store_once_it_started(up: Up, client: Client):
    """The first command of a sandbox is found by the scheduler's first look at
    it (every command it ran), the later ones as their `command.queued` is
    folded: each one's stored secrets are removed once it ran."""
    sandbox_id = await running_sandbox(client)
    names = Names("sh")
    ran = [
        await client.exec(sandbox_id, ["sh", "-c", 'test -n "$T"'], secrets={"T": f"v{i}"})
        for i in range(3)
    ]
    assert [r.command.exit_code for r in ran] == [0, 0, 0]
    async with await connect(up.admin_url) as admin:  # only the admin may read them

        async def still_kept() -> list[str]:
            kept = []
            for r in ran:
                try:
                    await admin.js.get_last_msg(names.secrets_stream, names.secret(r.command.id))
                except NotFoundError:
                    continue
                kept.append(r.command.id)
            return kept

        async def none_kept() -> bool:
            return await still_kept() == []

        await wait_until(none_kept, timeout=30, what="the secrets removed from the store")


async def test_a_released_tasks_submit_again_with_its_secrets_keeps_none_of_them(
    up: Up, client: Client
):
    """The orchestrator forgets a released task (decision 071): a retry of its
    submit, with the secrets again, is answered as the same task and must not
    leave the values kept for a task that will never use (or remove) them."""
    names = Names("sh")
    manifest = load_manifest(
        {
            "name": f"s-{uuid.uuid4().hex[:8]}",
            "secrets": ["API_TOKEN"],
            "agent": {"command": ["sh", "-c", 'test -n "$API_TOKEN"']},
        }
    )
    key = f"secrets-again-{uuid.uuid4().hex[:8]}"
    value = {"API_TOKEN": secrets.token_hex(12)}
    view = await client.submit_task(manifest, key=key, secrets=value)
    await client.wait_for_task(
        view.id, lambda s: s if s.terminal else None, timeout=120, what="the task's end"
    )
    done = await released(client, view.id)
    assert done.state == "completed", (done.reason, done.detail)
    async with await connect(up.admin_url) as admin:  # only the admin may read them

        async def kept() -> bool:
            try:
                await admin.js.get_last_msg(names.secrets_stream, names.task_secret(view.id))
            except NotFoundError:
                return False
            return True

        assert not await kept()  # used, then removed before the release
        again = await client.submit_task(manifest, key=key, secrets=value)
        assert (again.id, again.state) == (view.id, "completed")
        assert not await kept()


async def test_a_malformed_secret_gets_a_clear_error_and_runs_nothing(up: Up, client: Client):
    sandbox_id = await running_sandbox(client)
    base = {"type": "command.run", "sandbox_id": sandbox_id, "argv": ["true"]}
    cases = [
        ({"secrets": {"1BAD": "x"}}, "secrets"),
        ({"secrets": {"OK": 7}}, "secrets"),
        ({"secrets": ["T=x"]}, "secrets"),
        ({"env": {"T": "a"}, "secrets": {"T": "b"}}, "both in `env` and in `secrets`"),
    ]
    await assert_refused_as_malformed(up.url, "sh.req.command.run.default", base, cases)
    state = await client.sandbox_state(sandbox_id)
    assert state is not None and state.commands == {}


def test_the_cli_refuses_a_secret_without_a_value(up: Up):
    done = up.cli("exec", "sb-0123456789abcdef", "--secret", "NOVALUE", "--", "true")
    assert done.returncode != 0 and "NAME=VALUE" in done.stderr


def test_the_store_key_is_private_and_the_store_encrypted(up: Up):
    key = up.data_dir / "nats" / "jetstream.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    log = (up.data_dir / "nats" / "nats-server.log").read_text()
    assert "ChaCha20-Poly1305" in log


async def test_a_command_whose_secrets_are_gone_ends_not_launched_and_says_why(tmp_path: Path):
    """Queued behind a sandbox with no host yet; its secrets removed (as after a
    week unlaunched); the host comes: the command does not run without them."""
    up = Up(tmp_path / "data", "--hosts", "0").start()
    host = Host(up, "late")
    try:
        async with await connect(up.url) as client:
            sandbox_id = (await client.create_sandbox()).id  # pending: no host
            reply = await client.send(
                rq.RunCommand(
                    key="k", sandbox_id=sandbox_id, argv=["sh", "-c", "echo ran"],
                    secrets={"T": "v"},
                )
            )  # fmt: skip
            assert reply.command is not None
            command_id = reply.command.id
            names = Names("sh")
            async with await connect(up.admin_url) as admin:  # only the admin may
                await admin.js.purge_stream(names.secrets_stream, subject=names.secret(command_id))
            host.start()
            command = await client.wait_for(
                sandbox_id,
                lambda s: s.commands[command_id] if s.commands[command_id].ended else None,
                timeout=60,
                what="the command's end",
            )
            assert command.state == "not_launched"
            assert "secrets are no longer kept" in command.reason
    finally:
        host.stop()
        up.stop()


def test_a_tasks_secrets_reach_each_agent_step_and_are_recorded_by_name_only(
    up: Up, tmp_path: Path
):
    value = secrets.token_hex(24)
    path = tmp_path / "task.yaml"
    path.write_text(
        f"name: s-{uuid.uuid4().hex[:8]}\n"
        "secrets: [API_TOKEN]\n"
        "pipeline:\n"
        "  - name: first\n"
        "    agent: {command: [sh, -c, 'printf %s \"$API_TOKEN\" | sha256sum']}\n"
        "  - name: second\n"
        "    agent: {command: [sh, -c, 'test -n \"$API_TOKEN\" && echo again']}\n"
    )
    # Without the value (or with one the manifest does not name): refused, nothing sent.
    missing = up.cli("task", "submit", str(path))
    assert missing.returncode != 0 and "missing API_TOKEN" in missing.stderr
    extra = up.cli("task", "submit", str(path), "--secret", "API_TOKEN=x", "--secret", "OTHER=y")
    assert extra.returncode != 0 and "not named in the manifest: OTHER" in extra.stderr

    submitted = up.cli_json("task", "submit", str(path), "--secret", f"API_TOKEN={value}")
    watched = up.cli("task", "watch", submitted["id"], timeout=120)
    assert watched.returncode == 0, watched.stdout + watched.stderr
    shown = up.cli_json("task", "show", submitted["id"])
    outputs = [step["output"] for step in shown["steps"]]
    assert hashlib.sha256(value.encode()).hexdigest() in outputs[0]
    assert outputs[1] == "again\n"

    exported = up.cli("audit", "export")
    assert '"API_TOKEN"' in exported.stdout  # the name is recorded
    assert value not in exported.stdout
    assert files_holding(up.data_dir, value.encode()) == []


def test_a_task_naming_secrets_without_values_is_refused_over_http_saying_how(up: Up):
    made = up.cli("token", "create", "--tenant", "acme")
    assert made.returncode == 0, made.stderr
    body = {"name": "s", "secrets": ["T"], "agent": {"command": ["true"]}}
    answer = httpx.post(
        f"{up.gateway_url}/api/v1/tasks",
        json=body,
        headers={"Authorization": f"Bearer {made.stdout.strip()}"},
        timeout=30,
    )
    assert answer.status_code == 422, answer.text
    assert "as an object" in answer.json()["detail"]
    bad = httpx.post(
        f"{up.gateway_url}/api/v1/tasks",
        json={**body, "secrets": {"T": 7}},
        headers={"Authorization": f"Bearer {made.stdout.strip()}"},
        timeout=30,
    )
    assert bad.status_code == 422, bad.text


async def test_a_task_given_secrets_over_http_runs_with_them_and_keeps_no_trace(up: Up):
    made = up.cli("token", "create", "--tenant", "acme")
    assert made.returncode == 0, made.stderr
    auth = {"Authorization": f"Bearer {made.stdout.strip()}"}
    value = f"http-{secrets.token_hex(16)}"
    manifest = (
        "name: with-a-secret\n"
        "secrets:\n"
        f"  API_TOKEN: {value}\n"
        "agent:\n"
        "  command: [sh, -c, 'printf %s \"$API_TOKEN\" | sha256sum']\n"
    )
    sent = httpx.post(
        f"{up.gateway_url}/api/v1/tasks",
        content=manifest,
        headers={**auth, "Content-Type": "application/yaml"},
        timeout=30,
    )
    assert sent.status_code == 202, sent.text
    assert value not in sent.text
    task_id = sent.json()["id"]

    def ended() -> dict | None:
        shown = httpx.get(f"{up.gateway_url}/api/v1/tasks/{task_id}", headers=auth, timeout=30)
        body = shown.json()
        return body if body["state"] in ("completed", "failed", "cancelled", "timed_out") else None

    task = await wait_until(ended, timeout=120, interval=0.2, what="the task to end")
    assert task["state"] == "completed", task
    exported = up.cli("audit", "export")
    assert exported.returncode == 0 and '"API_TOKEN"' in exported.stdout
    digest = hashlib.sha256(value.encode()).hexdigest()
    assert digest in exported.stdout  # the step's output: the value arrived, whole
    assert value not in exported.stdout
    assert files_holding(up.data_dir, value.encode()) == []


async def test_a_secret_read_from_a_file_stays_off_the_command_line(
    up: Up, client: Client, tmp_path: Path
):
    value = secrets.token_hex(20)
    token_file = tmp_path / "token.txt"
    token_file.write_text(value + "\n")  # as an editor or `echo` leaves it
    sandbox_id = await running_sandbox(client)
    done = up.cli(
        "exec", sandbox_id, "--secret-file", f"TOKEN={token_file}",
        "--", "sh", "-c", 'printf %s "$TOKEN" | sha256sum',
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert hashlib.sha256(value.encode()).hexdigest() in done.stdout  # the newline dropped
    for bad, says in (
        ([f"TOKEN={tmp_path / 'absent'}"], "--secret-file TOKEN"),
        (["TOKEN"], "NAME=PATH"),
    ):
        refused = up.cli("exec", sandbox_id, "--secret-file", *bad, "--", "true")
        assert refused.returncode != 0 and says in refused.stderr, refused.stderr
    twice = up.cli(
        "exec", sandbox_id, "--secret", "TOKEN=a", "--secret-file", f"TOKEN={token_file}",
        "--", "true",
    )  # fmt: skip
    assert twice.returncode != 0 and "given twice" in twice.stderr
    assert files_holding(up.data_dir, value.encode()) == []
