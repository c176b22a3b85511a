"""Engine flags, derived from EngineConfig's fields (worker/engine/config.py), for every command
that starts an engine (run-batch, worker, bench, backfill).

A field becomes ``--field-name`` (or its ``flag``), with the field's default, choices, help and
bounds; ``TOKENMILL_*`` variables follow from the flag name (worker/cli/__init__.py). Nothing
here names a setting: a new EngineConfig field gets its flag without touching this file.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Collection
from typing import Any

from tokenmill.engine.config import EngineConfig
from tokenmill.engine.fields import check_setting, describe_bounds

ENGINE_GROUP_TITLE = "engine"


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def engine_fields(exclude: Collection[str] = ()) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(EngineConfig) if f.name not in exclude]


def flag_of(f: dataclasses.Field) -> str:
    return f.metadata["flag"] or "--" + f.name.replace("_", "-")


def _scalar_type(f: dataclasses.Field) -> type:
    """The field's type without ``| None`` (annotations are strings under ``from __future__``)."""
    hint = typing.get_type_hints(EngineConfig)[f.name]
    if isinstance(hint, types.UnionType):
        hint = next(t for t in hint.__args__ if t is not type(None))
    return hint


def _parser_of(f: dataclasses.Field, kind: type) -> Callable[[str], Any]:
    """A flag value parser that checks the field's bounds with argparse's own error."""
    meta = f.metadata

    def parse(text: str) -> Any:
        value = kind(text)
        if check_setting(f, value) is not None:
            raise argparse.ArgumentTypeError(f"must be {describe_bounds(meta)}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its "invalid int value" message
    return parse


class _Repeated(argparse.Action):
    """A repeatable flag of a tuple setting: the values given on the command line, in order. Given
    once or more, they replace the default and the environment variable's value (which the setting
    itself splits like shell words)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        given = getattr(namespace, self.dest, None)
        if given is self.default or not isinstance(given, list):
            given = []  # the first of this command line
        given.append(values)
        setattr(namespace, self.dest, given)


def add_engine_options(
    parser: argparse.ArgumentParser, *, model_required: bool = True, exclude: Collection[str] = ()
) -> argparse._ArgumentGroup:
    """One flag per EngineConfig field. ``model_required=False`` leaves ``--model`` to the caller
    (bench names bundled models, backfill reads a served name); ``exclude`` drops fields whose
    flag name the command already uses for something else (backfill's ``--seed`` is the
    sampling seed)."""
    group = parser.add_argument_group(ENGINE_GROUP_TITLE)
    skip = set(exclude) | (set() if model_required else {"model"})
    for f in engine_fields(skip):
        meta = f.metadata
        kind = _scalar_type(f)
        flag = flag_of(f)
        if kind is bool:
            action = "store_false" if meta["negated_flag"] else "store_true"
            group.add_argument(flag, dest=f.name, action=action, help=meta["help"])
            continue
        if typing.get_origin(kind) is tuple:  # a list setting: the flag repeats
            group.add_argument(flag, dest=f.name, action=_Repeated, default=f.default, metavar="KEY=VALUE",
                               help=meta["help"])
            continue
        kwargs: dict[str, Any] = {"dest": f.name, "help": meta["help"]}
        if f.default is dataclasses.MISSING:
            kwargs["required"] = True
        else:
            kwargs["default"] = f.default
        if meta["choices"] is not None:
            kwargs["choices"] = list(meta["choices"])
        elif kind in (int, float):
            kwargs["type"] = _parser_of(f, kind)
        group.add_argument(flag, **kwargs)
    return group


def engine_kwargs(args: argparse.Namespace, exclude: Collection[str] = ("model",)) -> dict[str, Any]:
    """EngineConfig keyword arguments (all but ``exclude``) from parsed flags."""
    return {f.name: getattr(args, f.name) for f in engine_fields(exclude)}


def engine_config_from_args(args: argparse.Namespace, model: str, **overrides: Any) -> EngineConfig:
    return EngineConfig(model=model, **{**engine_kwargs(args), **overrides})
