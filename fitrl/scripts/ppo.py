"""Stage 3 of the RLHF pipeline: PPO with LoRA on one 8-bit backbone, against a reward.

One copy of the merged model sits in memory, in 8-bit. A fresh LoRA adapter on it is the **policy**;
the same forward with the adapter disabled gives the **reference** log-probs (no second copy); a small
fp32 **value head** reads the policy's last hidden state; the **reward** is a sentiment classifier's
score of query + response. The engine (the step, its state and checkpoints) is `fitrl.ppo`; this module
loads the models, the prompts and the reward, and runs the engine's loop with the stage's guards.

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
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fitrl import signals
from fitrl.artifacts import RunInfo
from fitrl.checkpoints import checkpoint_root, latest_checkpoint, resume_checkpoint
from fitrl.config import RunFailed, Terminated, UsageError, config_dict
from fitrl.demo import DemoArguments
from fitrl.distributed import cpu_only, sharded_launch, tensor_digest
from fitrl.ending import TrainingEnd, finish_training, samples_markdown
from fitrl.guards import HackingGuard, Health, Monitors, check_prompt_length, heldout_set
from fitrl.hub import push_output
from fitrl.memory import memory_report, tensor_bytes
from fitrl.modeling import (
    LoraArguments,
    ModelArguments,
    add_lora,
    load_causal_lm,
    load_tokenizer,
    make_optimizer,
    resolve_model_path,
)
from fitrl.outputs import MetricsLog, check_output_dir, staged_output_dir, staging_dir
from fitrl.planner import planned_peak_mb
from fitrl.ppo import metrics
from fitrl.ppo.step import PolicyAndValue
from fitrl.ppo.trainer import PPOTrainer, Prompts, Sampling
from fitrl.process import entrypoint
from fitrl.reward import audit, probes
from fitrl.reward.factory import check_reward, load_reward
from fitrl.reward.settings import RewardArguments
from fitrl.rollout import decode, rendered_queries
from fitrl.stages.base import start_end
from fitrl.stages.ppo import STAGE, PPOArguments, monitors
from fitrl.tasks.answer_format import asks_for_answer_block
from fitrl.tasks.sentiment import PromptArguments, SentimentJudge, build_queries, check_judge


@dataclass
class Run:
    """What the stage holds around the engine: configs, the accelerator, the prompts, and its guards."""

    model_args: ModelArguments
    lora_args: LoraArguments
    prompt_args: PromptArguments
    reward_args: RewardArguments
    args: PPOArguments
    demo_args: DemoArguments
    accelerator: Any
    model_path: str
    tokenizer: Any
    prompts: Prompts
    resume: Path | None
    prompt_summary: str = ""  # what became of the prompt rows (`Queries.summary`)
    sampling: Sampling | None = None
    reward_base: str | None = None  # the base a reward adapter is loaded on by itself (None: the policy's)
    out: Path | None = None
    trainer: PPOTrainer | None = None
    frozen: dict[str, torch.Tensor] | None = None
    frozen_digest: str | None = None
    planned_peak_mb: float | None = None
    health: Health = dataclasses.field(default_factory=Health)  # what the guards saw
    judge: SentimentJudge | None = None  # the reward-hacking guard's second opinion (guard_judge_model)
    judge_queries: list[list[int]] = dataclasses.field(default_factory=list)  # its held-out prompts
    hacking: HackingGuard | None = None
    probes: dict[str, Any] | None = None  # what the reward pre-flight found (`fitrl.reward.probes`)

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    @property
    def configs(self) -> tuple[Any, ...]:
        return (self.model_args, self.lora_args, self.prompt_args, self.reward_args, self.args, self.demo_args)


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
    earlier = latest_checkpoint(checkpoint_root(args.output_dir), STAGE.checkpoint_prefix)
    if resume is None and earlier is not None and os.environ.get("RANK", "0") == "0":
        print(f"note: {earlier} is an earlier run's checkpoint; this run starts at step 0 (a checkpoint of the "
              "same step replaces it); --resume_from_checkpoint latest continues that run instead")  # fmt: skip
    if sharding := sharded_launch():
        raise UsageError(
            f"PPO does not run under {sharding}: its policy, reference, value head and reward adapter share one "
            "backbone that sharding would split; launch on one device or with DDP (configs/accelerate/"
            "single_gpu.yaml, ddp_2gpu.yaml)"
        )
    model_path = resolve_model_path(model_args.model_name_or_path, cache)
    reward_base = check_reward(
        reward_args, model_args.model_name_or_path, model_path, cache, STAGE.name, STAGE.producer_of("reward_adapter")
    )
    tokenizer = load_tokenizer(model_path, model_args.trust_remote_code)
    queries = build_queries(tokenizer, prompt_args, cache, args.seed, reward_args.reward_columns)
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
    run = Run(*configs, accelerator, model_path, tokenizer, Prompts(queries.ids, queries.columns), resume)
    run.reward_base = reward_base
    run.prompt_summary = queries.summary(prompt_args)
    run.sampling = Sampling(
        prompt_args.response_min_tokens,
        prompt_args.response_max_tokens,
        prompt_args.stops_at_eos(queries.chat),
        prompt_args.sentence_ends(tokenizer),
    )
    if accelerator.is_main_process:
        print(f"PPO: {run.prompt_summary}")
        note_reward_rendering(reward_args.reward_adapter, queries.chat)
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
    and value head, the optimizer, and the engine around them."""
    args, reward_args = run.args, run.reward_args
    reward = load_reward(reward_args, run.demo_args.demo_assets, run.device, run.reward_base)
    if run.reward_base is not None and run.accelerator.is_main_process:
        print(f"PPO: reward adapter {reward_args.reward_adapter} loaded on its own copy of {run.reward_base}, "
              f"{tensor_bytes(reward.tensors()) / 2**20:.1f} MiB beside the policy")  # fmt: skip
    backbone = load_causal_lm(
        run.model_args,
        path=run.model_path,
        gradient_checkpointing=args.gradient_checkpointing,
        pad_token_id=run.tokenizer.pad_token_id,
    )
    torch.manual_seed(args.seed)  # the same fresh adapter and value head on every rank
    model = PolicyAndValue(add_lora(backbone, run.lora_args), backbone.config.hidden_size)
    model.value_head.to(run.device)  # the backbone is already placed (device_map) or moved by prepare()
    if reward is None:  # an rm adapter and its head on this backbone
        reward = load_reward(reward_args, run.demo_args.demo_assets, run.device, None, model.policy, run.tokenizer)
    if run.judge_queries:
        run.judge = SentimentJudge(
            args.guard_judge_model, args.guard_judge_positive_label, run.demo_args.demo_assets, run.device
        )
    run.frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    run.frozen_digest = tensor_digest(run.frozen) if args.verify_frozen_base else None
    optimizer = make_optimizer(model, args.optimizer, args.learning_rate)
    run.health.strict = args.strict_guards
    run.trainer = PPOTrainer(
        model,
        optimizer,
        run.accelerator,
        args,
        run.tokenizer,
        run.prompts,
        reward,
        run.sampling,
        health=run.health,
        monitors=Monitors(run.health, monitors(args)),
        metrics_log=MetricsLog(run.out, enabled=run.accelerator.is_main_process),
        configs=run.configs,
        checkpoint_prefix=STAGE.checkpoint_prefix,
    )
    if run.judge is not None:
        advice = "check what the reward model pays for, or raise init_kl_coef"
        run.hacking = HackingGuard(run.health, "the judge's mean verdict", args.guard_judge_drop, advice, share=False)
        run.trainer.guards["reward_hacking"] = run.hacking  # a resumed run keeps its first reading
    if args.report_to != "none":  # trackers take scalars: lists become strings, empties are dropped
        flat = config_dict(*run.configs)
        hparams = {k: str(v) if isinstance(v, list) else v for k, v in flat.items() if v is not None}
        run.accelerator.init_trackers("fitrl-ppo", hparams)


