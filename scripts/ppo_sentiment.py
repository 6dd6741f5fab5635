"""Stage 3 of the RLHF pipeline: PPO with LoRA on one 8-bit backbone, against a sentiment reward.

One copy of the merged model sits in memory, in 8-bit. A fresh LoRA adapter on it is the **policy**;
the same forward with the adapter disabled gives the **reference** log-probs (no second copy); a small
fp32 **value head** reads the policy's last hidden state; the **reward** is a sentiment classifier's
score of query + response. The maths (GAE, whitening, KL, clipped losses) is in `fitrl.ppo`.

    accelerate launch scripts/ppo_sentiment.py --config configs/demo/ppo.yaml          # CPU, minutes
    accelerate launch scripts/ppo_sentiment.py --config configs/neox20b-24gb/ppo.yaml  # one 24 GB GPU
    accelerate launch --multi_gpu --num_processes 2 scripts/ppo_sentiment.py --config ...
    # continue a killed run
    accelerate launch scripts/ppo_sentiment.py --config ... --resume_from_checkpoint latest

Writes to `output_dir`: the policy adapter, `value_head.pt`, `run_config.yaml`, `run_info.json`,
`metrics.jsonl`, `ppo_curves.png` and `samples.md`. Checkpoints go to `<output_dir>.checkpoints/`,
outside the staged output, so that a stopped run keeps them.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from fitrl import ppo
from fitrl.checkpoints import (
    STATE_FILE,
    checkpoint_root,
    latest_checkpoint,
    load_safetensors,
    load_state,
    resume_checkpoint,
)
from fitrl.config import (
    RunFailed,
    UsageError,
    check,
    config_dict,
    entrypoint,
    help_field,
    parse_config,
    save_run_config,
    save_run_info,
)
from fitrl.demo import DemoArguments
from fitrl.distributed import check_ranks_in_sync, cpu_only, tensor_digest
from fitrl.memory import StepPeak, gpu_peak_mb, memory_report, optimizer_state_tensors
from fitrl.modeling import (
    LoraArguments,
    ModelArguments,
    PolicyAndValue,
    add_lora,
    load_causal_lm,
    load_tokenizer,
    resolve_model_path,
)
from fitrl.outputs import MetricsLog, check_output_dir, markdown_cell, plot_curves, staged_output_dir
from fitrl.planner import planned_peak_mb
from fitrl.rollout import (
    Rollout,
    decode,
    forward,
    generation_batch,
    response_slice,
    response_window,
    sample_responses,
)
from fitrl.sentiment import PromptArguments, RewardArguments, SentimentReward, build_queries, check_reward_label


@dataclass
class PPOArguments:
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

    def validate(self) -> None:
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


CONFIG_TYPES = [ModelArguments, LoraArguments, PromptArguments, RewardArguments, PPOArguments, DemoArguments]
STAT_KEYS = ["pg_loss", "vf_loss", "clipfrac", "vf_clipfrac", "approx_kl", "ratio", "skipped"]


@dataclass
class Experience:
    """One PPO step's batch: the sampled sequences and what the no-grad pass measured on them.

    Queries are left-padded to width Q, responses right-padded to width R; per-token fields are 0 on
    padding. `advantages` and `returns` are filled once the whole batch is known (whitening needs it).
    """

    input_ids: torch.Tensor  # (B, Q + R)
    attention_mask: torch.Tensor  # (B, Q + R)
    response_mask: torch.Tensor  # (B, R) float: 1 on real response tokens
    logprobs: torch.Tensor  # (B, R) log p_old of each response token
    values: torch.Tensor  # (B, R) the value head's estimates
    kl: torch.Tensor  # (B, R) per-token KL estimate to the reference
    entropy: torch.Tensor  # (B, R)
    query_len: int  # Q
    advantages: torch.Tensor | None = None  # (B, R), whitened
    returns: torch.Tensor | None = None  # (B, R), the value head's targets

    @staticmethod
    def cat(parts: list[Experience], pad_token_id: int) -> Experience:
        """Pad every part to one (Q, R) layout and concatenate along the batch."""
        qwidth = max(p.query_len for p in parts)
        rwidth = max(p.response_mask.shape[1] for p in parts)
        per_token = ["response_mask", "logprobs", "values", "kl", "entropy"]
        cols: dict[str, list[torch.Tensor]] = {k: [] for k in ["input_ids", "attention_mask", *per_token]}
        for p in parts:
            qpad, rpad = qwidth - p.query_len, rwidth - p.response_mask.shape[1]
            cols["input_ids"].append(nn.functional.pad(p.input_ids, (qpad, rpad), value=pad_token_id))
            cols["attention_mask"].append(nn.functional.pad(p.attention_mask, (qpad, rpad), value=0))
            for k in per_token:
                cols[k].append(nn.functional.pad(getattr(p, k), (0, rpad)))
        return Experience(**{k: torch.cat(v) for k, v in cols.items()}, query_len=qwidth)

    def select(self, rows: torch.Tensor) -> Experience:
        """The sub-batch of `rows`: every tensor field indexed along the batch."""
        return dataclasses.replace(
            self,
            **{f.name: getattr(self, f.name)[rows] for f in dataclasses.fields(self) if f.name != "query_len"},
        )

    @property
    def responses(self) -> torch.Tensor:  # (B, R)
        return self.input_ids[:, self.query_len :]


@dataclass
class Run:
    """What lives for the whole run: configs, the accelerator, the model and everything with state."""

    model_args: ModelArguments
    lora_args: LoraArguments
    prompt_args: PromptArguments
    reward_args: RewardArguments
    args: PPOArguments
    demo_args: DemoArguments
    accelerator: Any
    model_path: str
    tokenizer: Any
    queries: list[list[int]]
    resume: Path | None
    out: Path | None = None
    model: Any = None  # PolicyAndValue, wrapped by accelerate (DDP) after prepare()
    unwrapped: Any = None  # PolicyAndValue itself
    optimizer: Any = None
    reward: SentimentReward | None = None
    kl_ctl: Any = None
    score_stats: ppo.RunningMoments | None = None
    metrics: MetricsLog | None = None
    frozen: dict[str, torch.Tensor] | None = None
    frozen_digest: str | None = None
    start_step: int = 0
    samples: dict[str, list[dict[str, Any]]] = dataclasses.field(default_factory=dict)
    first_prompts: list[int] | None = None
    planned_peak_mb: float | None = None
    step_peak: StepPeak = dataclasses.field(default_factory=StepPeak)
    warned_negative_kl: bool = False

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    @property
    def configs(self) -> tuple[Any, ...]:
        return (self.model_args, self.lora_args, self.prompt_args, self.reward_args, self.args, self.demo_args)


def step_seed(seed: int, step: int, rank: int) -> int:
    # Every draw of a step (lengths, sampling, shuffles, dropout) comes from (seed, step, rank), so a
    # resumed run makes exactly the draws of an uninterrupted one; the primes keep the triples apart.
    return seed * 1_000_003 + step * 1009 + rank


def epoch_seed(seed: int, epoch: int) -> int:
    # One permutation of the prompts per pass over them, the same on every rank and after a resume.
    return seed * 7919 + epoch


def batch_queries(queries: list[list[int]], step: int, rank: int, world: int, size: int, seed: int) -> list[int]:
    """Indices of this rank's prompts at `step`: a seeded permutation per epoch, disjoint across ranks."""
    indices = []
    for j in range(size):
        pos = (step * world + rank) * size + j
        epoch, k = divmod(pos, len(queries))
        perm = torch.randperm(len(queries), generator=torch.Generator().manual_seed(epoch_seed(seed, epoch)))
        indices.append(int(perm[k]))
    return indices


