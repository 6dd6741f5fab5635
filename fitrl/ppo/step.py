"""One PPO step after sampling, as functions of (model, batch, settings): the experience and the update.

`fitrl.scripts.ppo` runs them in its loop, and `fitrl.memtrace` traces the very same calls
for the memory planner, so a change to the step moves the plan with it. The maths is in `fitrl.ppo`.

- `PolicyAndValue`: the LoRA policy and the value head as one module (DDP averages both).
- `Experience`: a step's batch, every field with its shape and its role (sequence or per-token),
  so that `cat` and `select` need no list of names.
- `experience_chunk` / `make_experience`: the no-grad pass (old and reference log-probs, values,
  KL), then per-token rewards, GAE and whitened advantages.
- `micro_step_loss` / `ppo_update`: the clipped losses of a micro-batch, and `ppo_epochs` passes of
  shuffled mini-batches with early stopping on the epoch's policy KL.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fitrl.ppo import core as ppo
from fitrl.rollout import Rollout, forward, last_hidden_states, position_ids, response_slice, response_window
from fitrl.stages.ppo import PPOArguments

SEQUENCE, PER_TOKEN = "sequence", "per_token"  # (B, Q + R), padded on both sides; (B, R), padded on the right


def _role(role: str, pad_with_token: bool = False, **kw: Any) -> Any:
    return dataclasses.field(metadata={"role": role, "pad_with_token": pad_with_token}, **kw)


class PolicyAndValue(nn.Module):
    """The LoRA policy and the value head as one module, so DDP averages both sets of gradients."""

    def __init__(self, policy: nn.Module, hidden_size: int):
        super().__init__()
        self.policy = policy
        self.value_head = nn.Linear(hidden_size, 1)  # fp32 whatever the backbone's dtype
        nn.init.normal_(self.value_head.weight, std=1 / math.sqrt(hidden_size + 1))
        nn.init.zeros_(self.value_head.bias)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits of the last `logits_to_keep` positions (0: all) (B, K, V), and a value per position (B, T).

        PPO needs logits only where they predict the response: keeping those alone saves the (B, Q, V)
        rest. The value head reads the body's last hidden state through a hook rather than asking for
        every layer's (`output_hidden_states` would keep L + 1 of them alive).
        """
        with last_hidden_states(self.policy) as captured:
            out = self.policy(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids(attention_mask),
                logits_to_keep=logits_to_keep,
            )
        return out.logits, self.values(captured[-1])

    def values(self, hidden: torch.Tensor) -> torch.Tensor:
        """The value head on the body's last hidden states: (B, T, H) -> (B, T)."""
        return self.value_head(hidden.float()).squeeze(-1)


@contextlib.contextmanager
def adapter_disabled(policy: nn.Module) -> Iterator[None]:
    """The reference: the policy with its LoRA adapter off (a model without one is its own reference)."""
    with policy.disable_adapter() if hasattr(policy, "disable_adapter") else contextlib.nullcontext():
        yield