def note_reward_rendering(reward_adapter: str | None, chat: bool) -> None:
    """A reward adapter reads each prompt as rendered (a chat in its template): say so when the rm stage
    trained on the other kind of pairs, whose scores then come from text it never saw."""
    info = RunInfo.read(reward_adapter) if reward_adapter else None
    trained_on_chats = None if info is None else info.details.get("chat_pairs")
    if trained_on_chats is not None and trained_on_chats != chat:
        kinds = ("chats in their template", "text pairs") if chat else ("text", "chats in their template")
        print(
            f"note: the reward adapter {reward_adapter} reads these prompts as {kinds[0]}, but its rm stage "
            f"trained on {kinds[1]}; its scores may not mean what its evaluation measured",
            file=sys.stderr,
        )


def judge_queries(run: Run) -> list[list[int]]:
    """The held-out prompts the reward-hacking guard's judge reads responses to (none: that guard is off)."""
    args, prompt_args, assets = run.args, run.prompt_args, run.demo_args.demo_assets
    heldout = dataclasses.replace(
        prompt_args, dataset_split=args.guard_judge_split, max_prompts=args.guard_judge_prompts
    )

    def load() -> list[list[int]]:
        check_judge(args.guard_judge_model, args.guard_judge_positive_label, assets)
        return build_queries(run.tokenizer, heldout, assets, args.seed).ids

    off = None if args.guard_judge_model else "no guard_judge_model"
    fix = "set guard_judge_split to a held-out split, or leave guard_judge_model empty"
    return heldout_set(run.health, off, load, fix) or []


