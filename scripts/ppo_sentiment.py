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

import json
import math
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from fitrl import ppo
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
from fitrl.distributed import check_ranks_in_sync, cpu_only, tensor_digest
from fitrl.memory import gpu_peak_mb
from fitrl.modeling import LoraArguments, ModelArguments, add_lora, load_causal_lm, load_tokenizer, resolve_model_path
from fitrl.outputs import MetricsLog, check_output_dir, plot_curves, staged_output_dir
from fitrl.sentiment import (
    PromptArguments,
    RewardArguments,
    SentimentReward,
    build_queries,
    check_reward_label,
    decode,
    generate,
    position_ids,
    response_logits,
    response_slice,
)


@dataclass
class PPOArguments:
    """The PPO algorithm and the run (defaults: TRL 0.x's, which the blog used)."""

    output_dir: str = help_field("outputs/ppo", "Where the policy adapter, value head, metrics and plots go.")
    overwrite_output_dir: bool = help_field(False, "Replace a non-empty output_dir.")
    steps: int = help_field(100, "PPO steps; each generates batch_size responses per process and learns from them.")
    batch_size: int = help_field(256, "Prompts per process per PPO step.")
    mini_batch_size: int = help_field(16, "Sequences per optimizer step within a PPO epoch.")
    gradient_accumulation_steps: int = help_field(1, "Micro-batches summed into one mini-batch's update.")
    forward_batch_size: int = help_field(16, "Sequences per no-grad forward (generation, scoring, old log-probs).")
    ppo_epochs: int = help_field(4, "Passes over each batch, in shuffled mini-batches.")
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
        for key in ["steps", "batch_size", "mini_batch_size", "gradient_accumulation_steps", "forward_batch_size",
                    "ppo_epochs", "kl_horizon"]:  # fmt: skip
            check(getattr(self, key) >= 1, key, ">= 1")
        check(self.learning_rate > 0, "learning_rate", "> 0")
        check(self.batch_size % self.mini_batch_size == 0, "batch_size",
              f"a multiple of mini_batch_size ({self.mini_batch_size})")  # fmt: skip
        check(self.mini_batch_size % self.gradient_accumulation_steps == 0, "mini_batch_size",
              f"a multiple of gradient_accumulation_steps ({self.gradient_accumulation_steps})")  # fmt: skip
        check(0 < self.cliprange < 1 and self.cliprange_value > 0, "cliprange", "in (0, 1), cliprange_value > 0")
        check(0 <= self.lam <= 1 and 0 <= self.gamma <= 1, "lam", "in [0, 1] (and gamma too)")
        check(self.init_kl_coef >= 0 and self.target_kl > 0, "init_kl_coef", ">= 0 (and target_kl > 0)")
        check(self.save_steps >= 0 and self.max_grad_norm >= 0, "save_steps", ">= 0 (and max_grad_norm >= 0)")
        check(self.score_clip is None or self.score_clip > 0, "score_clip", "empty or > 0")


CONFIG_TYPES = [ModelArguments, LoraArguments, PromptArguments, RewardArguments, PPOArguments]


class PolicyAndValue(nn.Module):
    """The LoRA policy and the value head as one module, so DDP averages both sets of gradients."""

    def __init__(self, policy: nn.Module, hidden_size: int):
        super().__init__()
        self.policy = policy
        self.value_head = nn.Linear(hidden_size, 1)  # fp32 whatever the backbone's dtype
        nn.init.normal_(self.value_head.weight, std=1 / math.sqrt(hidden_size + 1))
        nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.policy(input_ids=input_ids, attention_mask=attention_mask,
                          position_ids=position_ids(attention_mask), output_hidden_states=True)  # fmt: skip
        values = self.value_head(out.hidden_states[-1].float()).squeeze(-1)  # (B, T)
        return out.logits, values


