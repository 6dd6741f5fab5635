"""Reward functions by name (`fitrl.reward.functions`): the registry, your own module or file, and the
check on what each returns. GRPO running a user's reward file end to end is in tests/test_gsm8k.py."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from fitrl.config import RunFailed, UsageError
from fitrl.reward.functions import Checked, format_only, resolve, reward_functions
from fitrl.tasks.grading import accuracy_reward

USER_REWARDS = """
def brevity(completions, completion_ids, **kwargs):
    return [-len(ids) / 10 for ids in completion_ids]

NOT_A_FUNCTION = 3
"""


def test_registry_names_modules_and_files_resolve(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_rewards.py").write_text(USER_REWARDS)
    monkeypatch.chdir(tmp_path)  # `accelerate launch scripts/x.py` has scripts/ on the path, not the cwd
    assert resolve("accuracy") is accuracy_reward
    assert resolve("my_rewards:brevity")(completions=["a"], completion_ids=[[1, 2]]) == [-0.2]
    assert resolve("my_rewards.brevity").__name__ == "brevity"
    assert resolve(f"{tmp_path / 'my_rewards.py'}:brevity")(completions=["a"], completion_ids=[[1]]) == [-0.1]
    assert format_only(["strict_format", "soft_format"]) and not format_only(["soft_format", "my_rewards:brevity"])


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("accurcy", "unknown reward 'accurcy'; give a registry name (strict_format, soft_format, accuracy)"),
        ("my_rewards:missing", "my_rewards has no function 'missing'"),
        ("my_rewards:NOT_A_FUNCTION", "my_rewards has no function 'NOT_A_FUNCTION'"),
        ("no_such_module:f", "cannot import no_such_module: ModuleNotFoundError"),
        ("broken:f", "cannot import broken: ZeroDivisionError: division by zero"),
        ("nowhere.py:f", "file nowhere.py does not exist"),
    ],
)
def test_a_reward_that_does_not_resolve_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, message: str
) -> None:
    (tmp_path / "my_rewards.py").write_text(USER_REWARDS)
    (tmp_path / "broken.py").write_text("1 / 0\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match="reward_funcs: ") as info:
        resolve(name)
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("returned", "message"),
    [
        ([1.0], "returned 1 values for 2 completions"),
        ((1.0, math.inf), r"returned a non-finite value \(inf\)"),
        ([1.0, "high"], r"returned a str \('high'\)"),
        (0.5, "returned a float, not a list"),
    ],
)
def test_a_reward_that_returns_anything_but_a_number_per_completion_stops_the_run(returned, message) -> None:
    checked = Checked("mine", lambda completions, **kw: returned)
    with pytest.raises(RunFailed, match=f"reward function 'mine' {message}; it must return one number"):
        checked(["a", "b"])


def test_none_is_allowed_and_the_first_function_shows_each_batch_to_the_monitors() -> None:
    seen = []
    funcs = reward_functions(["accuracy", "soft_format"], observe=lambda ids, log: seen.append((ids, log)))
    log = object()
    kwargs = {"completion_ids": [[1], [2]], "log_metric": log, "gold": ["4", "5"]}
    assert funcs[0](["<answer>\n4\n</answer>", "x"], **kwargs) == [2.0, 0.0]
    assert funcs[1](["x", "y"], **kwargs) == [0.0, 0.0]
    assert seen == [([[1], [2]], log)]  # once per batch: through the first function only
    assert [f.__name__ for f in funcs] == ["accuracy_reward", "soft_format_reward"]  # trl's metric names
    assert Checked("n", lambda completions, **kw: [None, 1])(["a", "b"]) == [None, 1]


def test_a_function_that_cannot_be_called_as_trl_calls_it_is_one_line_naming_its_parameter(
    tmp_path: Path,
) -> None:
    """trl calls a reward with prompts, completions, completion_ids (and its hooks) and the data's columns
    as keywords: a required parameter that is none of those fails before anything loads."""
    from fitrl.reward.functions import check_call

    def needs_solution(completions, solution):  # noqa: ANN001, ANN202
        return [0.0] * len(completions)

    with pytest.raises(UsageError, match=r"reward_funcs: reward 'mine' takes 'solution', which is not passed"):
        check_call("mine", needs_solution, ["question", "answer"], "reward_funcs")
    check_call("mine", needs_solution, ["question", "solution"], "reward_funcs")  # a column of that name
    (tmp_path / "my_rewards.py").write_text(USER_REWARDS)
    brevity = resolve(f"{tmp_path / 'my_rewards.py'}:brevity")
    check_call("brevity", brevity, [], "reward_function")  # completion_ids is one of trl's keywords
    check_call("accuracy", accuracy_reward, [], "reward_funcs")  # gold has a default: PPO hands `answer`


def test_ppo_calls_a_reward_function_as_grpo_does(tmp_path: Path) -> None:
    """The documented GRPO reward works unchanged in PPO: the responses as completions, the queries as
    prompts, each response's token ids, and the prompts' `reward_columns`."""
    from fitrl.reward.functions import FunctionReward
    from fitrl.reward.settings import RewardArguments

    (tmp_path / "my_rewards.py").write_text(USER_REWARDS)
    reward = FunctionReward(RewardArguments(reward_function=f"{tmp_path / 'my_rewards.py'}:brevity"))
    scores, positive = reward.score(["Q1 ", "Q2 "], ["a b", "c"], {"completion_ids": [[1, 2, 3], [4]]})
    assert scores.tolist() == pytest.approx([-0.3, -0.1]) and not positive.any()
    graded = FunctionReward(RewardArguments(reward_function="accuracy"))
    done = "<reasoning>\n2 + 2 = 4\n</reasoning>\n<answer>\n4\n</answer>"
    scores, _ = graded.score(
        ["q", "q"], [done, done], {"answer": ["2 + 2 = 4\n#### 4", "5"], "completion_ids": [[], []]}
    )
    assert scores.tolist() == [2.0, 0.0]  # graded against each prompt's own answer column
