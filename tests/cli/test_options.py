"""The CLI as people expect one to behave: help anywhere without a server, global
options before or after the command."""

from __future__ import annotations

import argparse

import pytest

from sandhold.cli import main as cli


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    found = [path]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, command in action.choices.items():
                found += _commands(command, (*path, name))
    return found


COMMANDS = _commands(cli._parser())
SERVICES = ["scheduler", "host-agent", "saver", "recovery", "metrics", "orchestrator", "gateway"]


@pytest.fixture(autouse=True)
def _no_server(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.delenv("SANDHOLD_NATS_URL", raising=False)
    monkeypatch.setenv("SANDHOLD_DATA_DIR", str(tmp_path / "nothing-here"))


@pytest.mark.parametrize("path", COMMANDS, ids=lambda p: " ".join(p) or "sandhold")
def test_help_of_every_command_works_without_a_server(path, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main([*path, "--help"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith("usage: sandhold")


@pytest.mark.parametrize("service", SERVICES)
def test_help_of_every_service_works_without_a_server(service, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["run", service, "--help"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: sandhold run {service}")


@pytest.mark.parametrize(
    "argv",
    [
        ["--data-dir", "{d}", "sandbox", "ls"],
        ["sandbox", "--data-dir", "{d}", "ls"],
        ["sandbox", "ls", "--data-dir", "{d}"],
    ],
    ids=["before", "between", "after"],
)
def test_global_options_are_taken_before_or_after_the_command(argv, tmp_path) -> None:
    wanted = str(tmp_path / "mine")
    args = cli._parser().parse_args([a.replace("{d}", wanted) for a in argv])
    assert args.data_dir == wanted


def test_a_global_option_given_first_is_not_undone_by_the_command(tmp_path) -> None:
    args = cli._parser().parse_args(["--nats", "nats://x:1", "--data-dir", str(tmp_path), "up"])
    assert (args.nats, args.data_dir) == ("nats://x:1", str(tmp_path))


def test_without_a_server_the_error_names_where_it_looked(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["--data-dir", str(tmp_path / "d"), "sandbox", "ls"])
    assert "no server found" in str(exited.value.code)
    assert str(tmp_path / "d" / "runtime.json") in str(exited.value.code)


@pytest.mark.parametrize("shell", ["bash", "zsh"])
def test_a_completion_script_knows_the_commands(shell, capsys) -> None:
    cli.main(["completion", shell])
    script = capsys.readouterr().out
    for command in ("sandbox", "exec", "task", "snapshot", "--data-dir"):
        assert command in script


@pytest.mark.parametrize(
    "argv",
    [
        ["exec", "sb-1"],
        ["--data-dir", "d", "exec", "sb-1", "--json", "--key", "k"],
        ["exec", "--nats", "nats://h:1", "sb-1", "--env", "A=1", "--env", "B=2", "--user", "root"],
        ["--prefix", "p", "--credentials", "c", "exec", "sb-1", "--timeout", "5", "--cwd", "w"],
        ["exec", "sb-1", "--secret", "T=v", "--data-dir", "e"],
    ],
)
def test_an_exec_is_parsed_by_its_own_parser_as_by_the_whole(argv: list[str]) -> None:
    """`sandhold exec` builds only its own parser (the whole one costs ~13 ms)."""
    assert cli._group_of(argv) == "exec"
    assert cli._parser("exec").parse_args(argv) == cli._parser().parse_args(argv)


def test_the_command_is_found_past_global_options_and_their_values() -> None:
    assert cli._group_of(["--nats", "exec", "sandbox", "ls"]) == "sandbox", "a value, not exec"
    assert cli._group_of(["--data-dir=exec", "up"]) == "up"
    assert cli._group_of(["--help"]) is None
