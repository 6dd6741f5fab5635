"""The GRPO stage: a LoRA adapter learns GSM8K's answer format and arithmetic from group-relative rewards.

Program: `fitrl.scripts.grpo` (trl's `GRPOTrainer`, fitrl's rewards and prompts). Writes the
adapter, `grpo_curves.png`, `samples.md`; checkpoints `checkpoint-N` (trl's).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from fitrl.artifacts import RunInfo
from fitrl.config import UsageError, check, help_field
from fitrl.demo import DemoArguments
from fitrl.guards import Limit
from fitrl.modeling import GRPO_LORA_TARGETS, LoraArguments, ModelArguments
from fitrl.reward import audit, probes
from fitrl.reward.functions import DEFAULT_REWARDS
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
from fitrl.tasks.gsm8k import GSM8KDataArguments
from fitrl.workload import Step, Workload

REPETITION_KEY = "completions/repetition"  # logged by the first reward function (fitrl.scripts.grpo)


@dataclass
class GRPOArguments(TrainerSettings):
    """Training settings of the GRPO stage: the trainer settings every trl stage shares, with the
    Llama-1B blog's defaults, and GRPO's own."""

    output_dir: str = help_field("outputs/grpo", "Where the adapter, config, metrics, curves and samples go.")
    learning_rate: float = help_field(5e-6, "Peak learning rate of the LoRA weights.")
    per_device_train_batch_size: int = help_field(4, "Completions per device per forward/backward pass.")
    optim: Literal["adamw_torch", "adamw_bnb_8bit", "paged_adamw_8bit", "paged_adamw_32bit", "adafactor"] = help_field(
        "adamw_torch", "Optimizer; the 8-bit and paged ones (bitsandbytes) keep Adam's state small or pageable."
    )
    lr_scheduler_type: Literal["linear", "cosine", "constant", "constant_with_warmup"] = help_field(
        "cosine", "Learning-rate schedule."
    )
    warmup_ratio: float = help_field(0.1, "Fraction of the steps spent warming the learning rate up.")
    weight_decay: float = help_field(0.1, "AdamW weight decay.")
    max_grad_norm: float = help_field(0.1, "Clip the gradient norm to this.")
    logging_steps: int = help_field(1, "Log (metrics.jsonl, progress bar) every this many steps.")
    seed: int = help_field(42, "Random seed (LoRA init, data order, sampling).")
    adam_beta1: float = help_field(0.9, "AdamW beta1.")
    adam_beta2: float = help_field(0.99, "AdamW beta2.")
    num_generations: int = help_field(4, "Completions sampled per question: the group GRPO normalises over.")
    max_completion_length: int = help_field(786, "Longest completion in tokens.")
    temperature: float = help_field(1.0, "Sampling temperature of the completions.")
    steps_per_generation: int | None = help_field(
        None, "Optimizer steps each generated batch serves (empty: gradient_accumulation_steps)."
    )
    generation_batch_size: int | None = help_field(
        None, "Completions generated at once (empty: per_device_train_batch_size x processes x steps_per_generation)."
    )
    num_iterations: int = help_field(1, "Passes over each generated batch (GRPO's mu); > 1 clips the ratio.")
    epsilon: float = help_field(0.2, "Clip range of the policy ratio when num_iterations > 1.")
    beta: float = help_field(0.0, "KL penalty to the reference (adapter off); 0 skips the reference pass entirely.")
    reward_funcs: list[str] = help_field(
        list(DEFAULT_REWARDS),
        "Rewards, each a registry name (strict_format, soft_format, accuracy), module:function or "
        "path/to/file.py:function, called with the completions and the dataset's columns (fitrl.reward.functions).",
    )
    reward_weights: list[float] | None = help_field(
        None, "Weight of each reward in reward_funcs' order in the sum GRPO learns from (empty: all 1)."
    )
    loss_type: Literal["grpo", "dapo", "dr_grpo", "bnpo"] = help_field(
        "dapo", "How token losses are averaged: 'grpo' per sequence (length-biased), 'dapo' per token."
    )
    use_vllm: bool = help_field(False, "Generate with vLLM colocated on the GPU (needs vllm installed and CUDA).")
    vllm_gpu_memory_utilization: float = help_field(0.3, "Share of the GPU vLLM may take when use_vllm is on.")
    num_samples_to_show: int = help_field(4, "Questions whose greedy completions are shown before and after.")
    guard_kl_max: float = help_field(
        1.0, "Guard: the KL to the reference (trl's kl, nats per token, logged when beta > 0) above this (inf: off)."
    )
    guard_entropy_floor: float = help_field(
        0.1, "Guard: the completions' entropy below this share of its first value: a collapse (0: off)."
    )
    guard_truncated_max: float = help_field(
        0.95, "Guard: the share of completions cut at max_completion_length above this for 5 logged steps (1: off)."
    )
    guard_probe_prompts: int = help_field(
        16,
        "Guard (reward pre-flight): before the first update, degenerate completions to this many problems "
        "(empty, echoed, repeated, cut, rambling, the bare answer) are scored beside the model's own (0: off).",
    )
    guard_probe_max: float = help_field(
        probes.MAX_SHARE,
        "Guard: a probe kind scored above the median reference completion more often than this share.",
    )
    guard_heldout_every: int = help_field(
        50, "Guard (reward hacking): grade held-out problems greedily every this many steps and at the start (0: off)."
    )
    guard_heldout_problems: int = help_field(32, "How many held-out problems that guard grades.")
    guard_heldout_split: str = help_field("test", "The dataset's split those problems come from (not trained on).")
    guard_heldout_drop: float = help_field(
        0.1, "Guard: held-out accuracy this far (absolute) below its first value while the training reward rose."
    )
    guard_length_floor: float = help_field(
        0.2, "Guard: the completions' mean length below this share of its first value for 5 logged steps (0: off)."
    )
    guard_repetition_max: float = help_field(
        0.3, "Guard: the completions' repeated 3-gram share (seq-rep-3) above this for 5 logged steps (1: off)."
    )
    guard_zero_std_max: float = help_field(
        0.9,
        "Guard (learning signal): the share of questions whose completions all score the same (trl's "
        "frac_reward_zero_std: GRPO learns nothing from them) above this for 5 logged steps (1: off).",
    )

    def validate(self) -> None:
        super().validate()
        check(self.guard_kl_max > 0, "guard_kl_max", "> 0 (inf: off)")
        check(0 <= self.guard_entropy_floor < 1, "guard_entropy_floor", "in [0, 1)")
        check(0 < self.guard_truncated_max <= 1, "guard_truncated_max", "in (0, 1]")
        check(0 < self.guard_repetition_max <= 1, "guard_repetition_max", "in (0, 1]")
        check(0 < self.guard_zero_std_max <= 1, "guard_zero_std_max", "in (0, 1]")
        check(0 <= self.guard_length_floor < 1, "guard_length_floor", "in [0, 1)")
        check(self.guard_heldout_every >= 0, "guard_heldout_every", ">= 0 (0: off)")
        check(self.guard_heldout_problems >= 1, "guard_heldout_problems", ">= 1")
        check(self.guard_probe_prompts >= 0, "guard_probe_prompts", ">= 0")
        check(0 < self.guard_probe_max <= 1, "guard_probe_max", "in (0, 1]")
        check(0 < self.guard_heldout_drop <= 1, "guard_heldout_drop", "in (0, 1]")
        check(len(self.reward_funcs) >= 1, "reward_funcs", "at least one reward")
        if self.reward_weights is not None:
            check(
                len(self.reward_weights) == len(self.reward_funcs),
                "reward_weights",
                f"one weight per reward in reward_funcs ({len(self.reward_funcs)})",
            )
        check(self.num_generations >= 2, "num_generations", ">= 2 (GRPO compares completions within a group)")
        check(self.max_completion_length >= 1, "max_completion_length", ">= 1")
        check(self.temperature > 0, "temperature", "> 0")
        check(self.beta >= 0, "beta", ">= 0")
        check(self.num_iterations >= 1, "num_iterations", ">= 1")
        check(self.epsilon > 0, "epsilon", "> 0")
        check(self.num_samples_to_show >= 0, "num_samples_to_show", ">= 0")
        check(0 <= self.adam_beta1 < 1, "adam_beta1", "in [0, 1)")
        check(0 <= self.adam_beta2 < 1, "adam_beta2", "in [0, 1)")
        check(0 < self.vllm_gpu_memory_utilization <= 1, "vllm_gpu_memory_utilization", "in (0, 1]")


CONFIG_TYPES = (ModelArguments, LoraArguments, GSM8KDataArguments, GRPOArguments, DemoArguments)


def workload(configs: Configs, model_type: str, on_gpu: bool, world_size: int) -> Workload:
    args, data = config_of(configs, GRPOArguments), config_of(configs, GSM8KDataArguments)
    micro = args.per_device_train_batch_size
    steps = args.steps_per_generation or args.gradient_accumulation_steps
    w = lora_workload(
        "grpo",
        Step.GRPO,
        configs,
        model_type,
        on_gpu,
        args.gradient_checkpointing,
        GRPO_LORA_TARGETS,
        optimizer=args.optim,
        micro_batch=micro,
        prompt_len=data.max_prompt_length,
        completion_len=args.max_completion_length,
        gen_batch=args.generation_batch_size or micro * world_size * steps,
        reference_pass=args.beta > 0,
        temperature=args.temperature,
    )
    if w.gen_batch % args.num_generations:
        raise UsageError(
            f"invalid value for 'num_generations': the generation batch ({w.gen_batch} completions: "
            f"per_device_train_batch_size x processes x steps) must be a multiple of it (got {args.num_generations})"
        )
    return w


def monitors(args: GRPOArguments) -> list[Limit]:
    """GRPO's in-run monitors (`fitrl.guards`), on trl's logged metrics."""
    return [
        Limit("kl", "kl", "above", args.guard_kl_max, "the policy runs away from its reference; raise beta"),
        Limit("entropy", "entropy", "below_share", args.guard_entropy_floor,
              "the completions collapse onto a few; lower learning_rate or raise temperature"),
        Limit("length", "completions/clipped_ratio", "above", args.guard_truncated_max,
              "completions run to max_completion_length without ending; raise it, or check the EOS token", steps=5),
        Limit("length", "completions/mean_length", "below_share", args.guard_length_floor,
              "completions collapse toward nothing: a reward that pays for ending early?", steps=5),
        Limit("repetition", REPETITION_KEY, "above", args.guard_repetition_max,
              "the completions loop on a phrase (a reward that pays for length or a repeated word?)", steps=5),
        Limit("learning_signal", "frac_reward_zero_std", "above", args.guard_zero_std_max,
              "the completions of most questions all score the same, so GRPO learns nothing from them: rewards "
              "too hard or too easy for the model, or too few num_generations", steps=5),
    ]  # fmt: skip


def batch_moves(configs: Configs) -> Moves:
    args = config_of(configs, GRPOArguments)
    return halve_micro_batch(args.per_device_train_batch_size, args.gradient_accumulation_steps)


def shape_moves(configs: Configs) -> Moves:
    args = config_of(configs, GRPOArguments)
    moves: Moves = []
    if args.num_generations > 2:
        moves.append(("generations", {"num_generations": args.num_generations // 2}))
    if args.max_completion_length > 64:
        moves.append(("completion length", {"max_completion_length": args.max_completion_length * 3 // 4}))
    return moves


def figures(out: Path) -> list[str]:
    rows = metrics_rows(out)
    rewards, accuracy = series(rows, "reward"), series(rows, "rewards/accuracy_reward/mean")
    if not rewards:
        return []
    start, end = start_end(rewards)
    found = [f"reward {start:.3f} -> {end:.3f} over {len(rewards)} steps"]
    if accuracy:
        a0, a1 = start_end(accuracy)
        found.append(f"accuracy reward {a0:.3f} -> {a1:.3f}")
    info = RunInfo.read(out)
    return found + ([*probes.figures(info.details), *audit.figures(info.details)] if info is not None else [])


STAGE = Stage(
    name="grpo",
    module="fitrl.scripts.grpo",
    config_types=CONFIG_TYPES,
    output_dir="grpo",
    figures=figures,
    training=True,
    checkpoint_prefix="checkpoint",
    memory=StageMemory(
        workload=workload,
        optimizer_key="optim",
        eight_bit_optimizer="paged_adamw_8bit",
        batch_moves=batch_moves,
        shape_moves=shape_moves,
    ),
    plot="grpo_curves.png",
    more_plots=(audit.PLOT,),
    samples="samples.md",
)
