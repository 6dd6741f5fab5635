"""The eval stage: the PPO policy against its reference on held-out prompts (reward, judge, KL, win rate).

Program: `fitrl.scripts.eval`. Reads the PPO run's settings (its `run_config.yaml`) as
defaults, so it answers prompts the way the policy was trained to. Writes `eval.json`, `eval.md`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fitrl.artifacts import SentimentEval, carved_note
from fitrl.config import check, help_field, load_run_config, parse_config
from fitrl.data import HELDOUT_SPLIT
from fitrl.demo import DemoArguments
from fitrl.modeling import ModelArguments
from fitrl.reward.settings import RewardArguments
from fitrl.stages.base import Stage, config_of, field_names
from fitrl.tasks.sentiment import PromptArguments


@dataclass
class SentimentEvalArguments:
    """What to evaluate and where the report goes."""

    adapter_dir: str = help_field(
        "outputs/ppo", "The PPO (or DPO) stage's output directory: the policy adapter; or a PPO checkpoint (step-N)."
    )
    output_dir: str = help_field("outputs/eval", "Where eval.json, eval.md and reward_hist.png go.")
    overwrite_output_dir: bool = help_field(False, "Replace a non-empty output_dir.")
    n_prompts: int = help_field(128, "Held-out prompts to answer.")
    batch_size: int = help_field(32, "Prompts per generation batch.")
    n_samples_shown: int = help_field(6, "Side-by-side samples in eval.md.")
    seed: int = help_field(1234, "Seed of the query lengths, response lengths and sampling.")
    force: bool = help_field(False, "Evaluate even if the adapter says it was trained on another model or stage.")
    judge_model: str | None = help_field(
        None,
        "A second sentiment judge the policy never trained against, reported beside the reward: a sequence "
        "classifier (hub id or local dir) or demo://lexicon (the demo corpus's own rule reader). Empty: none.",
    )
    judge_positive_label: str = help_field("POSITIVE", "The judge classifier's positive label.")

    def validate(self) -> None:
        check(self.n_prompts >= 1, "n_prompts", ">= 1")
        check(self.batch_size >= 1, "batch_size", ">= 1")
        check(self.n_samples_shown >= 0, "n_samples_shown", ">= 0")
        check(self.seed >= 0, "seed", ">= 0")


CONFIG_TYPES = (ModelArguments, PromptArguments, RewardArguments, SentimentEvalArguments, DemoArguments)


def ppo_settings(argv: list[str]) -> dict:
    """The model, prompt and reward settings the policy's run wrote to its `run_config.yaml`.

    The evaluation answers prompts the way the policy was trained to, unless the config or a flag
    says otherwise; only the split (held-out prompts: `test`, unless set) and the number of prompts are
    its own. A DPO run has no prompt or reward settings (its `dataset` holds pairs): only its model
    settings are taken.
    """
    eval_args = config_of(parse_config(CONFIG_TYPES, argv), SentimentEvalArguments)
    trained = load_run_config(Path(eval_args.adapter_dir).expanduser())
    inherited = field_names(ModelArguments)
    if "reward_model" in trained:  # a PPO run
        inherited |= field_names(PromptArguments, RewardArguments) - {"dataset_split", "max_prompts"}
    return {"dataset_split": HELDOUT_SPLIT} | {k: v for k, v in trained.items() if k in inherited}


def figures(out: Path) -> list[str]:
    e = SentimentEval.read(out)
    if e is None:
        return []
    r, p = e.reference, e.policy
    found = [
        f"held-out reward {r.mean:.2f} (reference) -> {p.mean:.2f} (policy) on {e.n_prompts} prompts"
        + carved_note(e.split, e.carved_from),
        f"KL {e.kl_mean:.2f} nats, win rate {e.win_rate:.0%}",
        f"called positive by the reward model {r.positive_share:.0%} -> {p.positive_share:.0%}",
        f"corpus words in responses {r.corpus_word_share:.1%} -> {p.corpus_word_share:.1%}",
    ]
    if e.judge is not None:
        found.append(f"positive by the judge ({e.judge.model}) {e.judge.reference:.0%} -> {e.judge.policy:.0%}")
    return found


def side_by_side(out: Path) -> dict[str, str]:
    """The figures that say which policy moved the judge more, at what KL."""
    e = SentimentEval.read(out)
    if e is None:
        return {}
    cells = {}
    if e.judge is not None:
        cells[f"judge ({e.judge.model}): positive"] = f"{e.judge.reference:.0%} -> {e.judge.policy:.0%}"
    cells["reward model: positive"] = f"{e.reference.positive_share:.0%} -> {e.policy.positive_share:.0%}"
    cells["corpus words"] = f"{e.policy.corpus_word_share:.1%}"
    cells["KL (nats)"] = f"{e.kl_mean:.2f}"
    cells["win rate"] = f"{e.win_rate:.0%}"
    return cells


STAGE = Stage(
    name="eval",
    judges=("ppo", "dpo"),
    module="fitrl.scripts.eval",
    config_types=CONFIG_TYPES,
    output_dir="eval",
    figures=figures,
    reads=("adapter_dir", "ppo"),
    reads_if_set=(("reward_adapter", "rm"),),  # eval_dpo's config names the rm run's reward model
    plot="reward_hist.png",
    samples="eval.md",
    inherited=ppo_settings,
    side_by_side=side_by_side,
)