def stopped(reason: str, step: int, args: PPOArguments) -> RunFailed:
    """The error for a run that cannot go on: it names the checkpoint to resume from, if any."""
    latest = latest_checkpoint(checkpoint_root(args.output_dir), "step")
    kept = f"the last checkpoint, {latest}, is kept" if latest else "no checkpoint was saved yet"
    return RunFailed(f"{reason} at step {step}; {kept}; lower learning_rate or clip scores (score_clip)")


# --- setup ----------------------------------------------------------------------------------------


def preflight(configs: tuple[Any, ...]) -> Run:
    """Everything a user can get wrong, checked before the backbone loads."""
    model_args, lora_args, prompt_args, reward_args, args, demo_args = configs
    cache = demo_args.demo_cache_dir
    inputs = [model_args.model_name_or_path, prompt_args.dataset, reward_args.reward_model, args.resume_from_checkpoint]
    check_output_dir(args.output_dir, args.overwrite_output_dir, inputs)
    resume = resume_checkpoint(args.resume_from_checkpoint, args.output_dir, "step", "PPO", config_dict(*configs))
    reward_path = resolve_model_path(reward_args.reward_model, cache, "reward model")
    check_reward_label(reward_path, reward_args.positive_label)
    model_path = resolve_model_path(model_args.model_name_or_path, cache)
    tokenizer = load_tokenizer(model_path, model_args.trust_remote_code)
    queries = build_queries(tokenizer, prompt_args, cache, args.seed)
    if len(queries) < args.batch_size:
        raise UsageError(f"only {len(queries)} prompts for batch_size {args.batch_size}; lower batch_size")

    from accelerate import Accelerator

    accelerator = Accelerator(
        cpu=cpu_only(),
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        log_with=None if args.report_to == "none" else args.report_to,
    )
    run = Run(*configs, accelerator, model_path, tokenizer, queries, resume)
    run.planned_peak_mb = planned_peak_mb("ppo", config_dict(*configs), model_path, accelerator.num_processes)
    return run


