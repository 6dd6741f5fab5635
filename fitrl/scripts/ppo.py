"""Stage 3 of the RLHF pipeline: PPO with LoRA on one 8-bit backbone, against a sentiment reward.

One copy of the merged model sits in memory, in 8-bit. A fresh LoRA adapter on it is the **policy**;
the same forward with the adapter disabled gives the **reference** log-probs (no second copy); a small
fp32 **value head** reads the policy's last hidden state; the **reward** is a sentiment classifier's
score of query + response. The maths (GAE, whitening, KL, clipped losses) is in `fitrl.ppo`.

    accelerate launch scripts/ppo.py --config configs/demo/ppo.yaml          # CPU, minutes
    accelerate launch scripts/ppo.py --config configs/neox20b-24gb/ppo.yaml  # one 24 GB GPU
    accelerate launch --multi_gpu --num_processes 2 scripts/ppo.py --config ...
    # continue a killed run
    accelerate launch scripts/ppo.py --config ... --resume_from_checkpoint latest

Writes to `output_dir`: the policy adapter, `value_head.safetensors`, `run_config.yaml`, `run_info.json`,
`metrics.jsonl`, `ppo_curves.png` and `samples.md`. Checkpoints go to `<output_dir>.checkpoints/`,
outside the staged output, so that a stopped run keeps them.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fitrl import checkpoints, ppo, signals
from fitrl.adapter_reward import AdapterReward, SeparateAdapterReward
from fitrl.checkpoints import (
    STATE_FILE,
    checkpoint_root,
    load_safetensors,
    load_state,
    resume_checkpoint,
)
from fitrl.config import RunFailed, Terminated, UsageError, config_dict, save_run_config
from fitrl.demo import DemoArguments
from fitrl.distributed import cpu_only, sharded_launch, tensor_digest
from fitrl.ending import TrainingEnd, finish_training, samples_markdown
from fitrl.guards import (
    GradientGuard,
    HackingGuard,
    Health,
    Monitors,
    check_prompt_length,
    check_reference,
    check_reward_signal,
    check_reward_tokenizer,
    check_trainable,
    repetition,
)
from fitrl.hub import push_output
from fitrl.memory import StepPeak, gpu_peak_mb, memory_report, optimizer_state_tensors, tensor_bytes
from fitrl.modeling import (
    LoraArguments,
    ModelArguments,
    add_lora,
    load_causal_lm,
    load_tokenizer,
    resolve_model_path,
)
from fitrl.outputs import MetricsLog, check_output_dir, staged_output_dir, staging_dir
from fitrl.planner import planned_peak_mb
from fitrl.ppo_step import Experience, PolicyAndValue, UpdateStats, make_experience, ppo_update
from fitrl.process import entrypoint
from fitrl.rollout import (
    Rollout,
    decode,
    generation_batch,
    sample_responses,
)
from fitrl.sentiment import (
    FunctionReward,
    PromptArguments,
    RewardArguments,
    SentimentJudge,
    SentimentReward,
    build_queries,
    check_judge,
    check_reward,
    load_reward,
)
from fitrl.stages.ppo import STAGE, PPOArguments, monitors


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
    prompts: str = ""  # what became of the prompt rows (`Queries.summary`)
    stop_at_eos: bool = False  # a response ends at EOS (`PromptArguments.stops_at_eos`)
    sentence_ends: torch.Tensor | None = None  # with response_end: sentence, the tokens a response is cut after
    reward_base: str | None = None  # the base a reward adapter is loaded on by itself (None: the policy's)
    out: Path | None = None
    model: Any = None  # PolicyAndValue, wrapped by accelerate (DDP) after prepare()
    unwrapped: Any = None  # PolicyAndValue itself
    optimizer: Any = None
    reward: SentimentReward | AdapterReward | SeparateAdapterReward | FunctionReward | None = None
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
    health: Health = dataclasses.field(default_factory=Health)  # what the guards saw
    gradients: GradientGuard | None = None
    monitors: Monitors | None = None  # the in-run guards on each step's metrics
    judge: SentimentJudge | None = None  # the reward-hacking guard's second opinion (guard_judge_model)
    judge_queries: list[list[int]] = dataclasses.field(default_factory=list)  # its held-out prompts
    hacking: HackingGuard | None = None

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    @property
    def configs(self) -> tuple[Any, ...]:
        return (self.model_args, self.lora_args, self.prompt_args, self.reward_args, self.args, self.demo_args)


def reward_tensors(reward: Any) -> list[torch.Tensor]:
    """The scorer's own tensors, beside the policy's: a reward model's, or a reward adapter's head."""
    module = getattr(reward, "model", None)
    module = getattr(reward, "head", None) if module is None else module
    return [] if module is None else [*module.parameters(), *module.buffers()]


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


def stopped(reason: str, step: int, args: PPOArguments) -> Exception:
    """The error for a run that cannot go on: it names the checkpoint to resume from, if any."""
    fix = "lower learning_rate or clip scores (score_clip)"
    return checkpoints.stopped(reason, step, args.output_dir, STAGE.checkpoint_prefix, fix)


# --- setup ----------------------------------------------------------------------------------------


def preflight(configs: tuple[Any, ...]) -> Run:
    """Everything a user can get wrong, checked before the backbone loads."""
    model_args, lora_args, prompt_args, reward_args, args, demo_args = configs
    cache = demo_args.demo_assets
    reward = reward_args.reward_adapter or reward_args.reward_model
    inputs = [model_args.model_name_or_path, prompt_args.dataset, args.resume_from_checkpoint]
    inputs += [] if reward_args.reward_function else [reward]
    check_output_dir(args.output_dir, args.overwrite_output_dir, inputs, demo_args.demo_assets)
    resume = resume_checkpoint(
        args.resume_from_checkpoint, args.output_dir, STAGE.checkpoint_prefix, "PPO", config_dict(*configs)
    )
    if sharding := sharded_launch():
        raise UsageError(
            f"PPO does not run under {sharding}: its policy, reference, value head and reward adapter share one "
            "backbone that sharding would split; launch on one device or with DDP (configs/accelerate/"
            "single_gpu.yaml, ddp_2gpu.yaml)"
        )
    model_path = resolve_model_path(model_args.model_name_or_path, cache)
    reward_base = check_reward(reward_args, model_args.model_name_or_path, model_path, cache)
    tokenizer = load_tokenizer(model_path, model_args.trust_remote_code)
    queries = build_queries(tokenizer, prompt_args, cache, args.seed)
    if len(queries) < args.batch_size:
        raise UsageError(f"only {len(queries)} prompts for batch_size {args.batch_size}; lower batch_size")

    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    # A tracker writes from the first step: into the staged output, so its logs end up in `<output_dir>/runs`.
    logs = ProjectConfiguration(
        project_dir=str(args.output_dir), logging_dir=str(staging_dir(args.output_dir) / "runs")
    )
    accelerator = Accelerator(
        cpu=cpu_only(),
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        log_with=None if args.report_to == "none" else args.report_to,
        project_config=logs,
    )
    run = Run(*configs, accelerator, model_path, tokenizer, queries.ids, resume)
    run.reward_base = reward_base
    run.prompts = queries.summary(prompt_args)
    run.stop_at_eos = prompt_args.stops_at_eos(queries.chat)
    run.sentence_ends = prompt_args.sentence_ends(tokenizer)
    if accelerator.is_main_process:
        print(f"PPO: {run.prompts}")
    if prompt_args.prompt_shaping == "whole":
        check_prompt_length(queries.long, queries.rows - queries.short, prompt_args.max_prompt_tokens, run.health,
                            queries.cut)  # fmt: skip
    else:
        longest = prompt_args.longest_query
        run.health.passed("prompt_length", f"prompt_shaping prefix: queries of at most {longest} tokens")
    run.judge_queries = judge_queries(run)
    run.planned_peak_mb = planned_peak_mb(STAGE, configs, model_path, accelerator.num_processes)
    return run


def build(run: Run) -> None:
    """The reward (first: a bad one should not cost a backbone load), the backbone, a fresh LoRA policy
    and value head, the optimizer and KL controller."""
    args, reward_args = run.args, run.reward_args
    if run.reward_base is not None:
        run.reward = SeparateAdapterReward(run.reward_base, reward_args, run.device)
        if run.accelerator.is_main_process:
            print(f"PPO: reward adapter {reward_args.reward_adapter} loaded on its own copy of {run.reward_base}, "
                  f"{tensor_bytes(reward_tensors(run.reward)) / 2**20:.1f} MiB beside the policy")  # fmt: skip
    elif not reward_args.reward_adapter:
        run.reward = load_reward(reward_args, run.demo_args.demo_assets, run.device)
    backbone = load_causal_lm(
        run.model_args,
        path=run.model_path,
        gradient_checkpointing=args.gradient_checkpointing,
        pad_token_id=run.tokenizer.pad_token_id,
    )
    torch.manual_seed(args.seed)  # the same fresh adapter and value head on every rank
    model = PolicyAndValue(add_lora(backbone, run.lora_args), backbone.config.hidden_size)
    model.value_head.to(run.device)  # the backbone is already placed (device_map) or moved by prepare()
    if reward_args.reward_adapter and run.reward_base is None:  # a second adapter and a head on this backbone
        run.reward = AdapterReward(
            model.policy, run.reward_args.reward_adapter, run.tokenizer, run.reward_args.reward_batch_size
        )
    if run.judge_queries:
        run.judge = SentimentJudge(
            args.guard_judge_model, args.guard_judge_positive_label, run.demo_args.demo_assets, run.device
        )
    run.frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    run.frozen_digest = tensor_digest(run.frozen) if args.verify_frozen_base else None
    params = [p for p in model.parameters() if p.requires_grad]
    if args.optimizer == "adamw_8bit":
        import bitsandbytes as bnb

        run.optimizer = bnb.optim.AdamW8bit(params, lr=args.learning_rate)
    else:
        run.optimizer = torch.optim.AdamW(params, lr=args.learning_rate)
    if args.adaptive_kl:
        run.kl_ctl = ppo.AdaptiveKLController(args.init_kl_coef, args.target_kl, args.kl_horizon)
    else:
        run.kl_ctl = ppo.FixedKLController(args.init_kl_coef)
    run.score_stats = ppo.RunningMoments()
    run.metrics = MetricsLog(run.out, enabled=run.accelerator.is_main_process)
    run.unwrapped = model


VALUE_HEAD = "value_head.safetensors"  # tensors only: it loads without pickle


def save_value_head(model: PolicyAndValue, directory: Path) -> None:
    from safetensors.torch import save_file

    save_file(
        {k: v.detach().contiguous().cpu() for k, v in model.value_head.state_dict().items()}, directory / VALUE_HEAD
    )


def load_checkpoint(run: Run, path: Path) -> None:
    """Weights and run state from `path` (before DDP wraps the model); the optimizer state after."""
    from peft import set_peft_model_state_dict

    adapter = load_safetensors(path / "adapter" / "adapter_model.safetensors", path)
    set_peft_model_state_dict(run.unwrapped.policy, adapter)
    run.unwrapped.value_head.load_state_dict(load_safetensors(path / VALUE_HEAD, path))
    state = json.loads((path / STATE_FILE).read_text())
    run.start_step, run.samples = state["step"], state["samples"]
    run.kl_ctl.load_state_dict(state["kl_controller"])
    run.score_stats.load_state_dict(state["score_stats"])
    for row in state["metrics"]:
        run.metrics.log(row)


def save_checkpoint(run: Run, step: int) -> None:
    """Adapter, value head, optimizer and run state to `step-N/`, written aside and renamed into place."""
    path = checkpoint_root(run.args.output_dir) / f"{STAGE.checkpoint_prefix}-{step}"
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
        run.unwrapped.policy.save_pretrained(staging / "adapter", selected_adapters=["default"])
        save_value_head(run.unwrapped, staging)
        torch.save(run.optimizer.state_dict(), staging / "optimizer.pt")
        (staging / STATE_FILE).write_text(json.dumps(state))
        save_run_config(staging, *run.configs)
        shutil.rmtree(path, ignore_errors=True)
        staging.rename(path)
    run.accelerator.wait_for_everyone()


def prepare(run: Run) -> None:
    """Wrap for DDP (where launched so), restore the optimizer state, check there is something to
    train, start the trackers."""
    run.model, run.optimizer = run.accelerator.prepare(run.unwrapped, run.optimizer)
    if run.resume is not None:
        run.optimizer.load_state_dict(load_state(run.resume / "optimizer.pt", run.device))
    run.unwrapped = run.accelerator.unwrap_model(run.model)
    run.health.strict = run.args.strict_guards
    check_trainable(run.unwrapped, run.health)
    run.gradients = GradientGuard(run.health)
    run.monitors = Monitors(run.health, monitors(run.args))
    if run.judge is not None:
        advice = "check what the reward model pays for, or raise init_kl_coef"
        run.hacking = HackingGuard(
            run.health, "the judge's mean verdict", run.args.guard_judge_drop, advice, share=False
        )
    if run.args.report_to != "none":  # trackers take scalars: lists become strings, empties are dropped
        flat = config_dict(*run.configs)
        hparams = {k: str(v) if isinstance(v, list) else v for k, v in flat.items() if v is not None}
        run.accelerator.init_trackers("fitrl-ppo", hparams)


def judge_queries(run: Run) -> list[list[int]]:
    """The held-out prompts the reward-hacking guard's judge reads responses to (none: that guard is off)."""
    args, prompt_args = run.args, run.prompt_args
    if not args.guard_judge_model:
        run.health.passed("reward_hacking", "not run: no guard_judge_model")
        return []
    if Path(prompt_args.dataset).expanduser().is_file():  # one file is one split: nothing held out
        run.health.passed("reward_hacking", "not run: one prompt file has no held-out split (give a directory)")
        return []
    check_judge(args.guard_judge_model, args.guard_judge_positive_label, run.demo_args.demo_assets)
    heldout = dataclasses.replace(
        prompt_args, dataset_split=args.guard_judge_split, max_prompts=args.guard_judge_prompts
    )
    try:
        return build_queries(run.tokenizer, heldout, run.demo_args.demo_assets, args.seed).ids
    except UsageError as e:
        raise UsageError(f"{e}; set guard_judge_split to a held-out split, or leave guard_judge_model empty") from None


