"""`sandhold exec`'s quick path (decision 058) through `sandhold up`: it ends a
short command on its own, says what the scheduler refused, and hands a long
one to the full client, which prints the rest of its output and nothing twice."""

from __future__ import annotations

import argparse

import pytest

from sandhold.cli import commands, quick_exec
from sandhold.cli.main import _parser
from tests.e2e.harness import Up


def _args(up: Up, *argv: str) -> argparse.Namespace:
    """`sandhold --data-dir D exec ...` as `main` parses it (the command after `--`)."""
    split = argv.index("--")
    args = _parser().parse_args(["--data-dir", str(up.data_dir), "exec", *argv[:split]])
    args.argv = [*args.argv, *argv[split + 1 :]]
    return args


def test_a_short_command_ends_on_the_quick_path_with_its_output_and_exit_code(
    up: Up, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.delenv("SANDHOLD_NATS_URL", raising=False)
    sandbox_id = up.cli_json("sandbox", "create", "--wait")["id"]
    args = _args(up, sandbox_id, "--", "sh", "-c", "echo out; echo err >&2; exit 3")
    assert quick_exec.run(args) == 3, "ended here: not handed over"
    captured = capfd.readouterr()
    assert captured.out == "out\n" and captured.err == "err\n"
    # The same key again is the same command: its end, nothing run twice.
    again = up.cli(
        "exec", sandbox_id, "--key", args.key, "--", "sh", "-c", "echo out; echo err >&2; exit 3"
    )
    assert again.returncode == 3 and (again.stdout, again.stderr) == ("out\n", "err\n")


def test_a_refusal_is_said_and_exits_2(
    up: Up, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.delenv("SANDHOLD_NATS_URL", raising=False)
    sandbox_id = up.cli_json("sandbox", "create", "--wait")["id"]
    assert up.cli("sandbox", "rm", sandbox_id).returncode == 0  # asked: it refuses commands
    assert quick_exec.run(_args(up, sandbox_id, "--", "true")) == 2
    assert "sandhold: sandbox_not_running: " in capfd.readouterr().err


def test_a_long_command_is_handed_over_and_its_output_printed_once(
    up: Up, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.delenv("SANDHOLD_NATS_URL", raising=False)
    monkeypatch.setattr(quick_exec, "HAND_OVER_S", 1.0)
    sandbox_id = up.cli_json("sandbox", "create", "--wait")["id"]
    args = _args(up, sandbox_id, "--", "sh", "-c", "echo first; sleep 4; echo second")
    assert quick_exec.run(args) is None, "still running after HAND_OVER_S: handed over"
    quick = capfd.readouterr().out  # "first\n" unless its launch took longer than that
    assert args.printed == {"stdout": len(quick), "stderr": 0}
    # As `main` goes on: the full client, same key, skipping what was printed.
    with pytest.raises(SystemExit) as ended:
        commands.dispatch(args)
    assert ended.value.code == 0
    assert quick + capfd.readouterr().out == "first\nsecond\n"


def test_through_the_cli_a_handed_over_command_prints_everything_once(up: Up):
    sandbox_id = up.cli_json("sandbox", "create", "--wait")["id"]
    done = up.cli("exec", sandbox_id, "--", "sh", "-c", "echo a; sleep 3; echo b >&2; echo c")
    assert done.returncode == 0
    assert done.stdout == "a\nc\n" and done.stderr == "b\n"
