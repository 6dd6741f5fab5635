"""Guards against a run that trains silently wrong: curves that look healthy while nothing is learned.

Each guard checks one failure the field keeps meeting, once, where it first shows:

- `trainable`: there is something to train (a frozen adapter trains nothing while its curves look
  normal, trl#6700). Always a stop: exit 1 before the first step.
- `gradients`: every trainable tensor receives a gradient after the first optimizer step that moved
  any (LoRA's B starts at zero, so A's first gradient is zero: the check waits a step).
- `reference`: at step 0 the policy is its reference, so their KL is 0 within float tolerance (a
  sampling/forward mismatch otherwise: trl#925, #1005).
- `reward_signal`: the reward of the first batch is not constant (a label the classifier never
  predicts, a saturated probability, a reward function that reads nothing: no signal to learn from).

A guard that fires warns once, naming the step and the numbers; with `strict_guards` it stops the run
instead (exit 1; the checkpoints saved so far stay). `Health` keeps each guard's verdict for the
`health` object of `run_info.json` and the report.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from fitrl.config import RunFailed

# A per-token KL of the policy to itself at step 0 above this is not rounding (fp32 gives ~1e-7, bf16 ~1e-3).
REFERENCE_KL_TOLERANCE = 0.01
CONSTANT_REWARD_STD = 1e-6
# Optimizer steps whose gradient may all be zero (batches without signal) before the gradient guard fires.
STEPS_WITHOUT_SIGNAL = 8


@dataclass
class Health:
    """Each guard's verdict in a run: `{"passed": bool, "saw": what it saw, "step": where it fired}`."""

    strict: bool = False
    seen: dict[str, dict[str, Any]] = field(default_factory=dict)

    def passed(self, guard: str, saw: str) -> None:
        if self.seen.get(guard, {}).get("passed", True):
            self.seen[guard] = {"passed": True, "saw": saw}

    def failed(self, guard: str, saw: str, step: int) -> None:
        """Warn once with what the guard saw at `step`; with `strict_guards`, stop the run instead."""
        if guard in self.seen and not self.seen[guard]["passed"]:
            return
        self.seen[guard] = {"passed": False, "saw": saw, "step": step}
        if self.strict:
            raise RunFailed(f"guard '{guard}' at step {step}: {saw}; strict_guards stopped the run")
        if os.environ.get("RANK", "0") == "0":  # every rank sees the same: one warning
            warnings.warn(f"guard '{guard}' at step {step}: {saw}", stacklevel=2)

    def to_json(self) -> dict[str, dict[str, Any]]:
        return {k: dict(v) for k, v in self.seen.items()}


def check_trainable(model: torch.nn.Module, health: Health) -> int:
    """The number of trainable parameters; none is a stop, whatever `strict_guards` says."""
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if n == 0:
        raise RunFailed(
            "nothing to train: the model has 0 trainable parameters (a frozen adapter? trl#6700); "
            "check the LoRA settings (lora_target_modules) and that the adapter is trainable"
        )
    health.passed("trainable", f"{n:,} trainable parameters")
    return n


class GradientGuard:
    """Every trainable tensor receives a gradient: called before each optimizer step, it decides at
    the step after the first one whose gradient is not all zero. LoRA's A gets none until B has moved
    off zero, and a batch without signal (GRPO's groups of equal rewards, zero advantages) gives none
    at all; a gradient that is `None` everywhere means the loss does not reach the trainable tensors.
    `sharded` (DeepSpeed, FSDP): the gradients are not on the parameters, nothing to read."""

    def __init__(self, health: Health, sharded: bool = False) -> None:
        self.health, self.sharded = health, sharded
        self.step, self.moved_at, self.decided = 0, None, False

    def __call__(self, model: torch.nn.Module) -> None:
        params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        if self.sharded or self.decided or not params:
            return
        self.step += 1
        silent = [name for name, p in params if p.grad is None or not bool(p.grad.detach().ne(0).any())]
        if len(silent) == len(params):
            if all(p.grad is None for _, p in params):
                self._fail(f"none of the {len(params)} trainable tensors received a gradient: the loss does not "
                           "reach them (a detached or frozen path), so nothing trains")  # fmt: skip
            elif self.step >= STEPS_WITHOUT_SIGNAL:
                self._fail(f"the gradient was zero in each of the first {self.step} optimizer steps: nothing trains "
                           "(a reward without signal, a zero learning signal)")  # fmt: skip
            return
        if self.moved_at is None:  # LoRA's A may still read zero: the next step decides
            self.moved_at = self.step
            return
        self.decided = True
        if silent:
            self._fail(f"{len(silent)} of {len(params)} trainable tensors received no gradient after the first "
                       f"optimizer step that moved the others (first: {silent[0]}): they do not train")  # fmt: skip
        else:
            self.health.passed("gradients", f"all {len(params)} trainable tensors received gradients")

    def _fail(self, saw: str) -> None:
        self.decided = True
        self.health.failed("gradients", saw, self.step)


def check_reward_signal(
    rewards: torch.Tensor | list[float], health: Health, step: int, std: float | None = None, where: str = "batch"
) -> None:
    """The first `where`'s rewards (or their `std` as logged: GRPO's first logged step): constant is no signal."""
    values = torch.as_tensor(rewards, dtype=torch.float64).flatten()
    spread = std if std is not None else (values.std().item() if values.numel() > 1 else math.nan)
    if math.isnan(spread):
        return
    mean = values.mean().item() if values.numel() else math.nan
    if spread <= CONSTANT_REWARD_STD * max(1.0, abs(mean) if not math.isnan(mean) else 1.0):
        health.failed(
            "reward_signal",
            f"the reward is constant on the first {where} (mean {mean:.4g}, std {spread:.2g}): the policy gets no "
            "signal; usually a label the reward model never predicts, a saturated probability, or a reward "
            "that cannot read the output",
            step,
        )
    else:
        health.passed("reward_signal", f"reward std {spread:.3g} on the first {where}")


def check_reference(kl_per_token: float, health: Health, step: int) -> None:
    """PPO at its first step, before any update: the policy is its reference, so their KL is ~0."""
    if abs(kl_per_token) > REFERENCE_KL_TOLERANCE:
        health.failed(
            "reference",
            f"KL to the reference is {kl_per_token:.4f} per token before any update (should be ~0): the "
            "sampling does not match the policy's forward (padding, EOS, dtype, top_k/top_p)",
            step,
        )
    else:
        health.passed("reference", f"KL to the reference {kl_per_token:.1e} per token before any update")