def batch_queries(queries: list[list[int]], step: int, rank: int, world: int, size: int, seed: int) -> list[int]:
    """Indices of this rank's prompts at `step`: a seeded permutation per epoch, disjoint across ranks."""
    indices = []
    for j in range(size):
        pos = (step * world + rank) * size + j
        epoch, k = divmod(pos, len(queries))
        perm = torch.randperm(len(queries), generator=torch.Generator().manual_seed(seed * 7919 + epoch))
        indices.append(int(perm[k]))
    return indices


def checkpoint_root(args: PPOArguments) -> Path:
    return Path(args.output_dir).expanduser().absolute().with_name(Path(args.output_dir).name + ".checkpoints")


def latest_checkpoint(args: PPOArguments) -> Path | None:
    found = [p for p in checkpoint_root(args).glob("step-*") if p.name.split("-")[1].isdigit()]
    return max(found, key=lambda p: int(p.name.split("-")[1]), default=None)


def stopped(reason: str, step: int, args: PPOArguments) -> RunFailed:
    """The error for a run that cannot go on: it names the checkpoint to resume from, if any."""
    latest = latest_checkpoint(args)
    kept = f"the last checkpoint, {latest}, is kept" if latest else "no checkpoint was saved yet"
    return RunFailed(f"{reason} at step {step}; {kept}; lower learning_rate or clip scores (score_clip)")


def find_checkpoint(args: PPOArguments) -> Path | None:
    if args.resume_from_checkpoint is None:
        return None
    if args.resume_from_checkpoint == "latest":
        latest = latest_checkpoint(args)
        if latest is None:
            raise UsageError(f"no checkpoint to resume in {checkpoint_root(args)}; drop --resume_from_checkpoint")
        return latest
    path = Path(args.resume_from_checkpoint).expanduser()
    if not (path / "trainer_state.json").is_file():
        raise UsageError(f"{path} is not a PPO checkpoint (no trainer_state.json)")
    return path