def reward_preflight(run: Run) -> dict[str, Any] | None:
    """The reward pre-flight (`fitrl.reward.probes`) on the first `guard_probe_prompts` prompts before
    the first update, the policy being its reference; the run's random stream is left as it was, so the
    run trains as it would without it."""
    args, trainer, health = run.args, run.trainer, run.health
    if args.guard_probe_prompts == 0 or trainer.start_step > 0:
        health.not_run(probes.GUARD, "guard_probe_prompts is 0" if args.guard_probe_prompts == 0 else "resumed")
        return None
    n = min(args.guard_probe_prompts, len(run.prompts))
    cuda = list(range(torch.cuda.device_count()))
    with torch.random.fork_rng(devices=cuda), health.timed():
        torch.manual_seed(args.seed)
        queries, columns = run.prompts.select(range(n))
        rollouts = trainer.sample(queries, trainer.draw_lengths(n))
        decoded = [decode(run.tokenizer, r) for r in rollouts]
        q_texts, r_texts = [q for qs, _ in decoded for q in qs], [t for _, ts in decoded for t in ts]
        read = [q for r in rollouts for q in rendered_queries(run.tokenizer, r)] if trainer.reward.rendered else q_texts

        def score(indices: list[int], texts: list[str]) -> list[float]:
            cols = {k: [v[i] for i in indices] for k, v in columns.items()}
            cols["completion_ids"] = [run.tokenizer(t, add_special_tokens=False).input_ids for t in texts]
            return trainer.reward.score([read[i] for i in indices], texts, cols)[0].tolist()

        answer_format = asks_for_answer_block(run.prompt_args.system_prompt)
        found = probes.run_probes(score, q_texts, r_texts, bool(run.reward_args.reward_adapter), answer_format)
    probes.check_probes(found, health, args.guard_probe_max)
    return found.to_json()


def judge_reading(run: Run, step: int) -> float:
    """The judge's mean verdict on the policy's responses to the held-out prompts: the same prompts,
    lengths and sampling seed at every reading, so only the policy changes between them."""
    torch.manual_seed(run.args.seed)
    trainer = run.trainer
    rollouts = trainer.sample(run.judge_queries, trainer.draw_lengths(len(run.judge_queries)))
    texts = [q + r for part in rollouts for qs, rs in [decode(run.tokenizer, part)] for q, r in zip(qs, rs)]
    verdict = run.judge(texts).mean().item()
    run.hacking.score(step, verdict)
    return verdict


def train_step(run: Run) -> dict[str, Any]:
    """One step of the engine, with the reward-hacking guard's readings before the first step and every
    few steps: at the same steps in a resumed run as in one that never stopped."""
    trainer, judged = run.trainer, None
    step = trainer.state.step
    if run.hacking is not None and (step == 0 or (step == trainer.start_step and not run.hacking.scores)):
        with run.health.timed():
            judged = judge_reading(run, step)
    out = trainer.step()
    if run.hacking is not None and (step + 1) % run.args.guard_judge_every == 0:
        with run.health.timed():
            judged = judge_reading(run, step + 1)
    row = trainer.record(out, {metrics.JUDGE_MEAN: judged})
    if run.hacking is not None:
        run.hacking.reward(row[metrics.REWARD_MEAN])
    return row


# --- the end --------------------------------------------------------------------------------------


def overoptimisation(run: Run) -> audit.Audit | None:
    """The over-optimisation audit (`fitrl.reward.audit`) of the judge's readings: the saved policy nearest
    the judge's peak, among this run's checkpoints (every `save_steps`) and its output. None without a
    judge or with fewer than two readings."""
    if run.hacking is None:
        return None
    args, trainer = run.args, run.trainer
    rows, final = trainer.state.metrics, trainer.state.step
    readings = audit.readings(rows, run.hacking.scores, metrics.REWARD_MEAN, metrics.KL)
    saved = audit.saved_policies(args.output_dir, STAGE.checkpoint_prefix, args.save_steps, final)
    command = (
        f"fitrl eval --adapter_dir {{adapter_dir}} --output_dir {audit.peak_eval_dir(args.output_dir)} "
        f"--judge_model {args.guard_judge_model} --judge_positive_label {args.guard_judge_positive_label}"
    )
    gold = f"judge's mean verdict ({args.guard_judge_model})"
    return audit.audit(gold, readings, saved, final, args.output_dir, command)


