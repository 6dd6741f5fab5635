"""The one place that decides a reward's kind from its settings: checked before any model loads
(`check_reward`), then loaded (`load_reward`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from fitrl.config import UsageError
from fitrl.modeling import resolve_model_path
from fitrl.reward.adapter import AdapterReward, SeparateAdapterReward, separate_base
from fitrl.reward.base import Reward
from fitrl.reward.classifier import ClassifierReward, check_reward_label
from fitrl.reward.functions import FunctionReward
from fitrl.reward.settings import RewardArguments


def check_reward(
    args: RewardArguments, model_name: str, model_path: str, demo_assets: str, stage: str, producer: str
) -> str | None:
    """The reward of `stage`, checked before any model loads: a trained classifier with the positive label,
    an adapter of the `producer` stage whose base can be loaded (the policy's own, or another), or a
    function that imports. Returns the base that adapter is loaded on by itself (`separate_base`), else
    None."""
    if args.reward_function:
        FunctionReward(args)
        return None
    if not args.reward_adapter:
        reward_path = resolve_model_path(args.reward_model, demo_assets, what="reward model")
        check_reward_label(reward_path, args.positive_label, args.reward_kind)
        return None
    if not Path(args.reward_adapter).expanduser().is_dir():
        raise UsageError(f"reward_adapter {args.reward_adapter} does not exist; give the output_dir of an rm run")
    shared = args.reward_adapter_shared
    return separate_base(args.reward_adapter, model_name, model_path, demo_assets, shared, stage, producer)


def load_reward(
    args: RewardArguments,
    demo_assets: str,
    device: torch.device,
    reward_base: str | None = None,
    policy: Any = None,
    tokenizer: Any = None,
) -> Reward | None:
    """The reward `args` name, its kind decided here once: a function, a sequence classifier, an rm
    stage's adapter on its own copy of `reward_base` (`check_reward` says which base), or one on the
    policy's own backbone, which needs the `policy` (a peft model) and its `tokenizer`: None until given."""
    if args.reward_function:
        return FunctionReward(args)
    if not args.reward_adapter:
        return ClassifierReward(args, demo_assets, device)
    if reward_base is not None:
        return SeparateAdapterReward(reward_base, args, device)
    if policy is None:
        return None
    return AdapterReward(policy, args.reward_adapter, tokenizer, args.reward_batch_size)