@dataclass
class Experience:
    """One PPO step's batch: the sampled sequences and what the no-grad pass measured on them.

    Queries are left-padded to width Q, responses right-padded to width R; per-token fields are 0 on
    padding. `advantages` and `returns` are filled once the whole batch is known (whitening needs it).
    """

    input_ids: torch.Tensor = _role(SEQUENCE, pad_with_token=True)  # (B, Q + R)
    attention_mask: torch.Tensor = _role(SEQUENCE)  # (B, Q + R)
    response_mask: torch.Tensor = _role(PER_TOKEN)  # (B, R) float: 1 on real response tokens
    logprobs: torch.Tensor = _role(PER_TOKEN)  # (B, R) log p_old of each response token
    values: torch.Tensor = _role(PER_TOKEN)  # (B, R) the value head's estimates
    kl: torch.Tensor = _role(PER_TOKEN)  # (B, R) per-token KL estimate to the reference
    entropy: torch.Tensor = _role(PER_TOKEN)  # (B, R)
    query_len: int = 0  # Q
    advantages: torch.Tensor | None = _role(PER_TOKEN, default=None)  # (B, R), whitened
    returns: torch.Tensor | None = _role(PER_TOKEN, default=None)  # (B, R), the value head's targets

    @staticmethod
    def tensor_fields() -> list[dataclasses.Field]:
        return [f for f in dataclasses.fields(Experience) if "role" in f.metadata]

    @staticmethod
    def cat(parts: list[Experience], pad_token_id: int) -> Experience:
        """Pad every part to one (Q, R) layout and concatenate along the batch."""
        qwidth = max(p.query_len for p in parts)
        rwidth = max(p.response_mask.shape[1] for p in parts)
        joined: dict[str, torch.Tensor | None] = {}
        for f in Experience.tensor_fields():
            if getattr(parts[0], f.name) is None:
                joined[f.name] = None
                continue
            padded = []
            for p in parts:
                qpad = qwidth - p.query_len if f.metadata["role"] == SEQUENCE else 0
                value = pad_token_id if f.metadata["pad_with_token"] else 0
                padded.append(
                    nn.functional.pad(getattr(p, f.name), (qpad, rwidth - p.response_mask.shape[1]), value=value)
                )
            joined[f.name] = torch.cat(padded)
        return Experience(**joined, query_len=qwidth)

    def select(self, rows: torch.Tensor) -> Experience:
        """The sub-batch of `rows`: every tensor field indexed along the batch."""
        picked = {f.name: getattr(self, f.name) for f in self.tensor_fields()}
        return dataclasses.replace(self, **{k: v[rows] for k, v in picked.items() if v is not None})

    @property
    def responses(self) -> torch.Tensor:  # (B, R)
        return self.input_ids[:, self.query_len :]


# --- the experience -------------------------------------------------------------------------------


@torch.no_grad()
def experience_chunk(model: PolicyAndValue, r: Rollout, kl_estimator: ppo.KLEstimator) -> Experience:
    """The no-grad pass over one chunk of sampled sequences: the old log-probs and values (kept from
    sampling, or a forward of the policy) and the reference log-probs (adapter off)."""
    keep = response_window(r)  # logits only where they predict the response
    logits = None
    if r.policy is not None:
        logprobs, entropy, values = r.policy.logprobs, r.policy.entropy, model.values(r.policy.hidden)
    else:
        logits, values = model(r.input_ids, r.attention_mask, logits_to_keep=keep)
        logits, values = logits[:, :-1], response_slice(values, r)  # (B, R, V), (B, R)
        logprobs, entropy = ppo.logprobs_from_logits(logits, r.responses), ppo.entropy_from_logits(logits)
    with adapter_disabled(model.policy):
        ref_logits = forward(model.policy, r, logits_to_keep=keep).logits[:, :-1]
    ref_logprobs = ppo.logprobs_from_logits(ref_logits, r.responses)
    return Experience(
        input_ids=r.input_ids,
        attention_mask=r.attention_mask,
        response_mask=r.response_mask.float(),
        logprobs=logprobs,
        values=values,
        kl=ppo.kl_penalty(logprobs, ref_logprobs, kl_estimator, logits, ref_logits),
        entropy=entropy,
        query_len=r.query_len,
    )


def add_advantages(exp: Experience, scores: torch.Tensor, kl_coef: float, args: PPOArguments) -> torch.Tensor:
    """Per-token rewards (the score at each response's end, minus the KL penalty), GAE and whitened
    advantages into `exp`; returns the KL part of the reward (B, R)."""
    rewards, non_score = ppo.per_token_rewards(scores, exp.kl, exp.response_mask, kl_coef)
    if args.whiten_rewards:
        rewards = ppo.masked_whiten(rewards, exp.response_mask, shift_mean=False)
    advantages, returns = ppo.gae(exp.values, rewards, exp.response_mask, args.gamma, args.lam)
    exp.advantages, exp.returns = ppo.masked_whiten(advantages, exp.response_mask), returns
    return non_score


@torch.no_grad()
def make_experience(
    model: PolicyAndValue,
    rollouts: list[Rollout],
    scores: torch.Tensor,
    kl_coef: float,
    args: PPOArguments,
    pad_token_id: int,
) -> tuple[Experience, torch.Tensor]:
    """The step's experience from its sampled chunks and their scores (B,); and the KL part of the reward.

    In eval mode: dropout here would make the first PPO ratio differ from 1 for no reason.
    """
    model.eval()
    exp = Experience.cat([experience_chunk(model, r, args.kl_estimator) for r in rollouts], pad_token_id)
    return exp, add_advantages(exp, scores, kl_coef, args)