def judge_reading(run: Run, step: int) -> float:
    """The judge's mean verdict on the policy's responses to the held-out prompts: the same prompts,
    lengths and sampling seed at every reading, so only the policy changes between them."""
    args, low, high = run.args, run.prompt_args.response_min_tokens, run.prompt_args.response_max_tokens
    torch.manual_seed(args.seed)
    lengths = torch.randint(low, high + 1, (len(run.judge_queries),)).tolist()
    size = generation_batch(args.generation_batch_size, args.forward_batch_size, args.batch_size)
    texts = []
    for c in range(0, len(run.judge_queries), size):
        part = sample_responses(
            run.unwrapped.policy,
            run.tokenizer,
            run.judge_queries[c : c + size],
            lengths[c : c + size],
            run.stop_at_eos,
            run.device,
            sentence_ends=run.sentence_ends,
        )
        texts += [q + r for qs, rs in [decode(run.tokenizer, part)] for q, r in zip(qs, rs)]
    verdict = run.judge(texts).mean().item()
    run.hacking.score(step, verdict)
    return verdict


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
            run.stop_at_eos,
            run.device,
            keep_policy=keep_policy,
            sentence_ends=run.sentence_ends,
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
    if step == 0:
        with run.health.timed():
            check_reward_tokenizer(
                [q + r for q, r in zip(q_texts, r_texts)], run.tokenizer, run.reward.tokenizer, run.health
            )
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


