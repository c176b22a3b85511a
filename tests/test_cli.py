import pytest

from tokenmill.cli import build_parser, env_var_for, main


def test_env_var_name():
    assert env_var_for("--bootstrap-servers") == "TOKENMILL_BOOTSTRAP_SERVERS"


def test_help_lists_commands(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    assert "tokenmill" in capsys.readouterr().out


def test_no_command_prints_help(capsys):
    assert main([]) == 2


def test_every_command_has_a_handler():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    for name, p in sub.choices.items():
        assert p.get_default("func") is not None, f"subcommand {name} has no handler"


def test_worker_and_client_commands_take_the_same_kafka_security_flags():
    # One definition serves them all, so a secured cluster is reachable from every command alike.
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")

    def security_flags(command):
        return {opt for a in sub.choices[command]._actions for opt in a.option_strings
                if opt.startswith(("--security", "--sasl", "--ssl"))}

    expected = security_flags("worker")
    assert {"--ssl-key-password-file", "--ssl-no-check-hostname", "--sasl-password-file"} <= expected
    for command in ("produce", "tail", "backfill"):
        assert security_flags(command) == expected, command
