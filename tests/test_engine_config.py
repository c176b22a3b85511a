"""EngineConfig is the one definition of the engine's settings: the flags of every command that
starts an engine are derived from its fields, and its validation from their metadata."""

from __future__ import annotations

import argparse
import dataclasses
import re

import pytest

from tokenmill.cli import _apply_env_defaults, build_parser, env_var_for
from tokenmill.cli.engine_options import ENGINE_GROUP_TITLE, add_engine_options, engine_kwargs, flag_of
from tokenmill.engine.config import EngineConfig

# The commands that start an engine, and the fields whose flag the command spends on another
# meaning (documented at the command).
ENGINE_COMMANDS = {
    "run-batch": set(),
    "worker": set(),
    "bench": {"model", "cpu_threads"},  # --model names a bundled model or a directory; --threads sets both sides
    "backfill": {"model", "seed"},  # --model is also the served name; --seed the jobs' sampling seed
}


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _engine_group_dests(parser: argparse.ArgumentParser) -> set[str]:
    group = next(g for g in parser._action_groups if g.title == ENGINE_GROUP_TITLE)
    return {a.dest for a in group._group_actions}


@pytest.mark.parametrize("command", sorted(ENGINE_COMMANDS))
def test_every_engine_field_has_a_flag_and_every_engine_flag_a_field(command):
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    dests = _engine_group_dests(_subparser(command))
    assert dests == fields - ENGINE_COMMANDS[command], command


@pytest.mark.parametrize("command", sorted(ENGINE_COMMANDS))
def test_flag_defaults_and_choices_are_the_fields_own(command):
    parser = _subparser(command)
    by_dest = {a.dest: a for a in parser._actions}
    for f in dataclasses.fields(EngineConfig):
        if f.name in ENGINE_COMMANDS[command] or f.name == "model":
            continue
        action = by_dest[f.name]
        assert action.default == f.default, (command, f.name)
        assert action.help == f.metadata["help"], (command, f.name)
        if f.metadata["choices"] is not None:
            assert tuple(action.choices) == f.metadata["choices"], (command, f.name)


def test_parsed_defaults_build_the_default_config():
    parser = argparse.ArgumentParser()
    add_engine_options(parser, model_required=False)
    assert EngineConfig(model="m", **engine_kwargs(parser.parse_args([]))) == EngineConfig(model="m")


def test_a_flag_outside_the_bounds_is_refused_by_the_parser(capsys):
    parser = argparse.ArgumentParser()
    add_engine_options(parser, model_required=False)
    for argv in (["--block-size", "0"], ["--gpu-memory-fraction", "1.5"], ["--kv-cache-gb", "0"],
                 ["--dtype", "int3"], ["--max-num-seqs", "many"]):
        with pytest.raises(SystemExit):
            parser.parse_args(argv)
    assert "--block-size: must be >= 1" in capsys.readouterr().err


def test_the_prefix_cache_flag_and_its_variable_turn_the_cache_off(monkeypatch):
    parser = argparse.ArgumentParser()
    add_engine_options(parser, model_required=False)
    assert engine_kwargs(parser.parse_args(["--no-prefix-caching"]))["enable_prefix_caching"] is False
    monkeypatch.setenv("TOKENMILL_NO_PREFIX_CACHING", "1")
    parser = argparse.ArgumentParser()
    add_engine_options(parser, model_required=False)
    _apply_env_defaults(parser)
    assert engine_kwargs(parser.parse_args([]))["enable_prefix_caching"] is False


def test_every_engine_flag_reads_its_tokenmill_variable(monkeypatch):
    values = {"max_num_seqs": "7", "kv_cache_gb": "0.5", "dtype": "float32", "served_model_name": "x"}
    for name, raw in values.items():
        f = next(f for f in dataclasses.fields(EngineConfig) if f.name == name)
        monkeypatch.setenv(env_var_for(flag_of(f)), raw)
    parser = argparse.ArgumentParser()
    add_engine_options(parser, model_required=False)
    _apply_env_defaults(parser)
    got = engine_kwargs(parser.parse_args([]))
    assert (got["max_num_seqs"], got["kv_cache_gb"], got["dtype"], got["served_model_name"]) == (7, 0.5, "float32", "x")


def test_the_config_validates_from_the_same_metadata():
    cases = {
        "block_size": (0, "block_size must be >= 1"),
        "kv_cache_gb": (0.0, "kv_cache_gb must be > 0"),
        "gpu_memory_fraction": (0.0, "gpu_memory_fraction must be in (0, 1]"),
        "max_num_batched_tokens": (0, "max_num_batched_tokens must be >= 1"),
        "max_num_seqs": (0, "max_num_seqs must be >= 1"),
        "max_model_len": (0, "max_model_len must be >= 1"),
        "attention_backend": ("cudnn", "attention_backend must be one of auto, torch, triton"),
    }
    for name, (value, message) in cases.items():
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("]", r"\]")):
            EngineConfig(model="m", **{name: value})
    with pytest.raises(ValueError, match="gpu_memory_fraction must be in"):
        EngineConfig(model="m", gpu_memory_fraction=1.01)
    # Several problems are listed at once.
    with pytest.raises(ValueError, match="block_size.*max_num_seqs"):
        EngineConfig(model="m", block_size=0, max_num_seqs=0)
    assert EngineConfig(model="m", kv_cache_gb=None, max_model_len=None).kv_cache_gb is None


def test_the_config_module_does_not_load_torch():
    import subprocess
    import sys

    code = "import sys, tokenmill.engine.config, tokenmill.config; assert 'torch' not in sys.modules, 'torch loaded'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_cpu_path_settings_read_their_old_variable_names(monkeypatch):
    """The settings that were environment switches keep their variables' names (now read by the CLI,
    as every setting's): a value of the old spelling is refused, not taken for the default."""
    monkeypatch.setenv("TOKENMILL_AMX_GEMM", "off")
    monkeypatch.setenv("TOKENMILL_DECODE_LAYERS_IN_C", "on")
    monkeypatch.setenv("TOKENMILL_HUGE_PAGES", "0")
    parser = argparse.ArgumentParser()
    add_engine_options(parser, model_required=False)
    _apply_env_defaults(parser)
    got = engine_kwargs(parser.parse_args([]))
    assert (got["amx_gemm"], got["decode_layers_in_c"], got["malloc_tuning"]) == ("off", "on", "auto")
    with pytest.raises(ValueError, match="huge_pages must be one of auto, on, off, got '0'"):
        EngineConfig(model="m", **got)


def test_no_tokenmill_variable_is_read_outside_the_settings():
    """Every engine setting is an EngineConfig field, its TOKENMILL_* variable read by the CLI from the
    flag's name; the package names a variable itself only for the cache folder and the broker script."""
    import ast
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    allowed = {"TOKENMILL_CACHE", "TOKENMILL_KAFKA_SCRIPT"}
    named = {}
    for folder in ("worker", "kernels", "schemas", "tools"):
        for path in (repo / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                        and re.fullmatch(r"TOKENMILL_[A-Z0-9_]+", node.value):
                    named.setdefault(node.value, []).append(f"{path.relative_to(repo)}:{node.lineno}")
    assert set(named) <= allowed, {k: v for k, v in named.items() if k not in allowed}