def log_step(
    run: Run,
    step: int,
    exp: Experience,
    non_score: torch.Tensor,
    raw_scores: torch.Tensor,
    stats: UpdateStats,
    timings: dict[str, float],
    judged: float | None = None,
) -> dict[str, Any]:
    """Phase 5: update the KL controller, and log the step's metrics reduced over ranks (`judged`: the
    reward-hacking guard's reading, when this step made one)."""
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
            response_repetition(exp, run.health),
        ],
        device=run.device,
    )
    ent, non_score_mean, resp_len, expl_var, repeated = accelerator.reduce(local, "mean").tolist()
    n_tokens = mask.sum().item() * world
    row = {
        "step": step + 1,
        "env/reward_mean": all_scores.mean().item(),
        "env/reward_std": all_scores.std().item() if len(all_scores) > 1 else 0.0,
        "objective/kl": mean_kl,
        "objective/kl_coef": run.kl_ctl.value,
        "objective/entropy": ent,
        "objective/non_score_reward": non_score_mean,
        "ppo/policy_loss": stats.pg_loss,
        "ppo/value_loss": stats.vf_loss,
        "ppo/clipfrac": stats.clipfrac,
        "ppo/value_clipfrac": stats.vf_clipfrac,
        "ppo/approx_kl": stats.approx_kl,
        "ppo/ratio_mean": stats.ratio,
        "ppo/skipped_batches": stats.skipped,
        "ppo/explained_variance": expl_var,
        "env/response_length": resp_len,
        "env/repetition": repeated,
        **({"heldout/judge_mean": judged} if judged is not None else {}),
        **timings,
        "tokens_per_second": n_tokens / max(sum(timings.values()), 1e-9),
        "memory/gpu_peak_mb": gpu_peak_mb(),
    }
    run.metrics.log(row)
    run.monitors(row, step + 1)
    if run.hacking is not None:
        run.hacking.reward(row["env/reward_mean"])
    accelerator.log({k: v for k, v in row.items() if isinstance(v, (int, float))}, step=step + 1)
    return row


