"""The DPO stage: a LoRA adapter on a frozen (8-bit) base learns straight from preference pairs, with
the same base and the adapter off as its reference (trl's `DPOTrainer`): no reward model, no sampling.

Program: `fitrl.scripts.dpo`. Writes the adapter, the tokenizer, `eval.json` (held-out implicit-reward
accuracy and margin), `dpo_curves.png`; checkpoints `checkpoint-N` (trl's). Its policy is evaluated
like PPO's by the `eval_dpo` stage, on the same held-out prompts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from fitrl.artifacts import DPOEval, carved_note
from fitrl.config import check, help_field
from fitrl.demo import DemoArguments
from fitrl.modeling import LoraArguments, ModelArguments
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
    start_end,
)
from fitrl.stages.rm import shape_moves
from fitrl.tasks.preferences import PreferenceArguments
from fitrl.workload import Step, Workload


@dataclass
class DPOArguments(TrainerSettings):
    """Training settings of the DPO stage (defaults: trl's, with the LoRA learning rate of its examples)."""

    output_dir: str = help_field("outputs/dpo", "Where the adapter, tokenizer, evaluation, metrics and curves go.")
    learning_rate: float = help_field(5e-5, "Peak learning rate of the LoRA weights.")
    per_device_train_batch_size: int = help_field(4, "Pairs per device per forward pass (two sequences each).")
    beta: float = help_field(0.1, "How far from the reference the policy may move: lower moves further.")
    loss_type: Literal["sigmoid", "ipo", "hinge", "robust"] = help_field(
        "sigmoid", "DPO's loss: 'sigmoid' (the paper's), 'ipo', 'hinge', 'robust' (for noisy labels)."
    )
    sft_weight: float = help_field(
        0.0,
        "Weight of a negative log-likelihood term on the chosen texts beside the DPO loss (RPO): keeps their "
        "likelihood from falling with the rejected ones', which on a small model costs fluency; 0: plain DPO.",
    )
    label_smoothing: float = help_field(
        0.0, "The share of labels assumed wrong (conservative DPO, 'sigmoid' and 'robust' losses); 0: none."
    )
    precompute_ref_log_probs: bool = help_field(
        False,
        "Compute the reference's log-probs for every pair once, before training, instead of a no-grad pass "
        "with the adapter off in every step (less memory per step, one pass over the data first).",
    )

    def validate(self) -> None:
        super().validate()
        check(self.beta > 0, "beta", "> 0")
        check(self.sft_weight >= 0, "sft_weight", ">= 0")
        check(0 <= self.label_smoothing < 0.5, "label_smoothing", "in [0, 0.5)")


CONFIG_TYPES = (ModelArguments, LoraArguments, PreferenceArguments, DPOArguments, DemoArguments)


def workload(configs: Configs, model_type: str, on_gpu: bool, world_size: int) -> Workload:
    args, data = config_of(configs, DPOArguments), config_of(configs, PreferenceArguments)
    return lora_workload(
        "dpo",
        Step.DPO,
        configs,
        model_type,
        on_gpu,
        args.gradient_checkpointing,
        optimizer=args.optim,
        micro_batch=2 * args.per_device_train_batch_size,  # the chosen and the rejected texts, one batch
        completion_len=data.max_length,
        reference_pass=not args.precompute_ref_log_probs,
    )


def batch_moves(configs: Configs) -> Moves:
    args = config_of(configs, DPOArguments)
    # Precomputing the reference's log-probs saves no peak: its pass is no-grad, after the policy's.
    return halve_micro_batch(args.per_device_train_batch_size, args.gradient_accumulation_steps)


def figures(out: Path) -> list[str]:
    found = []
    margins = series(metrics_rows(out), "rewards/margins")
    if margins:
        start, end = start_end(margins)
        found.append(f"training reward margin {start:.3f} -> {end:.3f} over {len(margins)} logged steps")
    e = DPOEval.read(out)
    if e is not None:
        found.append(
            f"held-out pairs: implicit-reward accuracy {e.accuracy:.1%}, margin {e.margin:.3f} "
            f"(0 at the start) on {e.n_pairs} pairs{carved_note(e.split, e.carved_from)}"
        )
    return found


STAGE = Stage(
    name="dpo",
    module="fitrl.scripts.dpo",
    config_types=CONFIG_TYPES,
    output_dir="dpo",
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
    plot="dpo_curves.png",
)