# --- the update -----------------------------------------------------------------------------------


@dataclass
class MicroStats:
    """What one micro-batch's losses measured (0-d tensors, left on the device until the step ends)."""

    pg_loss: torch.Tensor
    vf_loss: torch.Tensor
    clipfrac: torch.Tensor
    vf_clipfrac: torch.Tensor
    approx_kl: torch.Tensor
    ratio: torch.Tensor
    skipped: torch.Tensor  # 1.0 when the batch was skipped for a ratio over `ratio_threshold`


@dataclass
class UpdateStats:
    """A step's update, averaged over its micro-batches (`skipped`: how many were skipped)."""

    pg_loss: float
    vf_loss: float
    clipfrac: float
    vf_clipfrac: float
    approx_kl: float
    ratio: float
    skipped: float
    finite: bool  # every loss was finite


def micro_step_loss(model: nn.Module, mb: Experience, args: PPOArguments) -> tuple[torch.Tensor, MicroStats]:
    """The clipped policy loss plus `vf_coef` x the clipped value loss of one micro-batch (0 when skipped)."""
    q = mb.query_len
    logits, values = model(mb.input_ids, mb.attention_mask, logits_to_keep=response_window(mb))
    logits, values = logits[:, :-1], values[:, q - 1 : -1]
    logprobs = ppo.logprobs_from_logits(logits, mb.responses)
    pg = ppo.policy_loss(logprobs, mb.logprobs, mb.advantages, mb.response_mask, args.cliprange)
    vf_loss, vf_clip = ppo.value_loss(values, mb.values, mb.returns, mb.response_mask, args.cliprange_value)
    loss = pg.loss + args.vf_coef * vf_loss
    # A wildly off-policy batch: learn nothing from it, but still step, to keep DDP in step.
    skipped = pg.ratio_mean.detach() > args.ratio_threshold
    loss = torch.where(skipped, loss * 0.0, loss)
    stats = [pg.loss, vf_loss, pg.clipfrac, vf_clip, pg.approx_kl, pg.ratio_mean, skipped.float()]
    return loss, MicroStats(*(s.detach() for s in stats))


def ppo_update(
    model: nn.Module,
    optimizer: Any,
    accelerator: Any,
    exp: Experience,
    args: PPOArguments,
    before_step: Callable[[], None] | None = None,
) -> UpdateStats:
    """`ppo_epochs` passes of shuffled mini-batches of accumulated micro-batches; with `early_stopping`,
    the passes end once an epoch's policy KL (averaged over ranks, so all stop together) exceeds
    1.5 x `target_policy_kl`. `before_step()` runs before each optimizer step, the gradients in place.

    Statistics stay on the device and are read once at the end, so the loop never waits on the host.
    """
    model.train()
    stats: list[MicroStats] = []
    finite = torch.ones((), dtype=torch.bool, device=exp.input_ids.device)
    micro = args.mini_batch_size // args.gradient_accumulation_steps
    for _epoch in range(args.ppo_epochs):
        perm = torch.randperm(args.batch_size)
        epoch_start = len(stats)
        for u in range(0, args.batch_size, micro):
            with accelerator.accumulate(model):
                loss, micro_stats = micro_step_loss(model, exp.select(perm[u : u + micro]), args)
                finite &= torch.isfinite(loss.detach())
                accelerator.backward(loss)
                if accelerator.sync_gradients and args.max_grad_norm > 0:
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                if accelerator.sync_gradients and before_step is not None:
                    before_step()
                optimizer.step()
                optimizer.zero_grad()
            stats.append(micro_stats)
        if args.early_stopping:
            epoch_kl = torch.stack([s.approx_kl for s in stats[epoch_start:]]).mean()
            if accelerator.reduce(epoch_kl, "mean") > 1.5 * args.target_policy_kl:
                break
    names = [f.name for f in dataclasses.fields(MicroStats)]
    per_batch = torch.stack([torch.stack([getattr(s, k) for s in stats]) for k in names]).tolist()  # one host sync
    means = {k: sum(v) / len(v) if k != "skipped" else sum(v) for k, v in zip(names, per_batch)}
    return UpdateStats(**means, finite=bool(finite))