def build(run: Run) -> None:
    """The backbone, a fresh LoRA policy and value head, the optimizer, reward and KL controller."""
    args = run.args
    backbone = load_causal_lm(
        run.model_args,
        path=run.model_path,
        gradient_checkpointing=args.gradient_checkpointing,
        pad_token_id=run.tokenizer.pad_token_id,
    )
    torch.manual_seed(args.seed)  # the same fresh adapter and value head on every rank
    model = PolicyAndValue(add_lora(backbone, run.lora_args), backbone.config.hidden_size)
    model.value_head.to(run.device)  # the backbone is already placed (device_map) or moved by prepare()
    run.frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    run.frozen_digest = tensor_digest(run.frozen) if args.verify_frozen_base else None
    params = [p for p in model.parameters() if p.requires_grad]
    if args.optimizer == "adamw_8bit":
        import bitsandbytes as bnb

        run.optimizer = bnb.optim.AdamW8bit(params, lr=args.learning_rate)
    else:
        run.optimizer = torch.optim.AdamW(params, lr=args.learning_rate)
    run.reward = SentimentReward(run.reward_args, run.demo_args.demo_cache_dir, run.device)
    if args.adaptive_kl:
        run.kl_ctl = ppo.AdaptiveKLController(args.init_kl_coef, args.target_kl, args.kl_horizon)
    else:
        run.kl_ctl = ppo.FixedKLController(args.init_kl_coef)
    run.score_stats = ppo.RunningMoments()
    run.metrics = MetricsLog(run.out, enabled=run.accelerator.is_main_process)
    run.unwrapped = model


def load_checkpoint(run: Run, path: Path) -> None:
    """Weights and run state from `path` (before DDP wraps the model); the optimizer state after."""
    from peft import set_peft_model_state_dict

    adapter = load_safetensors(path / "adapter" / "adapter_model.safetensors", path)
    set_peft_model_state_dict(run.unwrapped.policy, adapter)
    run.unwrapped.value_head.load_state_dict(load_state(path / "value_head.pt", run.device))
    state = json.loads((path / STATE_FILE).read_text())
    run.start_step, run.samples = state["step"], state["samples"]
    run.kl_ctl.load_state_dict(state["kl_controller"])
    run.score_stats.load_state_dict(state["score_stats"])
    for row in state["metrics"]:
        run.metrics.log(row)


