"""The PPO trainer: prompts as token ids and a `Reward` in, a policy and a value head out.

`PPOTrainer.step()` runs one step (sample, score, the no-grad pass, the update) and returns what it
measured; `record()` turns that into the step's metrics row. Its state is `PPOState`, exactly what a
checkpoint holds besides the weights and the optimizer: `save(path)` writes all of it and `load(path)`
resumes bit-exact, because every draw of a step is seeded from (seed, step, rank).

The engine knows no task: which prompts, which reward and which held-out checks are the caller's.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fitrl import checkpoints
from fitrl.checkpoints import ADAPTER, STATE_FILE, load_safetensors, load_state
from fitrl.config import save_run_config
from fitrl.guards import (
    GradientGuard,
    Health,
    Monitors,
    check_reference,
    check_reward_signal,
    check_reward_tokenizer,
    check_trainable,
    repetition,
)
from fitrl.memory import StepPeak, gpu_peak_mb, optimizer_state_tensors
from fitrl.outputs import MetricsLog
from fitrl.ppo import core, metrics
from fitrl.ppo.step import Experience, PolicyAndValue, UpdateStats, make_experience, ppo_update
from fitrl.reward.base import Reward
from fitrl.rollout import Rollout, decode, generation_batch, rendered_queries, sample_responses
from fitrl.stages.ppo import PPOArguments

VALUE_HEAD = "value_head.safetensors"  # tensors only: it loads without pickle
OPTIMIZER = "optimizer.pt"


def step_seed(seed: int, step: int, rank: int) -> int:
    # Every draw of a step (lengths, sampling, shuffles, dropout) comes from (seed, step, rank), so a
    # resumed run makes exactly the draws of an uninterrupted one; the primes keep the triples apart.
    return seed * 1_000_003 + step * 1009 + rank


def epoch_seed(seed: int, epoch: int) -> int:
    # One permutation of the prompts per pass over them, the same on every rank and after a resume.
    return seed * 7919 + epoch


def batch_queries(n_queries: int, step: int, rank: int, world: int, size: int, seed: int) -> list[int]:
    """Indices of this rank's prompts at `step`: a seeded permutation per epoch, disjoint across ranks."""
    indices = []
    for j in range(size):
        pos = (step * world + rank) * size + j
        epoch, k = divmod(pos, n_queries)
        perm = torch.randperm(n_queries, generator=torch.Generator().manual_seed(epoch_seed(seed, epoch)))
        indices.append(int(perm[k]))
    return indices


@dataclass(frozen=True)
class Sampling:
    """How responses are sampled: a length drawn per response from [min_tokens, max_tokens], ended at
    EOS (`stop_at_eos`), and cut after the last of `sentence_ends` (None: not cut)."""

    min_tokens: int
    max_tokens: int
    stop_at_eos: bool = False
    sentence_ends: torch.Tensor | None = None


@dataclass
class Prompts:
    """The prompts PPO samples from: token ids, and the dataset columns a reward grades against (one
    value per prompt, e.g. `gold`)."""

    ids: list[list[int]]
    columns: dict[str, list[Any]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.ids)

    def select(self, indices: Sequence[int]) -> tuple[list[list[int]], dict[str, list[Any]]]:
        return [self.ids[i] for i in indices], {k: [v[i] for i in indices] for k, v in self.columns.items()}


