import pytest

from worker.cli import build_parser, env_var_for, main


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
