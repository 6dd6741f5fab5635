"""The SFT stage: LoRA causal-LM fine-tuning of a frozen (8-bit) base on packed text blocks.

Script: `scripts/sft_lora.py` (trl's `SFTTrainer`). Writes the adapter, the tokenizer, `loss.png`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from fitrl.config import check, check_tracker, help_field
from fitrl.demo import DemoArguments
from fitrl.modeling import LoraArguments, ModelArguments
from fitrl.stages.base import (
    Configs,
    Moves,
    Stage,
    StageMemory,
    config_of,
    halve_micro_batch,
    lora_workload,
    metrics_rows,
    series,
)
from fitrl.workload import Workload


@dataclass
class SFTArguments:
    """Data and training settings of the SFT stage."""

    dataset: str = help_field(
        "stanfordnlp/imdb", "Hub dataset id, a local .jsonl/.csv/.parquet file or directory, or demo://reviews."
    )
    dataset_split: str = help_field("train", "Split to train on.")
    text_column: str = help_field("text", "Column holding the review text.")
    max_samples: int | None = help_field(None, "Use at most this many reviews (all when empty).")
    block_size: int = help_field(512, "Tokens per packed training block: reviews are concatenated and cut.")
    output_dir: str = help_field("outputs/sft", "Where the adapter, tokenizer, config, metrics and plot go.")
    overwrite_output_dir: bool = help_field(False, "Replace a non-empty output_dir.")
    learning_rate: float = help_field(2e-4, "Peak learning rate of the LoRA weights.")
    num_train_epochs: float = help_field(1.0, "Passes over the data (ignored when max_steps > 0).")
    max_steps: int = help_field(-1, "Stop after this many optimizer steps (-1: run num_train_epochs).")
    per_device_train_batch_size: int = help_field(4, "Blocks per device per forward pass.")
    gradient_accumulation_steps: int = help_field(1, "Forward passes summed into one optimizer step.")
    gradient_checkpointing: bool = help_field(True, "Recompute activations in backward: far less memory, ~30% slower.")
    optim: Literal["adamw_torch", "adamw_bnb_8bit", "paged_adamw_8bit", "paged_adamw_32bit", "adafactor"] = help_field(
        "adamw_torch", "Optimizer; the 8-bit ones keep Adam's state in 8 bits (bitsandbytes)."
    )
    lr_scheduler_type: Literal["linear", "cosine", "constant", "constant_with_warmup"] = help_field(
        "linear", "Learning-rate schedule."
    )
    warmup_ratio: float = help_field(0.0, "Fraction of the steps spent warming the learning rate up.")
    weight_decay: float = help_field(0.0, "AdamW weight decay.")
    max_grad_norm: float = help_field(1.0, "Clip the gradient norm to this (0 disables clipping).")
    logging_steps: int = help_field(10, "Log (metrics.jsonl, progress bar) every this many steps.")
    save_steps: int = help_field(0, "Save a resumable checkpoint every this many steps (0: none).")
    resume_from_checkpoint: str | None = help_field(None, "A checkpoint directory, or 'latest', to continue from.")
    report_to: Literal["none", "tensorboard", "wandb"] = help_field("none", "Extra tracker for the training log.")
    seed: int = help_field(42, "Random seed (LoRA init, data order, dropout).")

    def validate(self) -> None:
        check_tracker(self.report_to)
        check(self.learning_rate > 0, "learning_rate", "> 0")
        check(self.block_size >= 8, "block_size", "an integer >= 8")
        check(self.per_device_train_batch_size >= 1, "per_device_train_batch_size", ">= 1")
        check(self.gradient_accumulation_steps >= 1, "gradient_accumulation_steps", ">= 1")
        check(self.max_steps == -1 or self.max_steps >= 1, "max_steps", "-1 or >= 1")
        check(self.num_train_epochs > 0, "num_train_epochs", "> 0")
        check(self.max_samples is None or self.max_samples >= 1, "max_samples", "empty or >= 1")
        check(self.logging_steps >= 1, "logging_steps", ">= 1")
        check(self.save_steps >= 0, "save_steps", ">= 0")
        check(0 <= self.warmup_ratio < 1, "warmup_ratio", "in [0, 1)")
        check(self.max_grad_norm >= 0, "max_grad_norm", ">= 0")
        check(self.weight_decay >= 0, "weight_decay", ">= 0")
        check(self.seed >= 0, "seed", ">= 0")


CONFIG_TYPES = (ModelArguments, LoraArguments, SFTArguments, DemoArguments)


def workload(configs: Configs, model_type: str, on_gpu: bool, world_size: int) -> Workload:
    args = config_of(configs, SFTArguments)
    return lora_workload(
        "sft",
        configs,
        model_type,
        on_gpu,
        args.gradient_checkpointing,
        optimizer=args.optim,
        micro_batch=args.per_device_train_batch_size,
        completion_len=args.block_size,
    )


def batch_moves(configs: Configs) -> Moves:
    args = config_of(configs, SFTArguments)
    return halve_micro_batch(args.per_device_train_batch_size, args.gradient_accumulation_steps)


def shape_moves(configs: Configs) -> Moves:
    args = config_of(configs, SFTArguments)
    return [("block size", {"block_size": args.block_size // 2})] if args.block_size > 64 else []


def figures(out: Path) -> list[str]:
    losses = series(metrics_rows(out), "loss")
    return [f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} logged steps"] if losses else []


STAGE = Stage(
    name="sft",
    script="sft_lora.py",
    config_types=CONFIG_TYPES,
    output_dir="sft",
    figures=figures,
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
)