@entrypoint
def main(argv: list[str] | None = None) -> None:
    model_args, lora_args, prompt_args, reward_args, args = parse_config(CONFIG_TYPES, argv)

    # Pre-flight: everything a user can get wrong is checked before the backbone loads.
    check_output_dir(args.output_dir, args.overwrite_output_dir)
    resume = find_checkpoint(args)
    check_reward_label(resolve_model_path(reward_args.reward_model, model_args.demo_cache_dir, "reward model"),
                       reward_args.positive_label)  # fmt: skip
    model_path = resolve_model_path(model_args.model_name_or_path, model_args.demo_cache_dir)
    tokenizer = load_tokenizer(model_path, model_args.trust_remote_code)
    queries = build_queries(tokenizer, prompt_args, model_args.demo_cache_dir, args.seed)
    if len(queries) < args.batch_size:
        raise UsageError(f"only {len(queries)} prompts for batch_size {args.batch_size}; lower batch_size")

    from accelerate import Accelerator
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import load_file
    from tqdm.auto import tqdm

    accelerator = Accelerator(cpu=cpu_only(), gradient_accumulation_steps=args.gradient_accumulation_steps,
                              log_with=None if args.report_to == "none" else args.report_to)  # fmt: skip
    rank, world, device = accelerator.process_index, accelerator.num_processes, accelerator.device

    with staged_output_dir(args.output_dir, args.overwrite_output_dir) as out:
        backbone = load_causal_lm(model_args, path=model_path, gradient_checkpointing=args.gradient_checkpointing,
                                  pad_token_id=tokenizer.pad_token_id)  # fmt: skip
        torch.manual_seed(args.seed)  # the same fresh adapter and value head on every rank
        model = PolicyAndValue(add_lora(backbone, lora_args), backbone.config.hidden_size)
        model.value_head.to(device)  # the backbone is already placed (device_map) or moved by prepare()
        frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
        frozen_digest = tensor_digest(frozen) if args.verify_frozen_base else None
        params = [p for p in model.parameters() if p.requires_grad]
        if args.optimizer == "adamw_8bit":
            import bitsandbytes as bnb

            optimizer = bnb.optim.AdamW8bit(params, lr=args.learning_rate)
        else:
            optimizer = torch.optim.AdamW(params, lr=args.learning_rate)
        reward = SentimentReward(reward_args, model_args.demo_cache_dir, device)
        kl_ctl = (ppo.AdaptiveKLController(args.init_kl_coef, args.target_kl, args.kl_horizon) if args.adaptive_kl
                  else ppo.FixedKLController(args.init_kl_coef))  # fmt: skip
        score_stats = ppo.RunningMoments()
        metrics = MetricsLog(out, enabled=accelerator.is_main_process)
        start_step, samples = 0, {}
        if resume is not None:  # weights before DDP wraps them; optimizer state after
            set_peft_model_state_dict(model.policy, load_file(resume / "adapter" / "adapter_model.safetensors"))
            model.value_head.load_state_dict(torch.load(resume / "value_head.pt", map_location=device))
            state = json.loads((resume / "trainer_state.json").read_text())
            start_step, samples = state["step"], state["samples"]
            kl_ctl.load_state_dict(state["kl_controller"])
            score_stats.load_state_dict(state["score_stats"])
            for row in state["metrics"]:
                metrics.log(row)
        model, optimizer = accelerator.prepare(model, optimizer)
        if resume is not None:
            optimizer.load_state_dict(torch.load(resume / "optimizer.pt", map_location=device, weights_only=False))
        unwrapped = accelerator.unwrap_model(model)
        if args.report_to != "none":  # trackers take scalars: lists become strings, empties are dropped
            flat = config_dict(model_args, lora_args, prompt_args, reward_args, args)
            accelerator.init_trackers("fitrl-ppo", {k: str(v) if isinstance(v, list) else v
                                                    for k, v in flat.items() if v is not None})  # fmt: skip
        warned_negative_kl = False
        first_prompts = None
        bar = tqdm(range(start_step, args.steps), desc="PPO", disable=not accelerator.is_main_process,
                   initial=start_step, total=args.steps)  # fmt: skip
        for step in bar:
            # Every draw of the step (lengths, sampling, shuffles, dropout) comes from (seed, step, rank),
            # so a run resumed from a checkpoint makes exactly the draws of an uninterrupted one.
            torch.manual_seed(args.seed * 1_000_003 + step * 1009 + rank)
            idx = batch_queries(queries, step, rank, world, args.batch_size, args.seed)
            first_prompts = first_prompts or idx[:4]
            lengths = torch.randint(prompt_args.response_min_tokens, prompt_args.response_max_tokens + 1,
                                    (args.batch_size,)).tolist()  # fmt: skip
            timings, t0 = {}, time.perf_counter()

            # 1. Rollout: batched generation from the current policy.
            chunks = [slice(c, c + args.forward_batch_size) for c in range(0, args.batch_size, args.forward_batch_size)]
            rollouts = [generate(unwrapped.policy, tokenizer, [queries[i] for i in idx[c]], lengths[c],
                                 prompt_args.stop_at_eos, device) for c in chunks]  # fmt: skip
            timings["time/generate"] = time.perf_counter() - t0

            # 2. Score: the classifier reads the decoded text with its own tokenizer.
            t0 = time.perf_counter()
            texts = [decode(tokenizer, r) for r in rollouts]
            q_texts = [q for qs, _ in texts for q in qs]
            r_texts = [r for _, rs in texts for r in rs]
            raw_scores = reward([q + r for q, r in zip(q_texts, r_texts)]).to(device)  # (B,)
            if not torch.isfinite(raw_scores).all():
                raise stopped("non-finite reward", step + 1, args)
            scores = raw_scores
            if args.score_scaling != "none":
                score_stats.update(accelerator.gather(raw_scores).cpu())
                shift = score_stats.mean if args.score_scaling == "normalize" else 0.0
                scores = (raw_scores - shift) / (score_stats.std + 1e-8)
            if args.score_clip is not None:
                scores = scores.clamp(-args.score_clip, args.score_clip)
            timings["time/score"] = time.perf_counter() - t0

            # 3. One no-grad pass for old log-probs, values and (adapter off) reference log-probs, in eval
            #    mode: dropout here would make the first PPO ratio differ from 1 for no reason.
            t0 = time.perf_counter()
            unwrapped.eval()
            batch = []
            with torch.no_grad():
                for r in rollouts:
                    logits, values = unwrapped(r.input_ids, r.attention_mask)
                    with unwrapped.policy.disable_adapter():
                        ref_logits = response_logits(unwrapped.policy, r).logits
                    logits, ref_logits = response_slice(logits, r), response_slice(ref_logits, r)  # (B, R, V)
                    tokens = r.input_ids[:, r.query_len :]
                    logprobs = ppo.logprobs_from_logits(logits, tokens)  # (B, R)
                    ref_logprobs = ppo.logprobs_from_logits(ref_logits, tokens)
                    kl = ppo.kl_penalty(logprobs, ref_logprobs, args.kl_estimator, logits, ref_logits)
                    entropy = ppo.entropy_from_logits(logits)
                    batch.append((r, logprobs, response_slice(values, r), kl, entropy))
            # All rollouts padded to one response width, so the batch can be shuffled as one tensor.
            width = max(r.response_mask.shape[1] for r, *_ in batch)
            qwidth = max(r.query_len for r, *_ in batch)
            ids, attn, mask, old_logprobs, old_values, kl, entropy = _stack(batch, width, qwidth,
                                                                            tokenizer.pad_token_id)  # fmt: skip
            rewards, non_score = ppo.per_token_rewards(scores, kl, mask, kl_ctl.value)
            if args.whiten_rewards:
                rewards = ppo.masked_whiten(rewards, mask, shift_mean=False)
            advantages, returns = ppo.gae(old_values, rewards, mask, args.gamma, args.lam)
            advantages = ppo.masked_whiten(advantages, mask)
            timings["time/forward"] = time.perf_counter() - t0

            # 4. Optimise: ppo_epochs passes of shuffled mini-batches, accumulated micro-batches.
            t0 = time.perf_counter()
            model.train()
            stats: dict[str, list[float]] = {k: [] for k in ["pg_loss", "vf_loss", "clipfrac", "vf_clipfrac",
                                                              "approx_kl", "ratio", "skipped"]}  # fmt: skip
            micro = args.mini_batch_size // args.gradient_accumulation_steps
            for _epoch in range(args.ppo_epochs):
                perm = torch.randperm(args.batch_size)
                for m in range(0, args.batch_size, args.mini_batch_size):
                    for u in range(m, m + args.mini_batch_size, micro):
                        rows = perm[u : u + micro]
                        with accelerator.accumulate(model):
                            logits, values = model(ids[rows], attn[rows])
                            logits, values = logits[:, qwidth - 1 : -1], values[:, qwidth - 1 : -1]
                            logprobs = ppo.logprobs_from_logits(logits, ids[rows, qwidth:])
                            pg = ppo.policy_loss(logprobs, old_logprobs[rows], advantages[rows], mask[rows],
                                                 args.cliprange)  # fmt: skip
                            vf_loss, vf_clip = ppo.value_loss(values, old_values[rows], returns[rows], mask[rows],
                                                              args.cliprange_value)  # fmt: skip
                            loss = pg.loss + args.vf_coef * vf_loss
                            skipped = pg.ratio_mean.item() > args.ratio_threshold
                            if skipped:  # a wildly off-policy batch: keep DDP in step, learn nothing from it
                                loss = loss * 0.0
                            if not torch.isfinite(loss):
                                raise stopped("non-finite loss", step + 1, args)
                            accelerator.backward(loss)
                            if accelerator.sync_gradients and args.max_grad_norm > 0:
                                accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                            optimizer.step()
                            optimizer.zero_grad()
                        for k, v in [("pg_loss", pg.loss), ("vf_loss", vf_loss), ("clipfrac", pg.clipfrac),
                                     ("vf_clipfrac", vf_clip), ("approx_kl", pg.approx_kl), ("ratio", pg.ratio_mean),
                                     ("skipped", float(skipped))]:  # fmt: skip
                            stats[k].append(float(v))
                if args.early_stopping:  # decided on the mean over ranks, so all ranks stop together
                    policy_kl = accelerator.reduce(torch.tensor(stats["approx_kl"][-1], device=device), "mean")
                    if policy_kl > 1.5 * args.target_policy_kl:
                        break
            timings["time/optimise"] = time.perf_counter() - t0

            # 5. Bookkeeping: KL controller, metrics, samples, checkpoint.
            mean_kl = accelerator.reduce((kl * mask).sum(1).mean(), "mean").item()
            kl_ctl.update(mean_kl, args.batch_size * world)
            all_scores = accelerator.gather(raw_scores)
            local = torch.tensor([ppo.masked_mean(entropy, mask).item(), (non_score.sum(1)).mean().item(),
                                  mask.sum(1).float().mean().item(),
                                  ppo.explained_variance(old_values, returns, mask)], device=device)  # fmt: skip
            ent, non_score_mean, resp_len, expl_var = accelerator.reduce(local, "mean").tolist()
            n_tokens = mask.sum().item() * world
            row = {"step": step + 1, "env/reward_mean": all_scores.mean().item(),
                   "env/reward_std": all_scores.std().item() if len(all_scores) > 1 else 0.0,
                   "objective/kl": mean_kl, "objective/kl_coef": kl_ctl.value, "objective/entropy": ent,
                   "objective/non_score_reward": non_score_mean, "ppo/policy_loss": _avg(stats["pg_loss"]),
                   "ppo/value_loss": _avg(stats["vf_loss"]), "ppo/clipfrac": _avg(stats["clipfrac"]),
                   "ppo/value_clipfrac": _avg(stats["vf_clipfrac"]), "ppo/approx_kl": _avg(stats["approx_kl"]),
                   "ppo/ratio_mean": _avg(stats["ratio"]), "ppo/skipped_batches": sum(stats["skipped"]),
                   "ppo/explained_variance": expl_var, "env/response_length": resp_len, **timings,
                   "tokens_per_second": n_tokens / max(sum(timings.values()), 1e-9),
                   "memory/gpu_peak_mb": gpu_peak_mb()}  # fmt: skip
            metrics.log(row)
            accelerator.log({k: v for k, v in row.items() if isinstance(v, (int, float))}, step=step + 1)
            bar.set_postfix(reward=f"{row['env/reward_mean']:.3f}", kl=f"{mean_kl:.3f}")
            if mean_kl < -1 and not warned_negative_kl and accelerator.is_main_process:
                warned_negative_kl = True
                warnings.warn(
                    f"KL to the reference is strongly negative ({mean_kl:.2f}) at step {step + 1}: the "
                    "sampling does not match the policy (check top_k/top_p, EOS, padding)",
                    stacklevel=1,
                )
            for which, at in [("first", 0), ("last", args.steps - 1)]:
                if step == at:
                    samples[which] = [{"query": q, "response": r, "reward": round(s, 3)} for q, r, s in
                                      zip(q_texts, r_texts, raw_scores.tolist())][: args.log_samples]  # fmt: skip
            if args.save_steps and (step + 1) % args.save_steps == 0:
                save_checkpoint(accelerator, unwrapped, optimizer, checkpoint_root(args) / f"step-{step + 1}",
                                {"step": step + 1, "kl_controller": kl_ctl.state_dict(), "samples": samples,
                                 "score_stats": score_stats.state_dict(), "metrics": metrics.rows})  # fmt: skip

        # Every rank must end with the same policy and value head: check, don't assume.
        trained = {**get_peft_model_state_dict(unwrapped.policy),
                   **{f"value_head.{k}": v for k, v in unwrapped.value_head.state_dict().items()}}  # fmt: skip
        digests = check_ranks_in_sync(trained, "LoRA adapter and value head weights")
        from accelerate.utils import gather_object

        rank_prompts = gather_object([first_prompts])
        if frozen_digest is not None and tensor_digest(frozen) != frozen_digest:
            raise RunFailed("a frozen base weight changed during PPO: the reference model is no longer the reference")
        if accelerator.is_main_process:
            unwrapped.policy.save_pretrained(out)
            torch.save(unwrapped.value_head.state_dict(), out / "value_head.pt")
            tokenizer.save_pretrained(out)
            save_run_config(out, model_args, lora_args, prompt_args, reward_args, args)
            save_run_info(out, {"stage": "ppo", "resolved_model_path": model_path, "world_size": world,
                                "n_prompts": len(queries), "resumed_from": str(resume) if resume else None,
                                "rank_weight_digests": digests, "rank_first_prompts": rank_prompts,
                                "frozen_base_digest": frozen_digest,
                                "frozen_base_verified": frozen_digest is not None})  # fmt: skip
            plot_curves(metrics.rows, ["env/reward_mean", "objective/kl", "objective/kl_coef", "ppo/value_loss"],
                        out / "ppo_curves.png", title=f"PPO on {model_args.model_name_or_path}")  # fmt: skip
            (out / "samples.md").write_text(samples_table(samples))
            rewards_seen = [r["env/reward_mean"] for r in metrics.rows]
            print(f"PPO done: reward {rewards_seen[0]:.3f} -> {rewards_seen[-1]:.3f} over {len(rewards_seen)} steps")
            print(samples_table(samples))
    accelerator.end_training()  # closes trackers, and in accelerate 1.16 the process group: keep it last