@dataclass
class PPOState:
    """What a checkpoint holds besides the weights and the optimizer: the next step, the KL controller,
    the running score statistics, the samples kept, every metrics row so far, and the state of the
    caller's guards (`PPOTrainer.guards`)."""

    step: int
    kl_controller: core.AdaptiveKLController | core.FixedKLController
    score_stats: core.RunningMoments
    samples: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    guards: dict[str, Any] = field(default_factory=dict)  # the caller's guards' own state, by name

    @staticmethod
    def fresh(args: PPOArguments) -> PPOState:
        if args.adaptive_kl:
            kl_controller = core.AdaptiveKLController(args.init_kl_coef, args.target_kl, args.kl_horizon)
        else:
            kl_controller = core.FixedKLController(args.init_kl_coef)
        return PPOState(0, kl_controller, core.RunningMoments())

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "kl_controller": self.kl_controller.state_dict(),
            "samples": self.samples,
            "score_stats": self.score_stats.state_dict(),
            "metrics": self.metrics,
            "guards": self.guards,
        }

    def load_json(self, state: Mapping[str, Any]) -> None:
        self.step, self.samples = state["step"], state["samples"]
        self.kl_controller.load_state_dict(state["kl_controller"])
        self.score_stats.load_state_dict(state["score_stats"])
        self.metrics = list(state["metrics"])
        self.guards = dict(state.get("guards", {}))  # none in checkpoints of earlier versions


@dataclass
class StepOutput:
    """What one step measured, before it is a metrics row."""

    exp: Experience
    non_score: torch.Tensor  # (B, R) the KL part of the reward
    raw_scores: torch.Tensor  # (B,) the reward's scores as logged, before scaling and clipping
    stats: UpdateStats
    timings: dict[str, float]
    queries: list[str]
    responses: list[str]