def finish(run: Run) -> None:
    """Check the base did not move and the ranks agree, then write the policy, value head and report."""
    from accelerate.utils import gather_object

    trainer = run.trainer
    rank_prompts = gather_object([trainer.first_prompts])
    if run.frozen_digest is not None and tensor_digest(run.frozen) != run.frozen_digest:
        raise RunFailed("a frozen base weight changed during PPO: the reference model is no longer the reference")
    trainer.monitors.finish()
    if run.hacking is not None:
        if run.hacking.unread(trainer.state.step):
            with run.health.timed():
                judge_reading(run, trainer.state.step)
        run.hacking.finish()
    with run.health.timed():  # counted in guard_seconds with the guards' own work
        audited = overoptimisation(run)
    if audited is not None and run.accelerator.is_main_process:  # a report figure, drawn (untimed) as the curves are
        audit.plot(audited, trainer.state.metrics, metrics.REWARD_MEAN, metrics.KL, run.out / audit.PLOT)
    rows = trainer.state.metrics
    rewards = [r[metrics.REWARD_MEAN] for r in rows]
    start, end = start_end(rewards)  # the report's reading: means of the first and last few steps
    end = TrainingEnd(
        stage=STAGE.name,
        configs=run.configs,
        model_path=run.model_path,
        world_size=run.accelerator.num_processes,
        trained=trainer.trained_tensors(),
        save_weights=trainer.save_weights,
        tokenizer=run.tokenizer,
        trainable_parameters=sum(p.numel() for p in trainer.unwrapped.parameters() if p.requires_grad),
        memory=memory_report(run.planned_peak_mb, trainer.step_peak),
        metrics=rows,
        curves=[metrics.REWARD_MEAN, metrics.JUDGE_MEAN, metrics.KL, metrics.KL_COEF, metrics.VALUE_LOSS],
        plot=STAGE.plot,
        title=f"PPO on {run.model_args.model_name_or_path}",
        summary=f"PPO done: reward {start:.3f} -> {end:.3f} over {len(rewards)} steps (as the report reads it)",
        resumed_from=str(run.resume) if run.resume else None,
        health=run.health,
        details={
            "n_prompts": len(run.prompts),
            "prompts": run.prompt_summary,
            "stop_at_eos": run.sampling.stop_at_eos,
            "rank_first_prompts": rank_prompts,
            "frozen_base_digest": run.frozen_digest,
            "frozen_base_verified": run.frozen_digest is not None,
            **({probes.DETAILS_KEY: run.probes} if run.probes is not None else {}),
            **({audit.DETAILS_KEY: audited.to_json()} if audited is not None else {}),
        },
        samples=(
            STAGE.samples,
            samples_markdown("PPO samples", {f"{k} step": v for k, v in trainer.state.samples.items()}),
        ),
    )
    finish_training(end, run.out, run.accelerator.is_main_process)


@entrypoint
def main(argv: list[str] | None = None) -> None:
    from tqdm.auto import tqdm

    run = preflight(STAGE.parse(argv))
    args, accelerator = run.args, run.accelerator
    with staged_output_dir(args.output_dir, args.overwrite_output_dir, stage=STAGE.name) as run.out:
        build(run)
        trainer = run.trainer
        if run.resume is not None:
            trainer.load(run.resume)
        run.probes = reward_preflight(run)
        bar = tqdm(
            range(trainer.start_step, args.steps),
            desc="PPO",
            disable=not accelerator.is_main_process,
            initial=trainer.start_step,
            total=args.steps,
        )
        with signals.stop_at_step_end() as stop:
            for _ in bar:
                row = train_step(run)
                bar.set_postfix(reward=f"{row[metrics.REWARD_MEAN]:.3f}", kl=f"{row[metrics.KL]:.3f}")
                if stop.requested():
                    path = trainer.save_if_not_saved()
                    raise Terminated(
                        f"stopped by {stop.signal} after step {trainer.state.step}; saved {path}; "
                        "resume with --resume_from_checkpoint latest"
                    )
        finish(run)
    accelerator.end_training()  # closes trackers, and in accelerate 1.16 the process group: keep it last
    push_output(args, args.output_dir, STAGE.name)


if __name__ == "__main__":
    main()