def response_repetition(exp: Experience, health: Health) -> float:
    """The responses' repeated 3-gram share (`fitrl.guards.repetition`); 0 when none is long enough."""
    with health.timed():
        responses = exp.input_ids[:, exp.query_len :]
        value = repetition([ids[m.bool()].tolist() for ids, m in zip(responses, exp.response_mask)])
    return 0.0 if value != value else value


def keep_samples(run: Run, step: int, q_texts: list[str], r_texts: list[str], raw_scores: torch.Tensor) -> None:
    for which, at in [("first", 0), ("last", run.args.steps - 1)]:
        if step == at:
            rows = zip(q_texts, r_texts, raw_scores.tolist())
            run.samples[which] = [{"query": q, "response": r, "reward": round(s, 3)} for q, r, s in rows][
                : run.args.log_samples
            ]


def first_step_guards(run: Run, exp: Experience, raw_scores: torch.Tensor) -> None:
    """Before any update the policy is its reference (KL ~0), and the reward of the batch is not constant."""
    mask = exp.response_mask
    kl = run.accelerator.reduce((exp.kl * mask).sum() / mask.sum().clamp(min=1), "mean").item()
    check_reference(kl, run.health, 1)
    check_reward_signal(run.accelerator.gather(raw_scores).cpu(), run.health, 1)


