"""The SFT stage: LoRA causal-LM fine-tuning of a frozen (8-bit) base on packed text blocks.

Program: `fitrl.scripts.sft` (trl's `SFTTrainer`). Writes the adapter, the tokenizer, `loss.png`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fitrl.chat import CHAT_TEMPLATE_HELP
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
)
from fitrl.workload import Step, Workload


@dataclass
class SFTArguments(TrainerSettings):
    """Data and training settings of the SFT stage."""

    output_dir: str = help_field("outputs/sft", "Where the adapter, tokenizer, config, metrics and plot go.")
    per_device_train_batch_size: int = help_field(4, "Blocks per device per forward pass.")
    dataset: str = help_field(
        "stanfordnlp/imdb", "Hub dataset id, a local .jsonl/.csv/.parquet file or directory, or demo://reviews."
    )
    dataset_split: str = help_field("train", "Split to train on.")
    text_column: str = help_field(
        "text",
        "Column holding each example: a text, or a chat (a list of role/content messages, e.g. 'messages') that "
        "trl renders with the chat template.",
    )
    chat_template: str | None = help_field(None, CHAT_TEMPLATE_HELP)
    max_samples: int | None = help_field(None, "Use at most this many examples (all when empty).")
    block_size: int = help_field(512, "Tokens per packed training block: reviews are concatenated and cut.")

    def validate(self) -> None:
        super().validate()
        check(self.block_size >= 8, "block_size", "an integer >= 8")
        check(self.max_samples is None or self.max_samples >= 1, "max_samples", "empty or >= 1")


CONFIG_TYPES = (ModelArguments, LoraArguments, SFTArguments, DemoArguments)


def workload(configs: Configs, model_type: str, on_gpu: bool, world_size: int) -> Workload:
    args = config_of(configs, SFTArguments)
    return lora_workload(
        "sft",
        Step.NEXT_TOKEN,
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
    module="fitrl.scripts.sft",
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
