"""Typed configs filled from `configs/<profile>/<stage>.yaml` and CLI flags, with one-line errors.

Every stage declares dataclasses whose fields carry a `help` string. `parse_config` fills them with
trl's `TrlParser` (YAML file via `--config`, then CLI flags on top), checks every value's type and
range, and turns any problem into a `UsageError`: `main()` wrappers print it as one line and exit 2,
before any model is loaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import sys
import types
import typing
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

RUN_CONFIG_NAME = "run_config.yaml"
EXIT_USAGE = 2

T = TypeVar("T")


class UsageError(Exception):
    """Bad input a user can fix: printed as one line, exit code 2."""


class RunFailed(Exception):
    """The run itself went wrong (a failed verification, NaN loss): printed as one line, exit code 1."""


class Terminated(Exception):
    """The run was asked to stop (SIGTERM): one line naming what was saved, exit code 143 (128 + 15)."""


EXIT_TERMINATED = 143


def first_line(exc: BaseException) -> str:
    """An exception as one line for the user: its first non-empty line, or its type's name."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def offline_note() -> str:
    """A hint for load errors: ' (offline: HF_HUB_OFFLINE is set)' when that is the likely cause, else ''."""
    return " (offline: HF_HUB_OFFLINE is set)" if os.environ.get("HF_HUB_OFFLINE") == "1" else ""


def check(condition: bool, key: str, allowed: str) -> None:
    """Raise a `UsageError` naming `key` and what it allows unless `condition` holds."""
    if not condition:
        raise UsageError(f"invalid value for '{key}': must be {allowed}")


def check_tracker(report_to: str) -> None:
    """A tracker whose package is missing would fail at the first log line, after the model loaded."""
    import importlib.util

    if report_to != "none" and importlib.util.find_spec(report_to) is None:  # the package has the tracker's name
        raise UsageError(
            f"report_to {report_to} needs the {report_to} package: pip install {report_to}, or set report_to none"
        )


def one_of(value: Any, key: str, choices: Iterable[Any]) -> None:
    choices = tuple(choices)
    check(value in choices, key, "one of " + ", ".join(map(str, choices)) + f" (got {value!r})")


class ArgumentParser(argparse.ArgumentParser):
    """argparse for fitrl's own commands (the pipeline, the planner): a bad flag is a `UsageError`, so
    it prints as one line with exit 2 like every other usage error, not argparse's usage and exit. A
    flag is taken whole, never as an abbreviation of another (`--stage` is not `--stages`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{"allow_abbrev": False, **kwargs})

    def error(self, message: str) -> typing.NoReturn:
        raise UsageError(message)


def _import_trl_parser() -> type:
    from trl import TrlParser

    class _Parser(TrlParser):
        # argparse prints usage and exits on its own; we want one line and our own exit path.
        def error(self, message: str) -> typing.NoReturn:
            raise UsageError(message)

    return _Parser


def _allowed_types(annotation: Any) -> tuple[tuple[type, ...], tuple[Any, ...] | None]:
    """The runtime types (and Literal choices) an annotation admits; empty tuple means 'do not check'."""
    if isinstance(annotation, str):
        return (), None
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return (), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        allowed: list[type] = []
        for arg in typing.get_args(annotation):
            sub, choices = _allowed_types(arg)
            if not sub and arg is not type(None):
                return (), choices
            allowed.extend(sub)
        return tuple(allowed), None
    if annotation is type(None):
        return (type(None),), None
    if origin is list:
        return (list,), None
    if annotation is float:
        return (float, int), None
    if annotation in (int, str, bool):
        return (annotation,), None
    return (), None


def _check_types(obj: Any) -> None:
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        allowed, choices = _allowed_types(hints.get(f.name, Any))
        if choices is not None:
            one_of(value, f.name, choices)
            continue
        if not allowed:
            continue
        # bool is an int in Python; a YAML `true` for an int field is still a mistake.
        ok = isinstance(value, allowed) and not (isinstance(value, bool) and bool not in allowed)
        if not ok:
            names = " or ".join(sorted({"null" if t is type(None) else t.__name__ for t in allowed}))
            raise UsageError(f"invalid value for '{f.name}': must be {names} (got {value!r})")
        # nan passes every comparison a range check makes, and inf most: no setting wants either.
        if isinstance(value, float) and not math.isfinite(value):
            raise UsageError(f"invalid value for '{f.name}': must be a finite number (got {value!r})")


def _check_config_file(args: list[str], dataclass_types: Sequence[type]) -> None:
    """The `--config` file exists, is a YAML mapping, and names only keys the stage takes."""
    i = args.index("--config")
    if i + 1 >= len(args):
        raise UsageError("--config needs a path to a YAML file, e.g. --config configs/demo/sft.yaml")
    path = Path(args[i + 1])
    if not path.is_file():
        raise UsageError(f"config file not found: {path}")
    try:
        content = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise UsageError(f"config file {path} is not valid YAML: {first_line(e)}") from None
    if not isinstance(content, dict):
        raise UsageError(f"config file {path} must hold a mapping of key: value")
    known = {f.name for t in dataclass_types for f in dataclasses.fields(t) if f.init}
    unknown = sorted(set(content) - known - {"env"})
    if unknown:
        raise UsageError(f"unknown key '{unknown[0]}' in {path}; run the script with --help to list the keys it takes")


_NEGATIVE_NUMBER = re.compile(r"-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _split_config_flag(args: list[str]) -> list[str]:
    """`--config=FILE` as `--config FILE`, the one form trl's parser reads a config file from."""
    out: list[str] = []
    for arg in args:
        out += ["--config", arg.split("=", 1)[1]] if arg.startswith("--config=") else [arg]
    return out


