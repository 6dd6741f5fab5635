"""The settings that name a reward: a classifier, an rm stage's adapter or a function (`fitrl.reward.factory`
decides which)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fitrl.config import UsageError, check, help_field


@dataclass
class RewardArguments:
    """The reward: a text classifier's opinion of query + response."""

    reward_model: str = help_field(
        "lvwerra/distilbert-imdb", "Sequence classifier (hub id, local dir, demo://classifier) scoring the text."
    )
    positive_label: str = help_field("POSITIVE", "The classifier's label whose score is the reward.")
    reward_kind: Literal["logit", "probability", "margin"] = help_field(
        "logit", "Score: the positive logit (the blog), its softmax probability, or its margin over the best other."
    )
    reward_batch_size: int = help_field(16, "Texts per classifier forward pass.")
    reward_dtype: Literal["float32", "bfloat16", "float16"] = help_field(
        "float32", "The reward model's dtype: bfloat16 / float16 halve its memory (the planner counts it)."
    )
    reward_quantization: Literal["none", "8bit", "4bit"] = help_field(
        "none",
        "Load the reward model's linear layers in 8-bit or 4-bit (bitsandbytes), its classification head in "
        "reward_dtype: a 7B reward model beside a policy on one card.",
    )
    reward_adapter: str | None = help_field(
        None,
        "An rm stage's output (its LoRA adapter and score head) to score with instead of reward_model. Trained "
        "on model_name_or_path, it runs on the policy's own backbone (no second model); trained on another "
        "model, it is loaded on its own copy of that model (the planner counts it).",
    )
    reward_adapter_shared: bool = help_field(
        True,
        "false: load reward_adapter on its own copy of its base even when that is the policy's (costs that base's "
        "memory again: for comparison).",
    )
    reward_function: str | None = help_field(
        None,
        "A Python function to score with instead of a model: a registry name (accuracy, ...), module:function or "
        "path/to/file.py:function, called as trl calls a reward function: fn(prompts=queries, "
        "completions=responses, **columns of reward_columns), one number per response (positive: above 0; "
        "fitrl.reward.functions). A GRPO reward function works unchanged.",
    )

    reward_columns: list[str] = help_field(
        [],
        "Columns of the prompt dataset handed to reward_function beside each prompt, by name, as trl hands a "
        "dataset's columns to a reward function (e.g. [answer] for the accuracy reward).",
    )

    def validate(self) -> None:
        check(self.reward_batch_size >= 1, "reward_batch_size", ">= 1")
        if self.reward_function and self.reward_adapter:
            raise UsageError("give reward_function or reward_adapter, not both: each replaces reward_model")
