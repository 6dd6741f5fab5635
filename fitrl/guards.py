"""Guards against a run that trains silently wrong: curves that look healthy while nothing is learned.

Each guard checks one failure the field keeps meeting, once, where it first shows:

- `trainable`: there is something to train (a frozen adapter trains nothing while its curves look
  normal, trl#6700). Always a stop: exit 1 before the first step.
- `gradients`: every trainable tensor receives a gradient once the parameters have moved (LoRA's B
  starts at zero, so A's first gradient is zero: the check waits for a step that moved them).
- `reference`: at step 0 the policy is its reference, so their KL is 0 within float tolerance (a
  sampling/forward mismatch otherwise: trl#925, #1005).
- `reward_signal`: the reward of the first batch is not constant (a label the classifier never
  predicts, a saturated probability, a reward function that reads nothing: no signal to learn from).
- `template`, `prompt_length`: GRPO's prompts as rendered open no block the format reward expects
  the completion to open, and at most a tenth are dropped as too long.
- the in-run monitors (`Monitors`): each logged step's KL, entropy, clipping, completion length
  against the stage's limits (`Limit`).

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
    """Every trainable tensor receives a gradient. Called before each optimizer step, it decides at
    the first call after the parameters moved: LoRA's A gets no gradient until B has moved off zero,
    which a zero learning rate (the first warmup step) or a batch without signal (GRPO's groups of
    equal rewards) puts off. A gradient that is `None` everywhere means the loss does not reach the
    trainable tensors; one that stays zero for `STEPS_WITHOUT_SIGNAL` steps means nothing trains.
    `sharded` (DeepSpeed, FSDP): the gradients are not on the parameters, nothing to read."""

    def __init__(self, health: Health, sharded: bool = False) -> None:
        self.health, self.sharded = health, sharded
        self.step, self.decided = 0, False
        self.last: list[float] | None = None  # each trainable tensor's sum of |values| at the last call

    def __call__(self, model: torch.nn.Module) -> None:
        params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        if self.sharded or self.decided or not params:
            return
        self.step += 1
        silent = [name for name, p in params if p.grad is None or not bool(p.grad.detach().ne(0).any())]
        sums = self._sums(params)
        moved, self.last = self.last is not None and sums != self.last, sums
        if len(silent) == len(params):
            if all(p.grad is None for _, p in params):
                self._fail(f"none of the {len(params)} trainable tensors received a gradient: the loss does not "
                           "reach them (a detached or frozen path), so nothing trains")  # fmt: skip
            elif self.step >= STEPS_WITHOUT_SIGNAL:
                self._fail(f"the gradient was zero in each of the first {self.step} optimizer steps: nothing trains "
                           "(a reward without signal, a zero learning signal)")  # fmt: skip
            return
        if not moved:  # LoRA's A may still read zero: a call after the parameters moved decides
            return
        self.decided = True
        if silent:
            self._fail(f"{len(silent)} of {len(params)} trainable tensors received no gradient once the "
                       f"parameters had moved (first: {silent[0]}): they do not train")  # fmt: skip
        else:
            self.health.passed("gradients", f"all {len(params)} trainable tensors received gradients")

    @staticmethod
    def _sums(params: list[tuple[str, torch.Tensor]]) -> list[float]:
        with torch.no_grad():
            return torch.stack([p.detach().float().abs().sum() for _, p in params]).tolist()

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


@dataclass(frozen=True)
class Limit:
    """One in-run monitor: the logged metric `key` above `threshold` (`kind="above"`) or below
    `threshold` times its first logged value (`kind="below_share"`), for `steps` logged steps in a row."""

    guard: str
    key: str
    kind: str  # "above" | "below_share"
    threshold: float
    meaning: str  # what usually causes it, for the warning
    steps: int = 1


class Monitors:
    """The in-run monitors of a stage, fed each logged row: each `Limit` warns once (or stops under
    `strict_guards`) with the step and the numbers; `finish` records the rest as passed, with the
    extreme each saw."""

    def __init__(self, health: Health, limits: list[Limit]) -> None:
        self.health, self.limits = health, [lim for lim in limits if math.isfinite(lim.threshold)]
        self.first: dict[str, float] = {}
        self.extreme: dict[str, float] = {}
        self.streak: dict[Limit, int] = {}

    def __call__(self, row: dict[str, Any], step: int) -> None:
        for lim in self.limits:
            value = row.get(lim.key)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                continue
            first = self.first.setdefault(lim.key, float(value))
            bound = lim.threshold if lim.kind == "above" else lim.threshold * first
            beyond = value > bound if lim.kind == "above" else value < bound
            pick = max if lim.kind == "above" else min
            self.extreme[lim.key] = pick(self.extreme.get(lim.key, value), value)
            self.streak[lim] = self.streak.get(lim, 0) + 1 if beyond else 0
            if self.streak[lim] >= lim.steps:
                relation = (
                    f"above {bound:.3g}"
                    if lim.kind == "above"
                    else f"below {bound:.3g} ({lim.threshold:g} x its first {first:.3g})"
                )
                run = f" for {lim.steps} logged steps" if lim.steps > 1 else ""
                self.health.failed(lim.guard, f"{lim.key} {value:.3g} is {relation}{run}: {lim.meaning}", step)

    def finish(self) -> None:
        for lim in self.limits:
            if lim.key in self.extreme:
                word = "max" if lim.kind == "above" else "min"
                self.health.passed(lim.guard, f"{lim.key} {word} {self.extreme[lim.key]:.3g}")


# Blocks a format reward expects the completion to open; a chat template that opens one itself (a
# thinking model's ends the prompt with `<think>`) leaves the completion without it.
OPENING_TAGS = ("<reasoning>", "<think>")
DROPPED_SHARE = 0.1  # of the prompts, dropped as longer than the limit, before the guard fires


def check_prompts(rendered: str, dropped: int, total: int, limit: int, health: Health) -> None:
    """A policy stage's prompts before any step: the chat template opens no block the completion must
    open (ms-swift#9764: the format reward then reads 0), and few prompts are over the length limit."""
    opened = next((t for t in OPENING_TAGS if rendered.rstrip().endswith(t)), None)
    if opened is not None:
        health.failed(
            "template",
            f"the chat template ends each prompt with {opened}: completions will lack the opening tag the format "
            "reward looks for, so it reads 0; use a template without it",
            0,
        )
    else:
        health.passed("template", "the rendered prompt opens no block the completion must open")
    share = dropped / max(total, 1)
    if share > DROPPED_SHARE:
        health.failed(
            "prompt_length",
            f"{dropped} of {total} prompts ({share:.0%}) are longer than {limit} tokens and were dropped; raise the "
            "prompt length limit",
            0,
        )
    else:
        health.passed("prompt_length", f"{dropped} of {total} prompts over {limit} tokens, dropped")
