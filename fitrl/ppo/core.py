"""PPO for language models as pure functions: the maths of Ziegler et al. (2019) and TRL 0.x's PPOTrainer.

Shapes: B = sequences in the batch, T = response tokens (right-padded), V = vocabulary. `mask` is 1 on
real response tokens and 0 on padding; every reduction below ignores the padding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

KLEstimator = Literal["kl", "abs", "mse", "full"]


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        n = mask.sum()
        if n < 2:
            raise ValueError("masked_var needs at least 2 unmasked values for the unbiased estimate")
        var = var * n / (n - 1)
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(x - mean) / std over the unmasked entries; `shift_mean=False` keeps the mean (used for rewards)."""
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    whitened = (x - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask


def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p(token) under `logits`: (B, T, V), (B, T) -> (B, T).

    The taken token's logit minus the log-normaliser, one sequence at a time: no (B, T, V) log-softmax
    (nor an fp32 copy of half-precision logits) is ever built, so the peak is one (T, V) temporary. With
    gpt-neox-20b's 50k vocabulary that is most of the memory the log-probs cost.
    """
    rows = [_row_logprobs(row.float(), tok) for row, tok in zip(logits, tokens)]
    return torch.stack(rows) if rows else logits.new_zeros(tokens.shape, dtype=torch.float32)


def _row_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of each position's next-token distribution: (B, T, V) -> (B, T), a sequence at a time."""
    rows = []
    for row in logits:
        logp = F.log_softmax(row.float(), dim=-1)
        rows.append(-(logp.exp() * logp).sum(-1))
    return torch.stack(rows) if rows else logits.new_zeros(logits.shape[:2], dtype=torch.float32)


def kl_penalty(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    kind: KLEstimator = "kl",
    logits: torch.Tensor | None = None,
    ref_logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) at the sampled tokens: (B, T).

    'kl': log p - log q (unbiased, can be negative per token); 'abs': |log p - log q|;
    'mse': (log p - log q)^2 / 2; 'full': the exact KL over the whole vocabulary (needs both logits).
    """
    if kind == "kl":
        return logprobs - ref_logprobs
    if kind == "abs":
        return (logprobs - ref_logprobs).abs()
    if kind == "mse":
        return 0.5 * (logprobs - ref_logprobs).square()
    if kind == "full":
        if logits is None or ref_logits is None:
            raise ValueError("kl_penalty 'full' needs the policy and reference logits")
        rows = []
        for row, ref_row in zip(logits, ref_logits):  # a sequence at a time, as above
            logp, logq = F.log_softmax(row.float(), -1), F.log_softmax(ref_row.float(), -1)
            rows.append((logp.exp() * (logp - logq)).sum(-1))
        return torch.stack(rows)
    raise ValueError(f"unknown KL estimator {kind!r}")


def per_token_rewards(
    scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, kl_coef: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reward per response token: -kl_coef * KL everywhere, plus the sequence's score on its last token.

    scores (B,), kl (B, T), mask (B, T) -> rewards (B, T), non_score_rewards (B, T).
    """
    non_score = -kl_coef * kl * mask
    rewards = non_score.clone()
    last = mask.sum(1).long() - 1  # index of each sequence's last real token
    rewards[torch.arange(len(scores)), last] += scores
    return rewards, non_score


def gae(
    values: torch.Tensor, rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 0.95
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over right-padded responses: (B, T) x3 -> advantages, returns.

    Padding has zero value and reward, so the bootstrap after a sequence's last token is 0.
    Returns are advantages + values (the value head's regression target).
    """
    values, rewards = values * mask, rewards * mask
    advantages = torch.zeros_like(rewards)
    last_gae = torch.zeros_like(rewards[:, 0])
    T = rewards.shape[1]
    for t in reversed(range(T)):
        next_value = values[:, t + 1] if t + 1 < T else torch.zeros_like(last_gae)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last_gae = delta + gamma * lam * last_gae
        advantages[:, t] = last_gae
    advantages = advantages * mask
    return advantages, (advantages + values) * mask


@dataclass
class PolicyLossOutput:
    loss: torch.Tensor
    clipfrac: torch.Tensor
    approx_kl: torch.Tensor
    ratio_mean: torch.Tensor


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cliprange: float = 0.2,
) -> PolicyLossOutput:
    """PPO's clipped surrogate: mean over tokens of max(-A r, -A clip(r, 1-e, 1+e)), r = p / p_old."""
    log_ratio = (logprobs - old_logprobs) * mask
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    loss = masked_mean(torch.max(unclipped, clipped), mask)
    return PolicyLossOutput(
        loss=loss,
        clipfrac=masked_mean((clipped > unclipped).float(), mask),
        approx_kl=0.5 * masked_mean(log_ratio.square(), mask),
        ratio_mean=masked_mean(ratio, mask),
    )


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, cliprange_value: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss 0.5 * mean(max((v - R)^2, (clip(v, v_old +- e) - R)^2)) and its clip fraction."""
    clipped_values = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
    unclipped_sq, clipped_sq = (values - returns).square(), (clipped_values - returns).square()
    loss = 0.5 * masked_mean(torch.max(unclipped_sq, clipped_sq), mask)
    return loss, masked_mean((clipped_sq > unclipped_sq).float(), mask)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R): 1 is a perfect value head, 0 no better than a constant."""
    var_returns = masked_var(returns, mask, unbiased=False)
    if var_returns <= 0:
        return float("nan")
    return float(1 - masked_var(returns - values, mask, unbiased=False) / var_returns)


class AdaptiveKLController:
    """Ziegler et al.'s proportional controller: moves kl_coef so the measured KL tracks `target`."""

    def __init__(self, init: float, target: float, horizon: int):
        self.value, self.target, self.horizon = init, target, horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        error = max(-0.2, min(0.2, current_kl / self.target - 1))
        self.value *= 1 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = state["value"]


class FixedKLController:
    def __init__(self, value: float):
        self.value = value

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = state["value"]


class RunningMoments:
    """Running mean and std of scores (Chan et al.'s parallel update), to scale or normalise rewards."""

    def __init__(self) -> None:
        self.mean, self.var, self.count = 0.0, 1.0, 1e-24

    def update(self, xs: torch.Tensor) -> None:
        xs = xs.double()
        n, batch_mean = xs.numel(), xs.mean().item()
        batch_var = xs.var(unbiased=False).item() if n > 1 else 0.0
        delta, total = batch_mean - self.mean, self.count + n
        m2 = self.var * self.count + batch_var * n + delta**2 * self.count * n / total
        self.mean += delta * n / total
        self.var, self.count = m2 / total, total

    @property
    def std(self) -> float:
        return math.sqrt(max(self.var, 0.0)) if self.count > 1 else 1.0

    def state_dict(self) -> dict[str, float]:
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.mean, self.var, self.count = state["mean"], state["var"], state["count"]