class PPOTrainer:
    """PPO with a LoRA policy and a value head (`PolicyAndValue`) against a `Reward`.

    `model` and `optimizer` are wrapped by `accelerator` here (DDP where launched so). `configs` are
    written beside each checkpoint (`run_config.yaml`, the file that marks it complete);
    `checkpoint_dir` and `checkpoint_prefix` say where `step-N` checkpoints go.
    """

    def __init__(
        self,
        model: PolicyAndValue,
        optimizer: torch.optim.Optimizer,
        accelerator: Any,
        args: PPOArguments,
        tokenizer: Any,
        prompts: Prompts,
        reward: Reward,
        sampling: Sampling,
        *,
        health: Health,
        monitors: Monitors,
        metrics_log: MetricsLog,
        configs: tuple[Any, ...],
        checkpoint_prefix: str,
    ) -> None:
        self.args, self.accelerator, self.tokenizer = args, accelerator, tokenizer
        self.prompts, self.reward, self.sampling = prompts, reward, sampling
        self.health, self.monitors, self.log = health, monitors, metrics_log
        self.configs, self.checkpoint_prefix = configs, checkpoint_prefix
        self.state = PPOState.fresh(args)
        self.model, self.optimizer = accelerator.prepare(model, optimizer)
        self.unwrapped: PolicyAndValue = accelerator.unwrap_model(self.model)
        check_trainable(self.unwrapped, health)
        self.gradients = GradientGuard(health)
        self.step_peak = StepPeak()
        # The caller's stateful guards (state_dict / load_state_dict), saved and restored with the state.
        self.guards: dict[str, Any] = {}
        self.first_prompts: list[int] | None = None  # this rank's first prompts: the ranks must differ
        self.start_step = 0  # where this process began (a resumed run: the checkpoint's step)

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    # --- checkpoints ------------------------------------------------------------------------------

    def checkpoint_path(self, step: int) -> Path:
        return checkpoints.checkpoint_root(self.args.output_dir) / f"{self.checkpoint_prefix}-{step}"

    def save_value_head(self, directory: Path) -> None:
        from safetensors.torch import save_file

        head = self.unwrapped.value_head.state_dict()
        save_file({k: v.detach().contiguous().cpu() for k, v in head.items()}, directory / VALUE_HEAD)

    def save_weights(self, directory: Path) -> None:
        """The policy adapter (not a reward adapter riding on the same backbone) and the value head."""
        self.unwrapped.policy.save_pretrained(directory, selected_adapters=["default"])
        self.save_value_head(directory)

    def save(self, path: Path) -> None:
        """Adapter, value head, optimizer and `state` to `path`, written aside and renamed into place."""
        self.state.guards = {name: guard.state_dict() for name, guard in self.guards.items()}
        state = self.state.to_json()
        self.accelerator.wait_for_everyone()
        if self.accelerator.is_main_process:
            staging = path.with_name(path.name + ".partial")
            shutil.rmtree(staging, ignore_errors=True)
            try:
                staging.mkdir(parents=True)
                self.unwrapped.policy.save_pretrained(staging / ADAPTER, selected_adapters=["default"])
                self.save_value_head(staging)
                torch.save(self.optimizer.state_dict(), staging / OPTIMIZER)
                (staging / STATE_FILE).write_text(json.dumps(state))
                save_run_config(staging, *self.configs)
            except Exception as e:
                shutil.rmtree(staging, ignore_errors=True)  # never a half-written checkpoint beside the others
                if checkpoints.is_write_failure(e):
                    raise checkpoints.save_failed(
                        e, self.state.step, self.args.output_dir, self.checkpoint_prefix
                    ) from None
                raise
            shutil.rmtree(path, ignore_errors=True)
            staging.rename(path)
        self.accelerator.wait_for_everyone()

    def load(self, path: Path) -> None:
        """Resume from a checkpoint `save` wrote: weights, optimizer and state; the rows go to the log again."""
        from peft import set_peft_model_state_dict

        adapter = load_safetensors(path / ADAPTER / "adapter_model.safetensors", path)
        set_peft_model_state_dict(self.unwrapped.policy, adapter)
        self.unwrapped.value_head.load_state_dict(load_safetensors(path / VALUE_HEAD, path))
        self.state.load_json(json.loads((path / STATE_FILE).read_text()))
        for name, guard in self.guards.items():
            if name in self.state.guards:
                guard.load_state_dict(self.state.guards[name])
        rows, self.state.metrics = self.state.metrics, []
        for row in rows:
            self.log_row(row)
        self.optimizer.load_state_dict(load_state(path / OPTIMIZER, self.device))
        self.start_step = self.state.step

    def stopped(self, reason: str, step: int) -> Exception:
        """The error for a run that cannot go on: it names the checkpoint to resume from, if any."""
        fix = "lower learning_rate or clip scores (score_clip)"
        return checkpoints.stopped(reason, step, self.args.output_dir, self.checkpoint_prefix, fix)

    # --- one step ---------------------------------------------------------------------------------

    def sample(self, queries: list[list[int]], lengths: list[int], keep_policy: bool = False) -> list[Rollout]:
        """Responses of the given lengths to `queries`, in generation batches."""
        args, s = self.args, self.sampling
        size = generation_batch(args.generation_batch_size, args.forward_batch_size, args.batch_size)
        return [
            sample_responses(
                self.unwrapped.policy,
                self.tokenizer,
                queries[c : c + size],
                lengths[c : c + size],
                s.stop_at_eos,
                self.device,
                keep_policy=keep_policy,
                sentence_ends=s.sentence_ends,
            )
            for c in range(0, len(queries), size)
        ]

    def draw_lengths(self, n: int) -> list[int]:
        return torch.randint(self.sampling.min_tokens, self.sampling.max_tokens + 1, (n,)).tolist()

    def rollout(self, step: int) -> tuple[list[Rollout], dict[str, list[Any]]]:
        """This rank's prompts for `step` and a sampled response of drawn length for each, in no-grad
        chunks; and those prompts' columns."""
        args, accelerator = self.args, self.accelerator
        idx = batch_queries(
            len(self.prompts), step, accelerator.process_index, accelerator.num_processes, args.batch_size, args.seed
        )
        self.first_prompts = self.first_prompts or idx[:4]
        queries, columns = self.prompts.select(idx)
        lengths = self.draw_lengths(args.batch_size)
        # The full KL needs the policy's logits beside the reference's: those come from a forward pass.
        keep_policy = args.policy_from_generation and args.kl_estimator != "full"
        rollouts = self.sample(queries, lengths, keep_policy)
        return [part for r in rollouts for part in r.split(args.forward_batch_size)], columns

    def score(
        self, rollouts: list[Rollout], columns: dict[str, list[Any]], step: int
    ) -> tuple[torch.Tensor, torch.Tensor, list[str], list[str]]:
        """The raw scores (B,) as logged, the scores the rewards use (scaled, clipped), and the texts."""
        args = self.args
        texts = [decode(self.tokenizer, r) for r in rollouts]
        q_texts = [q for qs, _ in texts for q in qs]
        r_texts = [r for _, rs in texts for r in rs]
        if step == 0:
            with self.health.timed():
                joined = [q + r for q, r in zip(q_texts, r_texts)]
                check_reward_tokenizer(joined, self.tokenizer, self.reward.tokenizer, self.health)
        columns = {**columns, "completion_ids": [ids for r in rollouts for ids in r.response_ids()]}
        read = [q for r in rollouts for q in rendered_queries(self.tokenizer, r)] if self.reward.rendered else q_texts
        raw = self.reward.score(read, r_texts, columns)[0].to(self.device)  # (B,)
        if not torch.isfinite(raw).all():
            raise self.stopped("non-finite reward", step + 1)
        scores = raw
        if args.score_scaling != "none":
            stats = self.state.score_stats
            stats.update(self.accelerator.gather(raw).cpu())
            shift = stats.mean if args.score_scaling == "normalize" else 0.0
            scores = (raw - shift) / (stats.std + 1e-8)
        if args.score_clip is not None:
            scores = scores.clamp(-args.score_clip, args.score_clip)
        return raw, scores, q_texts, r_texts

    def first_step_guards(self, exp: Experience, raw_scores: torch.Tensor) -> None:
        """Before any update the policy is its reference (KL ~0), and the reward of the batch is not constant."""
        mask = exp.response_mask
        kl = self.accelerator.reduce((exp.kl * mask).sum() / mask.sum().clamp(min=1), "mean").item()
        check_reference(kl, self.health, 1)
        check_reward_signal(self.accelerator.gather(raw_scores).cpu(), self.health, 1)

    def step(self) -> StepOutput:
        """Sample, score, the no-grad pass, the update: one PPO step, phase by phase, timed."""
        step, args = self.state.step, self.args
        torch.manual_seed(step_seed(args.seed, step, self.accelerator.process_index))
        if step == self.start_step + 1:  # the second step of this process: the optimizer states exist by then
            held = [*self.unwrapped.parameters(), *self.unwrapped.buffers(), *optimizer_state_tensors(self.optimizer)]
            self.step_peak.start(held + self.reward.tensors())  # a model scoring beside the policy counts too
        timings, t0 = {}, time.perf_counter()
        rollouts, columns = self.rollout(step)
        timings[metrics.TIME_GENERATE], t0 = time.perf_counter() - t0, time.perf_counter()
        raw_scores, scores, q_texts, r_texts = self.score(rollouts, columns, step)
        timings[metrics.TIME_SCORE], t0 = time.perf_counter() - t0, time.perf_counter()
        kl_coef = self.state.kl_controller.value
        exp, non_score = make_experience(self.unwrapped, rollouts, scores, kl_coef, args, self.tokenizer.pad_token_id)
        if step == 0:
            with self.health.timed():
                self.first_step_guards(exp, raw_scores)
        timings[metrics.TIME_FORWARD], t0 = time.perf_counter() - t0, time.perf_counter()
        stats = ppo_update(
            self.model, self.optimizer, self.accelerator, exp, args, lambda: self.gradients(self.unwrapped)
        )
        if not stats.finite:
            raise self.stopped("non-finite loss", step + 1)
        timings[metrics.TIME_OPTIMISE] = time.perf_counter() - t0
        self.step_peak.stop()
        return StepOutput(exp, non_score, raw_scores, stats, timings, q_texts, r_texts)

    def response_repetition(self, exp: Experience) -> float:
        """The responses' repeated 3-gram share (`fitrl.guards.repetition`); 0 when none is long enough."""
        with self.health.timed():
            responses = exp.input_ids[:, exp.query_len :]
            value = repetition([ids[m.bool()].tolist() for ids, m in zip(responses, exp.response_mask)])
        return 0.0 if value != value else value

    def record(self, out: StepOutput, extra: Mapping[str, float] | None = None) -> dict[str, Any]:
        """The step's metrics row, reduced over ranks (`extra`: the caller's readings of this step): the
        KL controller updated, the row logged and monitored, samples kept, a checkpoint when one is due."""
        accelerator, world, exp = self.accelerator, self.accelerator.num_processes, out.exp
        step, mask, kl_ctl = self.state.step, exp.response_mask, self.state.kl_controller
        mean_kl = accelerator.reduce((exp.kl * mask).sum(1).mean(), "mean").item()
        kl_ctl.update(mean_kl, self.args.batch_size * world)
        all_scores = accelerator.gather(out.raw_scores)
        local = torch.tensor(
            [
                core.masked_mean(exp.entropy, mask).item(),
                (out.non_score.sum(1)).mean().item(),
                mask.sum(1).float().mean().item(),
                core.explained_variance(exp.values, exp.returns, mask),
                self.response_repetition(exp),
            ],
            device=self.device,
        )
        ent, non_score_mean, resp_len, expl_var, repeated = accelerator.reduce(local, "mean").tolist()
        n_tokens = mask.sum().item() * world
        stats = out.stats
        row = {
            metrics.STEP: step + 1,
            metrics.REWARD_MEAN: all_scores.mean().item(),
            metrics.REWARD_STD: all_scores.std().item() if len(all_scores) > 1 else 0.0,
            metrics.KL: mean_kl,
            metrics.KL_COEF: kl_ctl.value,
            metrics.ENTROPY: ent,
            metrics.NON_SCORE_REWARD: non_score_mean,
            metrics.POLICY_LOSS: stats.pg_loss,
            metrics.VALUE_LOSS: stats.vf_loss,
            metrics.CLIPFRAC: stats.clipfrac,
            metrics.VALUE_CLIPFRAC: stats.vf_clipfrac,
            metrics.APPROX_KL: stats.approx_kl,
            metrics.RATIO_MEAN: stats.ratio,
            metrics.SKIPPED_BATCHES: stats.skipped,
            metrics.EXPLAINED_VARIANCE: expl_var,
            metrics.RESPONSE_LENGTH: resp_len,
            metrics.REPETITION: repeated,
            **{k: v for k, v in (extra or {}).items() if v is not None},
            **out.timings,
            metrics.TOKENS_PER_SECOND: n_tokens / max(sum(out.timings.values()), 1e-9),
            metrics.GPU_PEAK_MB: gpu_peak_mb(),
        }
        self.log_row(row)
        self.monitors(row, step + 1)
        accelerator.log({k: v for k, v in row.items() if isinstance(v, (int, float))}, step=step + 1)
        self.keep_samples(step, out.queries, out.responses, out.raw_scores)
        self.state.step = step + 1
        if self.args.save_steps and self.state.step % self.args.save_steps == 0:
            self.save(self.checkpoint_path(self.state.step))
        return row

    def log_row(self, row: dict[str, Any]) -> None:
        self.log.log(row)
        self.state.metrics = self.log.rows

    def keep_samples(self, step: int, queries: list[str], responses: list[str], raw_scores: torch.Tensor) -> None:
        for which, at in [("first", 0), ("last", self.args.steps - 1)]:
            if step == at:
                rows = zip(queries, responses, raw_scores.tolist())
                self.state.samples[which] = [{"query": q, "response": r, "reward": round(s, 3)} for q, r, s in rows][
                    : self.args.log_samples
                ]

    def save_if_not_saved(self) -> Path:
        """A checkpoint of where the run is, unless this step just wrote one; its path."""
        step, every = self.state.step, self.args.save_steps
        if not (every and step % every == 0):
            self.save(self.checkpoint_path(step))
        return self.checkpoint_path(step)

    def trained_tensors(self) -> dict[str, torch.Tensor]:
        """The adapter's and the value head's tensors, as the run's outputs record them."""
        from peft import get_peft_model_state_dict

        value_head = {f"value_head.{k}": v for k, v in self.unwrapped.value_head.state_dict().items()}
        return {**get_peft_model_state_dict(self.unwrapped.policy), **value_head}