def train_step(run: Run, step: int) -> dict[str, Any]:
    """One PPO step, phase by phase, timed."""
    judged = None
    if run.hacking is not None and step == run.start_step:
        with run.health.timed():
            judged = judge_reading(run, step)
    torch.manual_seed(step_seed(run.args.seed, step, run.accelerator.process_index))
    if step == run.start_step + 1:  # the second step of this process: the optimizer states exist by then
        held = [*run.unwrapped.parameters(), *run.unwrapped.buffers(), *optimizer_state_tensors(run.optimizer)]
        held += reward_tensors(run.reward)  # a model scoring beside the policy: the plan counts it too
        run.step_peak.start(held)
    timings, t0 = {}, time.perf_counter()
    rollouts = rollout(run, step)
    timings["time/generate"], t0 = time.perf_counter() - t0, time.perf_counter()
    raw_scores, scores, q_texts, r_texts = score(run, rollouts, step)
    timings["time/score"], t0 = time.perf_counter() - t0, time.perf_counter()
    exp, non_score = make_experience(
        run.unwrapped, rollouts, scores, run.kl_ctl.value, run.args, run.tokenizer.pad_token_id
    )
    if step == 0:
        with run.health.timed():
            first_step_guards(run, exp, raw_scores)
    timings["time/forward"], t0 = time.perf_counter() - t0, time.perf_counter()
    stats = ppo_update(run.model, run.optimizer, run.accelerator, exp, run.args, lambda: run.gradients(run.unwrapped))
    if not stats.finite:
        raise stopped("non-finite loss", step + 1, run.args)
    timings["time/optimise"] = time.perf_counter() - t0
    run.step_peak.stop()
    if run.hacking is not None and (step + 1) % run.args.guard_judge_every == 0:
        with run.health.timed():
            judged = judge_reading(run, step + 1)
    row = log_step(run, step, exp, non_score, raw_scores, stats, timings, judged)
    keep_samples(run, step, q_texts, r_texts, raw_scores)
    if run.args.save_steps and (step + 1) % run.args.save_steps == 0:
        save_checkpoint(run, step + 1)
    return row


