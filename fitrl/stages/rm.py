"""The reward-model stage: a LoRA adapter and a scalar score head on a frozen (8-bit) base learn to rank
preference pairs (Bradley-Terry, trl's `RewardTrainer`).

Program: `fitrl.scripts.rm`. Writes the adapter with its score head (peft's `modules_to_save`),
the tokenizer, `eval.json` (held-out pair accuracy, margins), `rewards_hist.png`, `calibration.png`, `loss.png`;
checkpoints `checkpoint-N` (trl's). PPO can score with it on its own backbone (`reward_adapter`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fitrl.artifacts import RMEval, RunInfo, carved_note
from fitrl.config import check, help_field
from fitrl.demo import DemoArguments
from fitrl.modeling import LoraArguments, ModelArguments
from fitrl.reward import probes
from fitrl.stages.base import (
    Configs,
    Moves,
    Stage,
    StageMemory,
    TrainerSettings,
    config_of,
    halve_micro_batch,
    lora_workload,
    metrics_rows,
    series,
)
from fitrl.tasks.preferences import PreferenceArguments
from fitrl.workload import Step, Workload


@dataclass
class RMArguments(TrainerSettings):
    """Training settings of the reward-model stage."""

    output_dir: str = help_field("outputs/rm", "Where the adapter, score head, tokenizer, evaluation and plots go.")
    learning_rate: float = help_field(1e-4, "Peak learning rate of the LoRA weights and the score head.")
    per_device_train_batch_size: int = help_field(4, "Pairs per device per forward pass (two sequences each).")
    center_rewards_coefficient: float | None = help_field(
        0.01, "Pull the mean reward towards 0 (trl's auxiliary loss; empty: off): PPO then sees centred scores."
    )
    eval_batch_size: int = help_field(16, "Held-out pairs scored at once in the evaluation.")

    def validate(self) -> None:
        super().validate()
        check(
            self.center_rewards_coefficient is None or self.center_rewards_coefficient >= 0,
            "center_rewards_coefficient",
            "empty or >= 0",
        )
        check(self.eval_batch_size >= 1, "eval_batch_size", ">= 1")


CONFIG_TYPES = (ModelArguments, LoraArguments, PreferenceArguments, RMArguments, DemoArguments)


def workload(configs: Configs, model_type: str, on_gpu: bool, world_size: int) -> Workload:
    args, data = config_of(configs, RMArguments), config_of(configs, PreferenceArguments)
    return lora_workload(
        "rm",
        Step.PAIRWISE_SCORE,
        configs,
        model_type,
        on_gpu,
        args.gradient_checkpointing,
        optimizer=args.optim,
        micro_batch=2 * args.per_device_train_batch_size,  # the chosen and the rejected texts, one batch
        completion_len=data.max_length,
    )


def batch_moves(configs: Configs) -> Moves:
    args = config_of(configs, RMArguments)
    return halve_micro_batch(args.per_device_train_batch_size, args.gradient_accumulation_steps)


def shape_moves(configs: Configs) -> Moves:
    """Shorter pairs (the rm and dpo stages' shape)."""
    data = config_of(configs, PreferenceArguments)
    return [("pair length", {"max_length": data.max_length // 2})] if data.max_length > 128 else []


def figures(out: Path) -> list[str]:
    found = []
    losses = series(metrics_rows(out), "loss")
    if losses:
        found.append(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} logged steps")
    e = RMEval.read(out)
    if e is not None:
        found.append(
            f"held-out pair accuracy {e.accuracy:.1%} on {e.n_pairs} pairs{carved_note(e.split, e.carved_from)}, "
            f"mean margin {e.margin_mean:.2f}"
        )
    info = RunInfo.read(out)
    return found + (probes.figures(info.details) if info is not None else [])


# How to score as fitrl scores (`fitrl.reward.adapter.score_texts`) outside fitrl: the tokenizer's pad
# token for batches, and EOS appended to every text, as the stage trained on them.
CARD_SNIPPET = """import torch
from peft import PeftModel
from transformers import AutoModelForSequenceClassification, AutoTokenizer

adapter = "<this folder or its hub id>"
tokenizer = AutoTokenizer.from_pretrained(adapter)  # with the pad token the stage batched with
base = AutoModelForSequenceClassification.from_pretrained(
    "{base}", num_labels=1, pad_token_id=tokenizer.pad_token_id
)
model = PeftModel.from_pretrained(base, adapter).eval()

# fitrl scores a text as this stage trained on it: EOS appended, right-padded, the head at the last token
texts = ["The acting was superb.", "The plot was dull."]
eos = tokenizer.eos_token
batch = tokenizer([t if t.endswith(eos) else t + eos for t in texts], padding=True, padding_side="right",
                  return_tensors="pt")
with torch.no_grad():
    rewards = model(**batch).logits[:, 0]"""


STAGE = Stage(
    name="rm",
    card_model_class="AutoModelForSequenceClassification",
    card_model_kwargs=", num_labels=1",
    card_snippet=CARD_SNIPPET,
    module="fitrl.scripts.rm",
    config_types=CONFIG_TYPES,
    output_dir="rm",
    figures=figures,
    reads=("model_name_or_path", "merge"),
    training=True,
    checkpoint_prefix="checkpoint",
    memory=StageMemory(
        workload=workload,
        optimizer_key="optim",
        eight_bit_optimizer="adamw_bnb_8bit",
        batch_moves=batch_moves,
        shape_moves=shape_moves,
    ),
    plot="loss.png",
    more_plots=("rewards_hist.png", "calibration.png"),
)