def save_checkpoint(run: Run, step: int) -> None:
    """Adapter, value head, optimizer and run state to `step-N/`, written aside and renamed into place."""
    path = checkpoint_root(run.args.output_dir) / f"step-{step}"
    state = {
        "step": step,
        "kl_controller": run.kl_ctl.state_dict(),
        "samples": run.samples,
        "score_stats": run.score_stats.state_dict(),
        "metrics": run.metrics.rows,
    }
    run.accelerator.wait_for_everyone()
    if run.accelerator.is_main_process:
        staging = path.with_name(path.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        run.unwrapped.policy.save_pretrained(staging / "adapter")
        torch.save(run.unwrapped.value_head.state_dict(), staging / "value_head.pt")
        torch.save(run.optimizer.state_dict(), staging / "optimizer.pt")
        (staging / STATE_FILE).write_text(json.dumps(state))
        save_run_config(staging, *run.configs)
        shutil.rmtree(path, ignore_errors=True)
        staging.rename(path)
    run.accelerator.wait_for_everyone()


def prepare(run: Run) -> None:
    """Wrap for DDP (where launched so), restore the optimizer state, start the trackers."""
    run.model, run.optimizer = run.accelerator.prepare(run.unwrapped, run.optimizer)
    if run.resume is not None:
        run.optimizer.load_state_dict(load_state(run.resume / "optimizer.pt", run.device))
    run.unwrapped = run.accelerator.unwrap_model(run.model)
    if run.args.report_to != "none":  # trackers take scalars: lists become strings, empties are dropped
        flat = config_dict(*run.configs)
        hparams = {k: str(v) if isinstance(v, list) else v for k, v in flat.items() if v is not None}
        run.accelerator.init_trackers("fitrl-ppo", hparams)


# --- the phases of one step -----------------------------------------------------------------------


def rollout(run: Run, step: int) -> list[Rollout]:
    """Phase 1: this rank's prompts for `step`, and a sampled response of drawn length for each."""
    args, accelerator = run.args, run.accelerator
    idx = batch_queries(
        run.queries, step, accelerator.process_index, accelerator.num_processes, args.batch_size, args.seed
    )
    run.first_prompts = run.first_prompts or idx[:4]
    low, high = run.prompt_args.response_min_tokens, run.prompt_args.response_max_tokens
    lengths = torch.randint(low, high + 1, (args.batch_size,)).tolist()
    size = generation_batch(args.generation_batch_size, args.forward_batch_size, args.batch_size)
    chunks = [slice(c, c + size) for c in range(0, args.batch_size, size)]
    # The full KL needs the policy's logits beside the reference's: those come from a forward pass.
    keep_policy = args.policy_from_generation and args.kl_estimator != "full"
    rollouts = [
        sample_responses(
            run.unwrapped.policy,
            run.tokenizer,
            [run.queries[i] for i in idx[c]],
            lengths[c],
            run.prompt_args.stop_at_eos,
            run.device,
            keep_policy=keep_policy,
        )
        for c in chunks
    ]
    return [part for r in rollouts for part in r.split(args.forward_batch_size)]  # no-grad pass chunks


def score(run: Run, rollouts: list[Rollout], step: int) -> tuple[torch.Tensor, torch.Tensor, list[str], list[str]]:
    """Phase 2: the classifier reads the decoded text with its own tokenizer; scores scaled and clipped.

    Returns the raw scores (B,) as logged, the scores the reward uses (B,), and the query/response texts.
    """
    args = run.args
    texts = [decode(run.tokenizer, r) for r in rollouts]
    q_texts = [q for qs, _ in texts for q in qs]
    r_texts = [r for _, rs in texts for r in rs]
    raw = run.reward([q + r for q, r in zip(q_texts, r_texts)]).to(run.device)  # (B,)
    if not torch.isfinite(raw).all():
        raise stopped("non-finite reward", step + 1, args)
    scores = raw
    if args.score_scaling != "none":
        run.score_stats.update(run.accelerator.gather(raw).cpu())
        shift = run.score_stats.mean if args.score_scaling == "normalize" else 0.0
        scores = (raw - shift) / (run.score_stats.std + 1e-8)
    if args.score_clip is not None:
        scores = scores.clamp(-args.score_clip, args.score_clip)
    return raw, scores, q_texts, r_texts


@torch.no_grad()
def make_experience(run: Run, rollouts: list[Rollout], scores: torch.Tensor) -> tuple[Experience, torch.Tensor]:
    """Phase 3: old log-probs and values (kept from sampling, or a forward of the policy) and reference
    log-probs (adapter off) in a no-grad pass; then per-token rewards, GAE and whitened advantages.
    Returns the experience and the KL part of the reward (B, R).

    In eval mode: dropout here would make the first PPO ratio differ from 1 for no reason.
    """
    args, policy = run.args, run.unwrapped.policy
    run.unwrapped.eval()
    parts = []
    for r in rollouts:
        keep = response_window(r)  # logits only where they predict the response
        logits = None
        if r.policy is not None:
            logprobs, entropy, values = r.policy.logprobs, r.policy.entropy, run.unwrapped.values(r.policy.hidden)
        else:
            logits, values = run.unwrapped(r.input_ids, r.attention_mask, logits_to_keep=keep)
            logits, values = logits[:, :-1], response_slice(values, r)  # (B, R, V), (B, R)
            logprobs, entropy = ppo.logprobs_from_logits(logits, r.responses), ppo.entropy_from_logits(logits)
        with policy.disable_adapter():
            ref_logits = forward(policy, r, logits_to_keep=keep).logits[:, :-1]
        ref_logprobs = ppo.logprobs_from_logits(ref_logits, r.responses)
        parts.append(
            Experience(
                input_ids=r.input_ids,
                attention_mask=r.attention_mask,
                response_mask=r.response_mask.float(),
                logprobs=logprobs,
                values=values,
                kl=ppo.kl_penalty(logprobs, ref_logprobs, args.kl_estimator, logits, ref_logits),
                entropy=entropy,
                query_len=r.query_len,
            )
        )
    exp = Experience.cat(parts, run.tokenizer.pad_token_id)
    rewards, non_score = ppo.per_token_rewards(scores, exp.kl, exp.response_mask, run.kl_ctl.value)
    if args.whiten_rewards:
        rewards = ppo.masked_whiten(rewards, exp.response_mask, shift_mean=False)
    advantages, returns = ppo.gae(exp.values, rewards, exp.response_mask, args.gamma, args.lam)
    exp.advantages, exp.returns = ppo.masked_whiten(advantages, exp.response_mask), returns
    return exp, non_score


def ppo_update(run: Run, exp: Experience, step: int) -> dict[str, float]:
    """Phase 4: `ppo_epochs` passes of shuffled mini-batches of accumulated micro-batches.

    Statistics stay on the device and are read once at the end, so the loop never waits on the host.
    """
    args, accelerator, model, optimizer = run.args, run.accelerator, run.model, run.optimizer
    model.train()
    stats: dict[str, list[torch.Tensor]] = {k: [] for k in STAT_KEYS}
    finite = torch.ones((), dtype=torch.bool, device=run.device)
    micro = args.mini_batch_size // args.gradient_accumulation_steps
    q = exp.query_len
    for _epoch in range(args.ppo_epochs):
        perm = torch.randperm(args.batch_size)
        epoch_start = len(stats["approx_kl"])
        for u in range(0, args.batch_size, micro):
            mb = exp.select(perm[u : u + micro])
            with accelerator.accumulate(model):
                logits, values = model(mb.input_ids, mb.attention_mask, logits_to_keep=response_window(mb))
                logits, values = logits[:, :-1], values[:, q - 1 : -1]
                logprobs = ppo.logprobs_from_logits(logits, mb.responses)
                pg = ppo.policy_loss(logprobs, mb.logprobs, mb.advantages, mb.response_mask, args.cliprange)
                vf_loss, vf_clip = ppo.value_loss(values, mb.values, mb.returns, mb.response_mask, args.cliprange_value)
                loss = pg.loss + args.vf_coef * vf_loss
                # A wildly off-policy batch: learn nothing from it, but still step, to keep DDP in step.
                skipped = pg.ratio_mean.detach() > args.ratio_threshold
                loss = torch.where(skipped, loss * 0.0, loss)
                finite &= torch.isfinite(loss.detach())
                accelerator.backward(loss)
                if accelerator.sync_gradients and args.max_grad_norm > 0:
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad()
            for k, v in zip(
                STAT_KEYS, [pg.loss, vf_loss, pg.clipfrac, vf_clip, pg.approx_kl, pg.ratio_mean, skipped.float()]
            ):
                stats[k].append(v.detach())
        if args.early_stopping:  # the epoch's mean policy KL, averaged over ranks, so all ranks stop together
            epoch_kl = torch.stack(stats["approx_kl"][epoch_start:]).mean()
            if accelerator.reduce(epoch_kl, "mean") > 1.5 * args.target_policy_kl:
                break
    if not finite:
        raise stopped("non-finite loss", step + 1, args)
    per_batch = torch.stack([torch.stack(stats[k]) for k in STAT_KEYS]).tolist()  # one host sync per step
    return {k: sum(v) / len(v) if k != "skipped" else sum(v) for k, v in zip(STAT_KEYS, per_batch)}


def log_step(
    run: Run,
    step: int,
    exp: Experience,
    non_score: torch.Tensor,
    raw_scores: torch.Tensor,
    stats: dict[str, float],
    timings: dict[str, float],
) -> dict[str, Any]:
    """Phase 5: update the KL controller, and log the step's metrics reduced over ranks."""
    accelerator, world, mask = run.accelerator, run.accelerator.num_processes, exp.response_mask
    mean_kl = accelerator.reduce((exp.kl * mask).sum(1).mean(), "mean").item()
    run.kl_ctl.update(mean_kl, run.args.batch_size * world)
    all_scores = accelerator.gather(raw_scores)
    local = torch.tensor(
        [
            ppo.masked_mean(exp.entropy, mask).item(),
            (non_score.sum(1)).mean().item(),
            mask.sum(1).float().mean().item(),
            ppo.explained_variance(exp.values, exp.returns, mask),
        ],
        device=run.device,
    )
    ent, non_score_mean, resp_len, expl_var = accelerator.reduce(local, "mean").tolist()
    n_tokens = mask.sum().item() * world
    row = {
        "step": step + 1,
        "env/reward_mean": all_scores.mean().item(),
        "env/reward_std": all_scores.std().item() if len(all_scores) > 1 else 0.0,
        "objective/kl": mean_kl,
        "objective/kl_coef": run.kl_ctl.value,
        "objective/entropy": ent,
        "objective/non_score_reward": non_score_mean,
        "ppo/policy_loss": stats["pg_loss"],
        "ppo/value_loss": stats["vf_loss"],
        "ppo/clipfrac": stats["clipfrac"],
        "ppo/value_clipfrac": stats["vf_clipfrac"],
        "ppo/approx_kl": stats["approx_kl"],
        "ppo/ratio_mean": stats["ratio"],
        "ppo/skipped_batches": stats["skipped"],
        "ppo/explained_variance": expl_var,
        "env/response_length": resp_len,
        **timings,
        "tokens_per_second": n_tokens / max(sum(timings.values()), 1e-9),
        "memory/gpu_peak_mb": gpu_peak_mb(),
    }
    run.metrics.log(row)
    accelerator.log({k: v for k, v in row.items() if isinstance(v, (int, float))}, step=step + 1)
    if mean_kl < -1 and not run.warned_negative_kl and accelerator.is_main_process:
        run.warned_negative_kl = True
        warnings.warn(
            f"KL to the reference is strongly negative ({mean_kl:.2f}) at step {step + 1}: the "
            "sampling does not match the policy (check top_k/top_p, EOS, padding)",
            stacklevel=1,
        )
    return row


def keep_samples(run: Run, step: int, q_texts: list[str], r_texts: list[str], raw_scores: torch.Tensor) -> None:
    for which, at in [("first", 0), ("last", run.args.steps - 1)]:
        if step == at:
            rows = zip(q_texts, r_texts, raw_scores.tolist())
            run.samples[which] = [{"query": q, "response": r, "reward": round(s, 3)} for q, r, s in rows][
                : run.args.log_samples
            ]


def train_step(run: Run, step: int) -> dict[str, Any]:
    """One PPO step, phase by phase, timed."""
    torch.manual_seed(step_seed(run.args.seed, step, run.accelerator.process_index))
    if step == run.start_step + 1:  # the second step of this process: the optimizer states exist by then
        held = [*run.unwrapped.parameters(), *run.unwrapped.buffers(), *optimizer_state_tensors(run.optimizer)]
        run.step_peak.start(held)
    timings, t0 = {}, time.perf_counter()
    rollouts = rollout(run, step)
    timings["time/generate"], t0 = time.perf_counter() - t0, time.perf_counter()
    raw_scores, scores, q_texts, r_texts = score(run, rollouts, step)
    timings["time/score"], t0 = time.perf_counter() - t0, time.perf_counter()
    exp, non_score = make_experience(run, rollouts, scores)
    timings["time/forward"], t0 = time.perf_counter() - t0, time.perf_counter()
    stats = ppo_update(run, exp, step)
    timings["time/optimise"] = time.perf_counter() - t0
    run.step_peak.stop()
    row = log_step(run, step, exp, non_score, raw_scores, stats, timings)
    keep_samples(run, step, q_texts, r_texts, raw_scores)
    if run.args.save_steps and (step + 1) % run.args.save_steps == 0:
        save_checkpoint(run, step + 1)
    return row


# --- the end --------------------------------------------------------------------------------------


def finish(run: Run) -> None:
    """Check the ranks agree and the base did not move, then write the policy, value head and report."""
    from accelerate.utils import gather_object
    from peft import get_peft_model_state_dict

    unwrapped, out = run.unwrapped, run.out
    # Every rank must end with the same policy and value head: check, don't assume.
    value_head = {f"value_head.{k}": v for k, v in unwrapped.value_head.state_dict().items()}
    trained = {**get_peft_model_state_dict(unwrapped.policy), **value_head}
    digests = check_ranks_in_sync(trained, "LoRA adapter and value head weights")
    rank_prompts = gather_object([run.first_prompts])
    if run.frozen_digest is not None and tensor_digest(run.frozen) != run.frozen_digest:
        raise RunFailed("a frozen base weight changed during PPO: the reference model is no longer the reference")
    if not run.accelerator.is_main_process:
        return
    unwrapped.policy.save_pretrained(out)
    torch.save(unwrapped.value_head.state_dict(), out / "value_head.pt")
    run.tokenizer.save_pretrained(out)
    save_run_config(out, *run.configs)
    info = {
        "stage": "ppo",
        "resolved_model_path": run.model_path,
        "world_size": run.accelerator.num_processes,
        "n_prompts": len(run.queries),
        "resumed_from": str(run.resume) if run.resume else None,
        "rank_weight_digests": digests,
        "rank_first_prompts": rank_prompts,
        "frozen_base_digest": run.frozen_digest,
        "frozen_base_verified": run.frozen_digest is not None,
        "memory": memory_report(run.planned_peak_mb, run.step_peak),
    }
    save_run_info(out, info)
    curves = ["env/reward_mean", "objective/kl", "objective/kl_coef", "ppo/value_loss"]
    plot_curves(run.metrics.rows, curves, out / "ppo_curves.png", title=f"PPO on {run.model_args.model_name_or_path}")
    (out / "samples.md").write_text(samples_table(run.samples))
    rewards_seen = [r["env/reward_mean"] for r in run.metrics.rows]
    print(f"PPO done: reward {rewards_seen[0]:.3f} -> {rewards_seen[-1]:.3f} over {len(rewards_seen)} steps")
    print(samples_table(run.samples))


def samples_table(samples: dict) -> str:
    lines = []
    for which in ["first", "last"]:
        if which not in samples:
            continue
        lines += [f"\n### {which} step\n", "| query | response | reward |", "|---|---|---|"]
        for s in samples[which]:
            lines.append(f"| {markdown_cell(s['query'])} | {markdown_cell(s['response'])} | {s['reward']:.3f} |")
    return "\n".join(lines) + "\n"


@entrypoint
def main(argv: list[str] | None = None) -> None:
    from tqdm.auto import tqdm

    run = preflight(parse_config(CONFIG_TYPES, argv))
    args, accelerator = run.args, run.accelerator
    with staged_output_dir(args.output_dir, args.overwrite_output_dir, stage="ppo") as run.out:
        build(run)
        if run.resume is not None:
            load_checkpoint(run, run.resume)
        prepare(run)
        bar = tqdm(
            range(run.start_step, args.steps),
            desc="PPO",
            disable=not accelerator.is_main_process,
            initial=run.start_step,
            total=args.steps,
        )
        for step in bar:
            row = train_step(run, step)
            bar.set_postfix(reward=f"{row['env/reward_mean']:.3f}", kl=f"{row['objective/kl']:.3f}")
        finish(run)
    accelerator.end_training()  # closes trackers, and in accelerate 1.16 the process group: keep it last


if __name__ == "__main__":
    main()
