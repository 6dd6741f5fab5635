"""What a stage is, in one record: `Stage`, and the pieces its modules share.

A stage module (`fitrl/stages/<stage>.py`) holds its argument dataclasses and one `STAGE` that says
where its output goes in a run directory, which stage's output it reads, how it is launched, what
it checkpoints, what memory one of its steps needs (`StageMemory`) and which figures, plot and
samples the report shows. The pipeline, the planner, the report, the tests and the benches read
these records, never a stage's name.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from fitrl.config import check, check_tracker, config_of, help_field, parse_config
from fitrl.hub import HubSettings
from fitrl.modeling import DEFAULT_LORA_TARGETS, LoraArguments, ModelArguments
from fitrl.outputs import METRICS_NAME, read_jsonl
from fitrl.workload import Step, Workload

# The one help text of every training stage's `strict_guards`.
STRICT_GUARDS_HELP = (
    "Stop the run (exit 1) when a guard fires instead of warning once (fitrl.guards: tensors without "
    "gradients, a constant reward, a policy unlike its reference at step 0)."
)
Configs = tuple[Any, ...]  # a stage's config dataclasses, filled, in the order of its `config_types`
Moves = list[tuple[str, dict[str, Any]]]  # named changes of settings, in the stage's own flag names


@dataclass(frozen=True)
class StageMemory:
    """What the planner needs of a training stage: its step as a `Workload`, and what saves memory.

    `workload(configs, model_type, on_gpu, world_size)`; `batch_moves(configs)` and
    `shape_moves(configs)`: one-step changes of the stage's own batches and shapes that save memory,
    in its flag names, cheapest first. `fitrl.planner` puts them among the moves every stage shares
    (checkpointing, the optimizer, then the batch moves, quantization, the shape moves, LoRA targets).
    """

    workload: Callable[[Configs, str, bool, int], Workload]
    optimizer_key: str  # the flag naming the optimizer
    eight_bit_optimizer: str  # its 8-bit choice the planner suggests
    batch_moves: Callable[[Configs], Moves]
    shape_moves: Callable[[Configs], Moves] = lambda configs: []
    reward_model: Callable[[Configs], RewardModel | None] = lambda configs: None  # a second model loaded beside


@dataclass(frozen=True)
class RewardModel:
    """A model a stage loads beside the one it trains (PPO's reward classifier): what it costs depends on
    its precision as loaded."""

    name: str
    dtype: str = "float32"
    quantization: str = "none"  # "none" | "8bit" | "4bit"


@dataclass(frozen=True)
class Stage:
    """One stage of the recipe: its settings, its place in the pipeline, its memory, its report."""

    name: str
    module: str  # its program, run as `python -m <module>` (`scripts/<stage>.py` is a thin entry to it)
    config_types: tuple[type, ...]
    output_dir: str  # its directory inside a run directory
    figures: Callable[[Path], list[str]]  # its key results, read back from its output directory
    reads: tuple[str, str] | None = None  # (the setting naming its input, the stage whose output that is)
    # Inputs taken from another stage's output only where the stage's config sets the setting (PPO's
    # reward_adapter from rm): (setting, stage) pairs.
    reads_if_set: tuple[tuple[str, str], ...] = ()
    training: bool = False  # launched through accelerate; else one process of file work
    checkpoint_prefix: str | None = None  # resumable: `<output_dir>.checkpoints/<prefix>-N`
    memory: StageMemory | None = None  # plannable
    plot: str | None = None
    more_plots: tuple[str, ...] = ()  # further figures the report shows when the stage wrote them
    samples: str | None = None  # a markdown file the report shows
    # Defaults under the config file and the flags: what the stage before wrote (its run_config.yaml),
    # an evaluation's held-out split.
    inherited: Callable[[list[str]], dict[str, Any]] | None = None
    # An evaluation several stages run on different policies (PPO's, DPO's): its headline figures as
    # table cells, which the report sets side by side, a row per policy.
    side_by_side: Callable[[Path], dict[str, str]] | None = None
    writes_full_model: bool = False  # a whole model, the size of its base (the merge): the doctor counts its disk
    judges: tuple[str, ...] = ()  # an evaluation: the stages whose policy adapters it takes (`reads`' first)
    # The model card's loading snippet (`fitrl.ending.model_card`): the class the base loads as, the
    # arguments it takes beyond the base, and what else the output holds; or the whole snippet, a
    # template of `{base}` (`card_snippet`).
    card_model_class: str = "AutoModelForCausalLM"
    card_model_kwargs: str = ""
    card_notes: tuple[str, ...] = ()
    card_snippet: str = ""

    def producer_of(self, setting: str) -> str | None:
        """The stage whose output `setting` names (`reads`, `reads_if_set`), or None."""
        return dict([*([self.reads] if self.reads else []), *self.reads_if_set]).get(setting)

    def parse(self, argv: Sequence[str] | None = None) -> Configs:
        """The stage's settings from `--config` and flags, exactly as its program reads them."""
        argv = list(sys.argv[1:] if argv is None else argv)
        defaults = self.inherited(argv) if self.inherited else None
        return parse_config(self.config_types, argv, defaults)


# --- pieces the stage modules share ---------------------------------------------------------------


@dataclass
class TrainerSettings(HubSettings):
    """The settings of a stage that trains on transformers' Trainer (trl's SFT, Reward and DPO trainers);
    `fitrl.hf_trainer.trainer_arguments` maps them onto `TrainingArguments`. A stage subclasses it with
    its data settings and its own defaults (a field redeclared keeps its place)."""

    output_dir: str = help_field("outputs/stage", "Where the adapter, tokenizer, config, metrics and plots go.")
    overwrite_output_dir: bool = help_field(False, "Replace a non-empty output_dir.")
    learning_rate: float = help_field(2e-4, "Peak learning rate of the LoRA weights.")
    num_train_epochs: float = help_field(1.0, "Passes over the data (ignored when max_steps > 0).")
    max_steps: int = help_field(-1, "Stop after this many optimizer steps (-1: run num_train_epochs).")
    per_device_train_batch_size: int = help_field(4, "Examples per device per forward pass.")
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
    strict_guards: bool = help_field(False, STRICT_GUARDS_HELP)

    def validate(self) -> None:
        super().validate()
        check_tracker(self.report_to)
        check(self.learning_rate > 0, "learning_rate", "> 0")
        check(self.per_device_train_batch_size >= 1, "per_device_train_batch_size", ">= 1")
        check(self.gradient_accumulation_steps >= 1, "gradient_accumulation_steps", ">= 1")
        check(self.max_steps == -1 or self.max_steps >= 1, "max_steps", "-1 or >= 1")
        check(self.num_train_epochs > 0, "num_train_epochs", "> 0")
        check(self.logging_steps >= 1, "logging_steps", ">= 1")
        check(self.save_steps >= 0, "save_steps", ">= 0")
        check(0 <= self.warmup_ratio < 1, "warmup_ratio", "in [0, 1)")
        check(self.max_grad_norm >= 0, "max_grad_norm", ">= 0")
        check(self.weight_decay >= 0, "weight_decay", ">= 0")
        check(self.seed >= 0, "seed", ">= 0")


def compute_dtype(model_args: ModelArguments, on_gpu: bool) -> str:
    if model_args.dtype == "auto":
        return "bfloat16" if on_gpu else "float32"
    return model_args.dtype


def lora_workload(
    stage: str,
    step: Step,
    configs: Configs,
    model_type: str,
    on_gpu: bool,
    gradient_checkpointing: bool,
    default_targets: dict[str, list[str]] = DEFAULT_LORA_TARGETS,
    **shapes: Any,
) -> Workload:
    """The `Workload` of a LoRA stage: the base and adapter from its model and LoRA configs, `shapes` its own."""
    model_args, lora_args = config_of(configs, ModelArguments), config_of(configs, LoraArguments)
    targets = lora_args.lora_target_modules or default_targets.get(model_type, ["all-linear"])
    return Workload(
        stage=stage,
        step=step,
        quantization=model_args.quantization,
        dtype=compute_dtype(model_args, on_gpu),
        lora_r=lora_args.lora_r,
        lora_targets=tuple(targets),
        gradient_checkpointing=gradient_checkpointing,
        int8_keeps_input=on_gpu,
        **shapes,
    )


def halve_micro_batch(micro_batch: int, accumulation: int) -> Moves:
    """Half the sequences per pass, twice the passes: the same effective batch (trl's trainers' flags)."""
    if micro_batch <= 1:
        return []
    return [
        (
            "micro-batch",
            {"per_device_train_batch_size": micro_batch // 2, "gradient_accumulation_steps": accumulation * 2},
        )
    ]


def metrics_rows(out: Path) -> list[dict[str, Any]]:
    path = out / METRICS_NAME
    return read_jsonl(path) if path.is_file() else []


def series(rows: list[dict[str, Any]], key: str) -> list[float]:
    return [r[key] for r in rows if isinstance(r.get(key), (int, float))]


def start_end(values: list[float], span: int = 5) -> tuple[float, float]:
    """Mean of the first and of the last `span` points: the trend, not one noisy step."""
    span = max(1, min(span, len(values) // 4 or 1))
    return sum(values[:span]) / span, sum(values[-span:]) / span


def field_names(*types: type) -> set[str]:
    return {f.name for t in types for f in dataclasses.fields(t)}
