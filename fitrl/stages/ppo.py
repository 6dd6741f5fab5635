"""The PPO stage: a LoRA policy and a value head on one (8-bit) backbone, against a reward model.

Program: `fitrl.scripts.ppo`; its engine (the trainer, its step and maths, the metric names) is
`fitrl.ppo`. Writes the policy adapter and value head; checkpoints `step-N`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from fitrl.artifacts import RunInfo
from fitrl.config import check, check_tracker, help_field
from fitrl.demo import DemoArguments
from fitrl.guards import Limit
from fitrl.hub import HubSettings
from fitrl.modeling import LoraArguments, ModelArguments
from fitrl.ppo import metrics
from fitrl.reward import audit, probes
from fitrl.reward.settings import RewardArguments
from fitrl.rollout import generation_batch
from fitrl.stages.base import (
    STRICT_GUARDS_HELP,
    Configs,
    Moves,
    RewardModel,
    Stage,
    StageMemory,
    config_of,
    lora_workload,
    metrics_rows,
    series,
    start_end,
)
from fitrl.tasks.sentiment import PromptArguments
from fitrl.workload import Step, Workload


@dataclass
class PPOArguments(HubSettings):
    """The PPO algorithm and the run (defaults: TRL 0.x's, which the blog used)."""

    output_dir: str = help_field("outputs/ppo", "Where the policy adapter, value head, metrics and plots go.")
    overwrite_output_dir: bool = help_field(False, "Replace a non-empty output_dir.")
    steps: int = help_field(100, "PPO steps; each generates batch_size responses per process and learns from them.")
    batch_size: int = help_field(256, "Prompts per process per PPO step.")
    mini_batch_size: int = help_field(16, "Sequences per optimizer step within a PPO epoch.")
    gradient_accumulation_steps: int = help_field(1, "Micro-batches summed into one mini-batch's update.")
    forward_batch_size: int = help_field(16, "Sequences per no-grad forward (old and reference log-probs, values).")
    generation_batch_size: int | None = help_field(
        None,
        "Prompts per generate call (empty: forward_batch_size). Larger is faster (each generated token costs "
        "a fixed overhead per call) and holds a larger KV cache.",
    )
    ppo_epochs: int = help_field(4, "Passes over each batch, in shuffled mini-batches.")
    policy_from_generation: bool = help_field(
        True,
        "Read the old log-probs and values off the sampling pass instead of a second forward of the policy "
        "(one forward of the batch fewer; equal within float rounding). Off: recompute them, as TRL 0.x does.",
    )
    learning_rate: float = help_field(1.41e-5, "Learning rate of the LoRA weights and the value head.")
    optimizer: Literal["adamw", "adamw_8bit"] = help_field("adamw", "'adamw_8bit': bitsandbytes AdamW8bit.")
    max_grad_norm: float = help_field(0.0, "Clip the gradient norm to this (0: no clipping).")
    gamma: float = help_field(1.0, "Discount of GAE.")
    lam: float = help_field(0.95, "Lambda of GAE.")
    cliprange: float = help_field(0.2, "Clip range of the policy ratio.")
    cliprange_value: float = help_field(0.2, "Clip range of the value update.")
    vf_coef: float = help_field(0.1, "Weight of the value loss.")
    kl_estimator: Literal["kl", "abs", "mse", "full"] = help_field("kl", "Per-token KL penalty against the reference.")
    adaptive_kl: bool = help_field(True, "Adapt the KL coefficient towards target_kl (else keep init_kl_coef).")
    init_kl_coef: float = help_field(0.2, "Initial (or fixed) KL coefficient.")
    target_kl: float = help_field(6.0, "KL the adaptive controller aims for.")
    kl_horizon: int = help_field(10000, "Horizon of the adaptive KL controller.")
    whiten_rewards: bool = help_field(False, "Whiten the per-token rewards before GAE.")
    score_scaling: Literal["none", "scale", "normalize"] = help_field(
        "none", "Divide scores by their running std ('scale') or also subtract the running mean ('normalize')."
    )
    score_clip: float | None = help_field(None, "Clip scores to [-score_clip, score_clip] (after scaling).")
    ratio_threshold: float = help_field(10.0, "Skip a mini-batch whose mean policy ratio exceeds this.")
    early_stopping: bool = help_field(False, "Stop a step's PPO epochs once the policy KL exceeds 1.5 x target.")
    target_policy_kl: float = help_field(1.0, "Policy KL that early_stopping guards.")
    gradient_checkpointing: bool = help_field(False, "Recompute activations in backward (turned off while generating).")
    save_steps: int = help_field(0, "Checkpoint every this many steps (0: never).")
    resume_from_checkpoint: str | None = help_field(None, "A checkpoint directory, or 'latest', to continue from.")
    verify_frozen_base: bool = help_field(False, "Hash the frozen base weights before and after; fail if they moved.")
    report_to: Literal["none", "tensorboard", "wandb"] = help_field("tensorboard", "Tracker besides metrics.jsonl.")
    log_samples: int = help_field(4, "Query/response/reward samples kept from the first and last steps.")
    seed: int = help_field(0, "Random seed (prompts, lengths, sampling, shuffling).")
    strict_guards: bool = help_field(False, STRICT_GUARDS_HELP)
    guard_kl_max: float = help_field(
        30.0, "Guard: the KL to the reference (objective/kl, nats per response) above this (inf: off)."
    )
    guard_entropy_floor: float = help_field(
        0.1, "Guard: the policy's entropy below this share of its first value: a collapse (0: off)."
    )
    guard_clipfrac_max: float = help_field(
        0.5, "Guard: the share of clipped policy ratios above this for 5 steps in a row (1: off)."
    )
    guard_repetition_max: float = help_field(
        0.3, "Guard: the responses' repeated 3-gram share (seq-rep-3) above this for 5 steps in a row (1: off)."
    )
    guard_judge_model: str | None = help_field(
        None,
        "Guard (reward hacking): a second judge the policy never trains against (demo://lexicon, or a sequence "
        "classifier) reads held-out responses at the start and every guard_judge_every steps (empty: off).",
    )
    guard_judge_positive_label: str = help_field("POSITIVE", "The judge classifier's label counted as positive.")
    guard_judge_every: int = help_field(20, "Steps between the judge's readings.")
    guard_judge_prompts: int = help_field(32, "Held-out prompts the judge reads responses to.")
    guard_judge_split: str = help_field("test", "The prompt dataset's split those prompts come from.")
    guard_probe_prompts: int = help_field(
        16,
        "Guard (reward pre-flight): before the first update, degenerate completions to this many prompts "
        "(empty, echoed, repeated, cut, rambling, negated) are scored beside the reference's own (0: off).",
    )
    guard_probe_max: float = help_field(
        probes.MAX_SHARE,
        "Guard: a probe kind scored above the median reference completion more often than this share.",
    )
    guard_judge_drop: float = help_field(
        0.2,
        "Guard: the judge's mean verdict (+1 positive, 0 neutral, -1 negative) this far below its first "
        "reading while the reward rose.",
    )

    def validate(self) -> None:
        super().validate()
        check_tracker(self.report_to)
        check(self.guard_kl_max > 0, "guard_kl_max", "> 0 (inf: off)")
        check(0 <= self.guard_entropy_floor < 1, "guard_entropy_floor", "in [0, 1)")
        check(0 < self.guard_clipfrac_max <= 1, "guard_clipfrac_max", "in (0, 1]")
        check(0 < self.guard_repetition_max <= 1, "guard_repetition_max", "in (0, 1]")
        check(self.guard_judge_every >= 1, "guard_judge_every", ">= 1")
        check(self.guard_judge_prompts >= 1, "guard_judge_prompts", ">= 1")
        check(self.guard_probe_prompts >= 0, "guard_probe_prompts", ">= 0")
        check(0 < self.guard_probe_max <= 1, "guard_probe_max", "in (0, 1]")
        check(0 < self.guard_judge_drop <= 2, "guard_judge_drop", "in (0, 2]")
        for key in [
            "steps",
            "batch_size",
            "mini_batch_size",
            "gradient_accumulation_steps",
            "forward_batch_size",
            "ppo_epochs",
            "kl_horizon",
        ]:
            check(getattr(self, key) >= 1, key, ">= 1")
        check(self.generation_batch_size is None or self.generation_batch_size >= 1, "generation_batch_size", ">= 1")
        check(self.learning_rate > 0, "learning_rate", "> 0")
        check(
            self.batch_size % self.mini_batch_size == 0,
            "batch_size",
            f"a multiple of mini_batch_size ({self.mini_batch_size})",
        )
        check(
            self.mini_batch_size % self.gradient_accumulation_steps == 0,
            "mini_batch_size",
            f"a multiple of gradient_accumulation_steps ({self.gradient_accumulation_steps})",
        )
        check(0 < self.cliprange < 1, "cliprange", "in (0, 1)")
        check(self.cliprange_value > 0, "cliprange_value", "> 0")
        check(0 <= self.lam <= 1, "lam", "in [0, 1]")
        check(0 <= self.gamma <= 1, "gamma", "in [0, 1]")
        check(self.init_kl_coef >= 0, "init_kl_coef", ">= 0")
        check(self.target_kl > 0, "target_kl", "> 0")
        check(self.save_steps >= 0, "save_steps", ">= 0")
        check(self.max_grad_norm >= 0, "max_grad_norm", ">= 0")
        check(self.score_clip is None or self.score_clip > 0, "score_clip", "empty or > 0")
        check(self.target_policy_kl > 0, "target_policy_kl", "> 0")
        check(self.vf_coef >= 0, "vf_coef", ">= 0")
        check(self.ratio_threshold > 0, "ratio_threshold", "> 0")
        check(self.seed >= 0, "seed", ">= 0")


CONFIG_TYPES = (ModelArguments, LoraArguments, PromptArguments, RewardArguments, PPOArguments, DemoArguments)


def workload(configs: Configs, model_type: str, on_gpu: bool, world_size: int) -> Workload:
    args, prompts = config_of(configs, PPOArguments), config_of(configs, PromptArguments)
    return lora_workload(
        "ppo",
        Step.PPO,
        configs,
        model_type,
        on_gpu,
        args.gradient_checkpointing,
        optimizer=args.optimizer,
        micro_batch=args.mini_batch_size // args.gradient_accumulation_steps,
        prompt_len=prompts.longest_query,
        completion_len=prompts.response_max_tokens,
        gen_batch=generation_batch(args.generation_batch_size, args.forward_batch_size, args.batch_size),
        nograd_batch=min(args.forward_batch_size, args.batch_size),
        reference_pass=True,
        value_head=True,
        reward_adapter=bool(config_of(configs, RewardArguments).reward_adapter),
    )


def monitors(args: PPOArguments) -> list[Limit]:
    """PPO's in-run monitors (`fitrl.guards`), on its logged metrics."""
    return [
        Limit("kl", metrics.KL, "above", args.guard_kl_max,
              "the policy runs away from its reference; raise init_kl_coef or lower learning_rate"),
        # A sampled KL estimate is >= 0 on average: strongly negative means the samples are not the policy's.
        Limit("kl", metrics.KL, "below", -1.0,
              "the sampling does not match the policy's forward (top_k/top_p, EOS, padding; trl#925)"),
        Limit("entropy", metrics.ENTROPY, "below_share", args.guard_entropy_floor,
              "the policy collapses onto a few responses; raise the KL coefficient or lower learning_rate"),
        Limit("clipping", metrics.CLIPFRAC, "above", args.guard_clipfrac_max,
              "updates too large for the clip range; lower learning_rate or ppo_epochs", steps=5),
        Limit("repetition", metrics.REPETITION, "above", args.guard_repetition_max,
              "the responses loop on a phrase: the reward pays for it, or the KL term is too weak", steps=5),
    ]  # fmt: skip


def reward_model(configs: Configs) -> RewardModel | None:
    """The model loaded beside the policy to score, as loaded: none when the reward is an adapter on the
    policy's backbone, or a function; the base of an rm adapter of another model (or not shared)."""
    args = config_of(configs, RewardArguments)
    if args.reward_function:
        return None
    if not args.reward_adapter:
        return RewardModel(args.reward_model, args.reward_dtype, args.reward_quantization)
    from fitrl.config import UsageError
    from fitrl.modeling import resolve_model_path
    from fitrl.reward.adapter import separate_base

    model, cache = (
        config_of(configs, ModelArguments).model_name_or_path,
        config_of(configs, DemoArguments).demo_assets,
    )
    try:  # before the stages that write them, the policy's model or the adapter may not exist yet
        path, producer = resolve_model_path(model, cache), STAGE.producer_of("reward_adapter")
        base = separate_base(args.reward_adapter, model, path, cache, args.reward_adapter_shared, STAGE.name, producer)
    except UsageError:
        return None
    return None if base is None else RewardModel(base, args.reward_dtype, args.reward_quantization)


def batch_moves(configs: Configs) -> Moves:
    """Fewer sequences per pass (training, no-grad, generation), the same PPO batch."""
    args = config_of(configs, PPOArguments)
    moves: Moves = []
    micro = args.mini_batch_size // args.gradient_accumulation_steps
    if micro > 1 and micro % 2 == 0:
        moves.append(("micro-batch", {"gradient_accumulation_steps": args.gradient_accumulation_steps * 2}))
    if args.forward_batch_size > 1:
        moves.append(("no-grad batch", {"forward_batch_size": args.forward_batch_size // 2}))
    if (args.generation_batch_size or 0) > 1:
        moves.append(("generation batch", {"generation_batch_size": args.generation_batch_size // 2}))
    return moves


def figures(out: Path) -> list[str]:
    rows = metrics_rows(out)
    rewards, kls = series(rows, metrics.REWARD_MEAN), series(rows, metrics.KL)
    if not rewards:
        return []
    start, end = start_end(rewards)
    found = [f"reward {start:.2f} -> {end:.2f} over {len(rewards)} steps", f"KL to the reference {kls[-1]:.2f} nats"]
    info = RunInfo.read(out)
    return found + ([*probes.figures(info.details), *audit.figures(info.details)] if info is not None else [])


STAGE = Stage(
    name="ppo",
    card_notes=(
        "The value head PPO trained beside the policy is `value_head.safetensors` (a `Linear(hidden, 1)`'s "
        "`weight` and `bias`: `safetensors.torch.load_file`).",
    ),
    module="fitrl.scripts.ppo",
    config_types=CONFIG_TYPES,
    output_dir="ppo",
    figures=figures,
    reads=("model_name_or_path", "merge"),
    reads_if_set=(("reward_adapter", "rm"),),
    training=True,
    checkpoint_prefix="step",
    memory=StageMemory(
        workload=workload,
        optimizer_key="optimizer",
        eight_bit_optimizer="adamw_8bit",
        batch_moves=batch_moves,
        reward_model=reward_model,
    ),
    plot="ppo_curves.png",
    more_plots=(audit.PLOT,),
    samples="samples.md",
)
