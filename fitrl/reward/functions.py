"""Reward functions by name, in trl's convention: fitrl's registry, or your own function.

A reward function takes the completions (strings, or chat messages) and, as keyword arguments, the
prompts, `completion_ids` and every column of the dataset (`gold`, `answer`, ... for GSM8K), and
returns one number per completion (`None`: the reward does not apply to it). GRPO's `reward_funcs`
names each one as

- a registry name (`REGISTRY`): `strict_format`, `soft_format`, `accuracy` (GSM8K's three), or
- your own: `module:function` (a module on the Python path or in the working directory) or
  `path/to/file.py:function`.

Each function is called through `Checked`, which stops the run with one line naming the function when
it returns anything but one finite number (or None) per completion; trl would fail later, or sum an
infinity into every advantage.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import math
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fitrl.config import RunFailed, UsageError, first_line
from fitrl.reward.settings import RewardArguments
from fitrl.tasks.grading import accuracy_reward, soft_format_reward, strict_format_reward

RewardFunction = Callable[..., list[float | None]]


@dataclass(frozen=True)
class Entry:
    """A registry reward: the function and whether it scores only the form of a completion (`format`),
    which alone, with no KL term, a policy learns to satisfy with empty content."""

    function: RewardFunction
    format_only: bool


REGISTRY: dict[str, Entry] = {
    "strict_format": Entry(strict_format_reward, format_only=True),
    "soft_format": Entry(soft_format_reward, format_only=True),
    "accuracy": Entry(accuracy_reward, format_only=False),
}
DEFAULT_REWARDS = ["strict_format", "soft_format", "accuracy"]


def _fix(name: str) -> str:
    return (
        f"give a registry name ({', '.join(REGISTRY)}), module:function on the Python path or in the working "
        f"directory, or path/to/file.py:function (got '{name}')"
    )


def resolve(name: str, setting: str = "reward_funcs") -> RewardFunction:
    """The function `name` stands for; a name that does not resolve to a callable is a `UsageError` that
    names the `setting` it came from."""
    if name in REGISTRY:
        return REGISTRY[name].function
    module_name, sep, attr = name.rpartition(":")
    if not sep:
        module_name, _, attr = name.rpartition(".")
    if not module_name or not attr:
        raise UsageError(f"{setting}: unknown reward '{name}'; {_fix(name)}")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name).expanduser()
            if not path.is_file():
                raise UsageError(f"{setting}: file {path} does not exist; {_fix(name)}")
            spec = importlib.util.spec_from_file_location(f"fitrl_user_rewards_{path.stem}", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path:  # `accelerate launch scripts/x.py` puts scripts/ there, not the cwd
                sys.path.append(os.getcwd())
            module = importlib.import_module(module_name)
    except UsageError:
        raise
    except Exception as e:  # the user's module failed to import: say which and why, in one line
        raise UsageError(f"{setting}: cannot import {module_name}: {type(e).__name__}: {first_line(e)}") from None
    function = getattr(module, attr, None)
    if not callable(function):
        raise UsageError(f"{setting}: {module_name} has no function '{attr}'; {_fix(name)}")
    return function


# What trl's GRPOTrainer passes every reward function, beside the dataset's columns; fitrl passes the same.
TRL_KEYWORDS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")


def trl_keywords(prompts: list[Any], completion_ids: list[list[int]]) -> dict[str, Any]:
    """The keywords trl passes besides the completions and the columns, for a caller outside trl's trainer:
    no trainer state, and the logging hooks doing nothing."""
    return {
        "prompts": prompts,
        "completion_ids": completion_ids,
        "trainer_state": None,
        "log_extra": lambda *a, **k: None,
        "log_metric": lambda *a, **k: None,
    }


def check_call(name: str, function: RewardFunction, columns: Sequence[str], setting: str) -> None:
    """A function that cannot be called as trl calls one (a required parameter that is none of
    `TRL_KEYWORDS` or the dataset's `columns`) is a `UsageError` naming the parameter, before anything loads."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # a builtin or C function: nothing to read
        return
    passed = {*TRL_KEYWORDS, *columns}
    for p in parameters:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.default is not p.empty:
            continue
        if p.kind is p.POSITIONAL_ONLY or p.name not in passed:
            raise UsageError(
                f"{setting}: reward '{name}' takes '{p.name}', which is not passed: a reward function is called "
                f"with {', '.join(TRL_KEYWORDS[:3])} and the data's columns ({', '.join(columns) or 'none'}) "
                f"as keywords; give '{p.name}' a default, or take **kwargs"
            )


def format_only(names: Sequence[str]) -> bool:
    """Whether every reward in `names` scores only the format (your own functions count as content)."""
    return all(name in REGISTRY and REGISTRY[name].format_only for name in names)


class Checked:
    """A reward function whose every output is checked: one finite number or None per completion.
    `observe(completion_ids, log_metric)` (the first function's) sees each batch once, for the monitors."""

    def __init__(self, name: str, function: RewardFunction, observe: Callable[..., None] | None = None) -> None:
        self.name, self.function, self.observe = name, function, observe
        functools.update_wrapper(self, function)  # trl logs `rewards/<__name__>/mean`

    def check(self, columns: Sequence[str], setting: str = "reward_funcs") -> None:
        """That the function can be called with trl's keywords and these dataset `columns` (`check_call`)."""
        check_call(self.name, self.function, columns, setting)

    def __call__(self, completions: Sequence[Any], **kwargs: Any) -> list[float | None]:
        if self.observe is not None and "completion_ids" in kwargs and "log_metric" in kwargs:
            self.observe(kwargs["completion_ids"], kwargs["log_metric"])
        out = self.function(completions=completions, **kwargs)
        problem = _problem(out, len(completions))
        if problem is not None:
            raise RunFailed(
                f"reward function '{self.name}' returned {problem}; it must return one number (or None) per completion"
            )
        return list(out)


def _problem(out: Any, n: int) -> str | None:
    if not isinstance(out, (list, tuple)):
        return f"a {type(out).__name__}, not a list"
    if len(out) != n:
        return f"{len(out)} values for {n} completions"
    for value in out:
        if value is None:
            continue
        if not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
            return f"a {type(value).__name__} ({value!r:.40})"
        if not math.isfinite(float(value)):
            return f"a non-finite value ({value})"
    return None


def reward_functions(names: Sequence[str], observe: Callable[..., None] | None = None) -> list[Checked]:
    """The functions `names` stand for, checked; `observe` watches the batches through the first one."""
    return [Checked(name, resolve(name), observe if i == 0 else None) for i, name in enumerate(names)]


class FunctionReward:
    """Scores responses with a Python function (`reward_function`) called as trl calls one:
    `fn(prompts=..., completions=..., **columns)`, each output checked (`fitrl.reward.functions`). It reads the
    text itself (no tokenizer between it and the policy's text) and holds no tensors."""

    tokenizer = None
    rendered = False  # a function reads the text a user sees

    def __init__(self, args: RewardArguments) -> None:
        self.function = Checked(args.reward_function, resolve(args.reward_function, "reward_function"))
        self.function.check(args.reward_columns, "reward_function")

    def score(
        self, queries: Sequence[str], responses: Sequence[str], columns: Mapping[str, Sequence[Any]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(scores, called positive: above 0); a None score (the function abstains) counts as 0."""
        ids = columns.get("completion_ids", [[] for _ in responses])
        data = {k: v for k, v in columns.items() if k != "completion_ids"}
        values = self.function(list(responses), **trl_keywords(list(queries), list(ids)), **data)
        scores = torch.tensor([0.0 if v is None else float(v) for v in values])
        return scores, scores > 0

    def tensors(self) -> list[torch.Tensor]:
        return []