def terminated(run: Run, signal: str | None, step: int) -> Terminated:
    """Save where the run is (unless this step just did) and say how to go on."""
    path = checkpoint_root(run.args.output_dir) / f"{STAGE.checkpoint_prefix}-{step}"
    if not (run.args.save_steps and step % run.args.save_steps == 0):
        save_checkpoint(run, step)
    return Terminated(
        f"stopped by {signal} after step {step}; saved {path}; resume with --resume_from_checkpoint latest"
    )


# --- the end --------------------------------------------------------------------------------------


def finish(run: Run) -> None:
    """Check the base did not move and the ranks agree, then write the policy, value head and report."""
    from accelerate.utils import gather_object
    from peft import get_peft_model_state_dict

    unwrapped = run.unwrapped
    rank_prompts = gather_object([run.first_prompts])
    if run.frozen_digest is not None and tensor_digest(run.frozen) != run.frozen_digest:
        raise RunFailed("a frozen base weight changed during PPO: the reference model is no longer the reference")

    def save_weights(out: Path) -> None:
        unwrapped.policy.save_pretrained(out, selected_adapters=["default"])  # not the reward adapter
        save_value_head(unwrapped, out)

    run.monitors.finish()
    if run.hacking is not None:
        run.hacking.finish()
    rewards = [r["env/reward_mean"] for r in run.metrics.rows]
    value_head = {f"value_head.{k}": v for k, v in unwrapped.value_head.state_dict().items()}
    end = TrainingEnd(
        stage=STAGE.name,
        configs=run.configs,
        model_path=run.model_path,
        world_size=run.accelerator.num_processes,
        trained={**get_peft_model_state_dict(unwrapped.policy), **value_head},
        save_weights=save_weights,
        tokenizer=run.tokenizer,
        trainable_parameters=sum(p.numel() for p in unwrapped.parameters() if p.requires_grad),
        memory=memory_report(run.planned_peak_mb, run.step_peak),
        metrics=run.metrics.rows,
        curves=["env/reward_mean", "heldout/judge_mean", "objective/kl", "objective/kl_coef", "ppo/value_loss"],
        plot=STAGE.plot,
        title=f"PPO on {run.model_args.model_name_or_path}",
        summary=f"PPO done: reward {rewards[0]:.3f} -> {rewards[-1]:.3f} over {len(rewards)} steps",
        resumed_from=str(run.resume) if run.resume else None,
        health=run.health,
        details={
            "n_prompts": len(run.queries),
            "prompts": run.prompts,
            "stop_at_eos": run.stop_at_eos,
            "rank_first_prompts": rank_prompts,
            "frozen_base_digest": run.frozen_digest,
            "frozen_base_verified": run.frozen_digest is not None,
        },
        samples=(STAGE.samples, samples_markdown("PPO samples", {f"{k} step": v for k, v in run.samples.items()})),
    )
    finish_training(end, run.out, run.accelerator.is_main_process)


@entrypoint
def main(argv: list[str] | None = None) -> None:
    from tqdm.auto import tqdm

    run = preflight(STAGE.parse(argv))
    args, accelerator = run.args, run.accelerator
    with staged_output_dir(args.output_dir, args.overwrite_output_dir, stage=STAGE.name) as run.out:
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
        with signals.stop_at_step_end() as stop:
            for step in bar:
                row = train_step(run, step)
                bar.set_postfix(reward=f"{row['env/reward_mean']:.3f}", kl=f"{row['objective/kl']:.3f}")
                if stop.requested():
                    raise terminated(run, stop.signal, step + 1)
        finish(run)
    accelerator.end_training()  # closes trackers, and in accelerate 1.16 the process group: keep it last
    push_output(args, args.output_dir, STAGE.name)


if __name__ == "__main__":
    main()