def _attach_negative_numbers(args: list[str]) -> list[str]:
    """`--flag -1e-3` as `--flag=-1e-3`: argparse would read a negative number in exponent form as a flag."""
    out: list[str] = []
    for arg in args:
        if out and _NEGATIVE_NUMBER.fullmatch(arg) and out[-1].startswith("--") and "=" not in out[-1]:
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def parse_config(
    dataclass_types: Sequence[type], args: Sequence[str] | None = None, defaults: dict[str, Any] | None = None
) -> tuple[Any, ...]:
    """Fill `dataclass_types` from `--config FILE.yaml` and CLI flags; raise `UsageError` on any problem.

    `defaults` (e.g. what the previous stage ran with) replace the dataclass defaults; the YAML file
    overrides them, and CLI flags override both.
    """
    # A flag is taken whole: an abbreviation would silently set another setting (GRPO read
    # `--num_samples 4` as `--num_samples_to_show`), where the YAML file refuses the same key.
    parser = _import_trl_parser()(dataclass_types, allow_abbrev=False)
    args = _attach_negative_numbers(_split_config_flag(list(sys.argv[1:] if args is None else args)))
    if defaults:
        parser.set_defaults_with_config(**defaults)
    if "--config" in args:
        _check_config_file(args, dataclass_types)
    try:
        parsed = parser.parse_args_and_config(args)
    except UsageError:
        raise
    except (ValueError, TypeError) as e:  # __post_init__ checks and HfArgumentParser's own errors
        message = first_line(e)
        if "not used by the HfArgumentParser" in message:
            message = f"unknown flag(s) {message.split(':', 1)[1].strip()}; run with --help to list them"
        raise UsageError(message) from None
    for obj in parsed:
        _check_types(obj)
        validate = getattr(obj, "validate", None)
        if validate is not None:
            validate()
    return tuple(parsed)


def _plain(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "value") and not isinstance(value, (int, float, str, bool)):  # enums
        return value.value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def config_dict(*configs: Any) -> dict[str, Any]:
    """One flat mapping of every init field: the same shape `--config` reads back."""
    out: dict[str, Any] = {}
    for cfg in configs:
        for f in dataclasses.fields(cfg):
            if f.init:
                out[f.name] = _plain(getattr(cfg, f.name))
    return out


def with_overrides(configs: Sequence[Any], overrides: dict[str, Any]) -> tuple[Any, ...]:
    """`configs` with each key of `overrides` replaced in the config that has that field."""
    out = []
    for cfg in configs:
        names = {f.name for f in dataclasses.fields(cfg) if f.init}
        changed = {k: v for k, v in overrides.items() if k in names}
        out.append(dataclasses.replace(cfg, **changed) if changed else cfg)
    unknown = set(overrides) - {f.name for cfg in configs for f in dataclasses.fields(cfg)}
    if unknown:
        raise ValueError(f"no config has the field(s) {', '.join(sorted(unknown))}")
    return tuple(out)


def save_run_config(output_dir: str | Path, *configs: Any) -> Path:
    """Write the resolved settings as `run_config.yaml`, readable back with `--config`."""
    path = Path(output_dir) / RUN_CONFIG_NAME
    # Written aside and renamed: a checkpoint counts as complete once it holds this file.
    staging = path.with_name(path.name + ".partial")
    staging.write_text(yaml.safe_dump(config_dict(*configs), sort_keys=False))
    staging.replace(path)
    return path


def _damaged(path: Path, problem: str) -> UsageError:
    return UsageError(f"{path} {problem}; it is damaged: rerun the stage that wrote it (or delete the file)")


def load_run_config(directory: str | Path) -> dict[str, Any]:
    """Read the `run_config.yaml` a previous stage wrote into `directory` ({} when there is none)."""
    path = Path(directory) / RUN_CONFIG_NAME
    if not path.is_file():
        return {}
    try:
        config = yaml.safe_load(path.read_bytes())
    except (yaml.YAMLError, OSError) as e:
        raise _damaged(path, f"is not valid YAML ({first_line(e)})") from None
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise _damaged(path, "does not hold settings (a mapping of key: value)")
    return config


def config_of(configs: Sequence[Any], kind: type[T]) -> T:
    """The config of type `kind` among a stage's filled configs."""
    return next(c for c in configs if isinstance(c, kind))


def help_field(default: Any, help: str, **metadata: Any) -> Any:
    """A dataclass field with a help string (lists and dicts get a default_factory)."""
    help = help.replace("%", "%%")  # argparse formats help strings with %: '30%' would garble --help
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata={"help": help, **metadata})
    return dataclasses.field(default=default, metadata={"help": help, **metadata})


__all__ = [
    "EXIT_TERMINATED",
    "EXIT_USAGE",
    "ArgumentParser",
    "RUN_CONFIG_NAME",
    "RunFailed",
    "Terminated",
    "UsageError",
    "check",
    "check_tracker",
    "config_dict",
    "config_of",
    "first_line",
    "help_field",
    "load_run_config",
    "offline_note",
    "one_of",
    "parse_config",
    "save_run_config",
    "with_overrides",
]