def _avg(xs: list[float]) -> float:
    return sum(xs) / max(len(xs), 1)


def _stack(batch: list, width: int, qwidth: int, pad: int) -> tuple[torch.Tensor, ...]:
    """Pad every rollout chunk to one (query, response) layout and concatenate along the batch."""
    cols: list[list[torch.Tensor]] = [[] for _ in range(7)]
    for r, logprobs, values, kl, entropy in batch:
        qpad, rpad = qwidth - r.query_len, width - r.response_mask.shape[1]
        ids = nn.functional.pad(r.input_ids, (qpad, rpad), value=pad)
        attn = nn.functional.pad(r.attention_mask, (qpad, rpad), value=0)
        per_token = [nn.functional.pad(t, (0, rpad)) for t in (r.response_mask.float(), logprobs, values, kl, entropy)]
        for col, t in zip(cols, [ids, attn, *per_token]):
            col.append(t)
    return tuple(torch.cat(c) for c in cols)


def save_checkpoint(accelerator, unwrapped: PolicyAndValue, optimizer, path: Path, state: dict) -> None:
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        staging = path.with_name(path.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        unwrapped.policy.save_pretrained(staging / "adapter")
        torch.save(unwrapped.value_head.state_dict(), staging / "value_head.pt")
        torch.save(optimizer.state_dict(), staging / "optimizer.pt")
        (staging / "trainer_state.json").write_text(json.dumps(state))
        shutil.rmtree(path, ignore_errors=True)
        staging.rename(path)
    accelerator.wait_for_everyone()


def samples_table(samples: dict) -> str:
    lines = []
    for which in ["first", "last"]:
        if which not in samples:
            continue
        lines += [f"\n### {which} step\n", "| query | response | reward |", "|---|---|---|"]
        for s in samples[which]:
            q, r = (x.replace("|", "\\|").replace("\n", " ") for x in (s["query"], s["response"]))
            lines.append(f"| {q} | {r} | {s['reward']:.3f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
