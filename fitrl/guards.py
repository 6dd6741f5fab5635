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
- `template`, `prompt_length`, `stop_token`: GRPO's prompts as rendered open no block the format reward
  expects the completion to open, at most a tenth are dropped as too long, and the token the chat
  template closes an assistant turn with is one generation stops at.
- `reward_tokenizer`: PPO's reward model reads the policy's text decoded and re-encoded with its own
  tokenizer; on the first batch at most 2% of the characters may be lost on the way (a tokenizer
  without the policy's characters reads them as unknown tokens), and no text is cut by its length limit.
- `format_only`: GRPO's rewards all score the format and beta is 0 (the policy then games the format
  with empty content, FAI-RL#96).
- `reward_hacking` (`HackingGuard`): the training reward rises while a score the policy never trains
  on (held-out accuracy, a second judge) falls (autocontext#1076: 0.63 -> 0.58 as the reward rose).
- the in-run monitors (`Monitors`): each logged step's KL, entropy, clipping, completion length,
  repetition (`repetition`) against the stage's limits (`Limit`).

A guard that fires warns once, naming the step and the numbers; with `strict_guards` it stops the run
instead (exit 1; the checkpoints saved so far stay). `Health` keeps each guard's verdict for the
`health` object of `run_info.json` and the report.
"""

from __future__ import annotations

import contextlib
import difflib
import math
import os
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from fitrl.artifacts import GuardVerdict
from fitrl.config import RunFailed, UsageError

# A per-token KL of the policy to itself at step 0 above this is not rounding (fp32 gives ~1e-7, bf16 ~1e-3).
REFERENCE_KL_TOLERANCE = 0.01
CONSTANT_REWARD_STD = 1e-6
# Optimizer steps whose gradient may all be zero (batches without signal) before the gradient guard fires.
STEPS_WITHOUT_SIGNAL = 8


@dataclass
class Health:
    """Each guard's verdict in a run: `{"passed": bool, "saw": what it saw, "step": where it fired}` (passed
    None: it could not run, and `saw` says why), and the
    seconds the guards' own work took in this process (`timed`), for `run_info.json`'s `guard_seconds`."""

    strict: bool = False
    seen: dict[str, dict[str, Any]] = field(default_factory=dict)
    seconds: float = 0.0

    @contextlib.contextmanager
    def timed(self) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - start

    def passed(self, guard: str, saw: str) -> None:
        if self.seen.get(guard, {}).get("passed", True) is not False:
            self.seen[guard] = {"passed": True, "saw": saw}

    def not_run(self, guard: str, why: str) -> None:
        """A guard that cannot run in this run (what it reads is not there): `passed` is None, so that no
        report counts it as passed."""
        self.seen[guard] = {"passed": None, "saw": f"not run: {why}"}

    def failed(self, guard: str, saw: str, step: int) -> None:
        """Warn once with what the guard saw at `step`; with `strict_guards`, stop the run instead."""
        if self.seen.get(guard, {}).get("passed") is False:
            return
        self.seen[guard] = {"passed": False, "saw": saw, "step": step}
        if self.strict:
            raise RunFailed(f"guard '{guard}' at step {step}: {saw}; strict_guards stopped the run")
        if os.environ.get("RANK", "0") == "0":  # every rank sees the same: one warning
            warnings.warn(f"guard '{guard}' at step {step}: {saw}", stacklevel=2)

    def verdicts(self) -> dict[str, GuardVerdict]:
        """Each guard's verdict as `run_info.json` holds it."""
        return {k: GuardVerdict(**v) for k, v in self.seen.items()}


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
        with self.health.timed():
            self._check(model)

    def _check(self, model: torch.nn.Module) -> None:
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


def check_reference(
    kl_per_token: float,
    health: Health,
    step: int,
    what: str = "KL to the reference",
    unit: str = "per token",
) -> None:
    """At its first step, before any update, the policy is its reference: their KL (`what`) is ~0.
    PPO reads its own per-token KL; DPO and GRPO read trl's first measured log-ratios (`reference_guard`)."""
    if abs(kl_per_token) > REFERENCE_KL_TOLERANCE:
        health.failed(
            "reference",
            f"{what} is {kl_per_token:.4f} {unit} before any update (should be ~0): the policy's forward does "
            "not match its reference's (padding, EOS, dtype, dropout, top_k/top_p, precomputed log-probs)",
            step,
        )
    else:
        health.passed("reference", f"{what} {kl_per_token:.1e} {unit} before any update")


def repetition(sequences: list[list[int]], n: int = 3) -> float:
    """The mean share of each sequence's n-grams that repeat one earlier in it (Welleck et al.'s seq-rep-n):
    0 for text that never repeats itself, near 1 for a loop of one phrase. Sequences shorter than `n` + 1
    tokens are left out (their one n-gram cannot repeat); NaN when none is long enough."""
    shares = []
    for ids in sequences:
        grams = [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]
        if len(grams) >= 2:
            shares.append(1 - len(set(grams)) / len(grams))
    return sum(shares) / len(shares) if shares else math.nan


# Of the first batch's characters, what the reward tokenizer may lose (read as unknown) before the guard fires.
ROUND_TRIP_LOSS = 0.02


def _lost(text: str, back: str) -> int:
    """How many of `text`'s characters `back` lacks, whitespace and case aside (an uncased tokenizer, one
    that spaces punctuation, reads the same text)."""
    a, b = "".join(text.split()).casefold(), "".join(back.split()).casefold()
    matched = sum(block.size for block in difflib.SequenceMatcher(None, a, b, autojunk=False).get_matching_blocks())
    return len(a) - matched


def check_reward_tokenizer(texts: list[str], policy_tokenizer: Any, reward_tokenizer: Any, health: Health) -> None:
    """The first batch's texts (query + response, as decoded from the policy's tokens) through the reward
    model's tokenizer and back: what does not come back (a character it reads as unknown) the reward
    model never sees, and a text over its length limit is cut before scoring. A reward function (no
    tokenizer) reads the text itself."""
    if reward_tokenizer is None:
        health.passed("reward_tokenizer", "a reward function reads the text itself")
        return
    same = reward_tokenizer is policy_tokenizer or (
        type(reward_tokenizer) is type(policy_tokenizer)
        and reward_tokenizer.get_vocab() == policy_tokenizer.get_vocab()
    )
    which = "the policy's own tokenizer" if same else f"its own tokenizer ({len(reward_tokenizer):,} tokens)"
    limit = getattr(reward_tokenizer, "model_max_length", None) or math.inf
    lost, cut, worst = 0, 0, (0, "", [])
    for text in texts:
        ids = reward_tokenizer(text, add_special_tokens=False).input_ids
        cut += len(ids) > limit
        n = _lost(text, reward_tokenizer.decode(ids, skip_special_tokens=True))
        lost, worst = lost + n, max(worst, (n, text, ids), key=lambda w: w[0])
    share = lost / max(1, sum(len("".join(t.split())) for t in texts))
    if share > ROUND_TRIP_LOSS:
        _, text, ids = worst
        health.failed(
            "reward_tokenizer",
            f"the reward model's tokenizer ({which}) loses {share:.1%} of the first batch's characters: "
            f"{text[:60]!r} reads as {reward_tokenizer.decode(ids)[:60]!r}; score with a reward model whose "
            "tokenizer covers the policy's text",
            1,
        )
    elif cut:
        health.failed(
            "reward_tokenizer",
            f"{cut} of {len(texts)} texts are longer than the reward model's {limit} tokens and are cut before "
            "scoring; shorten the responses or use a reward model with a longer context",
            1,
        )
    else:
        health.passed("reward_tokenizer", f"the first {len(texts)} texts read back through {which}, {share:.1%} lost")


@dataclass(frozen=True)
class Limit:
    """One in-run monitor: the logged metric `key` above `threshold` (`kind="above"`), below it
    (`kind="below"`), or below `threshold` times its first logged value (`kind="below_share"`), for
    `steps` logged steps in a row."""

    guard: str
    key: str
    kind: str  # "above" | "below" | "below_share"
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
        self.extreme: dict[tuple[str, str], float] = {}
        self.streak: dict[Limit, int] = {}

    def __call__(self, row: dict[str, Any], step: int) -> None:
        with self.health.timed():
            self._check(row, step)

    def _check(self, row: dict[str, Any], step: int) -> None:
        for lim in self.limits:
            value = row.get(lim.key)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                continue
            first = self.first.setdefault(lim.key, float(value))
            bound = lim.threshold * first if lim.kind == "below_share" else lim.threshold
            beyond = value > bound if lim.kind == "above" else value < bound
            pick = max if lim.kind == "above" else min
            self.extreme[(lim.key, lim.kind)] = pick(self.extreme.get((lim.key, lim.kind), value), value)
            self.streak[lim] = self.streak.get(lim, 0) + 1 if beyond else 0
            if self.streak[lim] >= lim.steps:
                relation = f"{'above' if lim.kind == 'above' else 'below'} {bound:.3g}"
                if lim.kind == "below_share":
                    relation += f" ({lim.threshold:g} x its first {first:.3g})"
                run = f" for {lim.steps} logged steps" if lim.steps > 1 else ""
                self.health.failed(lim.guard, f"{lim.key} {value:.3g} is {relation}{run}: {lim.meaning}", step)

    def finish(self) -> None:
        saw: dict[str, list[str]] = {}  # a guard may watch two bounds (length: too long, too short)
        for lim in self.limits:
            if (lim.key, lim.kind) in self.extreme:
                word = "max" if lim.kind == "above" else "min"
                saw.setdefault(lim.guard, []).append(f"{lim.key} {word} {self.extreme[(lim.key, lim.kind)]:.3g}")
        for guard, seen in saw.items():
            self.health.passed(guard, ", ".join(seen))


class HackingGuard:
    """Reward hacking: a held-out score (`score_name`) measured every few steps falls `drop` or more below
    its first measurement while the training reward (fed each logged step) is above its first logged
    values. `share`: the score is a share, shown as a percentage. `advice` is the way out it names."""

    WINDOW = 5  # logged rewards averaged at each end: one step's reward is noisy

    def __init__(self, health: Health, score_name: str, drop: float, advice: str, share: bool = True) -> None:
        self.health, self.score_name, self.drop, self.advice = health, score_name, drop, advice
        self.show = "{:.0%}" if share else "{:+.2f}"
        self.rewards: list[float] = []
        self.scores: list[tuple[int, float]] = []  # (step, score)

    def reward(self, value: float) -> None:
        if math.isfinite(value):
            self.rewards.append(float(value))

    def score(self, step: int, value: float) -> None:
        """A held-out measurement at `step`; the first is the baseline."""
        self.scores.append((step, value))
        (step0, first), rewards = self.scores[0], self.rewards
        if len(self.scores) < 2 or len(rewards) < 2:
            return
        k = min(self.WINDOW, len(rewards) // 2)
        reward0, reward1 = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
        if value <= first - self.drop and reward1 > reward0:
            self.health.failed(
                "reward_hacking",
                f"{self.score_name} fell {self.show.format(first)} -> {self.show.format(value)} (steps {step0} -> "
                f"{step}) while the training reward rose {reward0:.3g} -> {reward1:.3g}: the policy games the "
                f"reward; {self.advice}",
                step,
            )

    def unread(self, step: int) -> bool:
        """After a first reading, none at `step` yet: the end of a run whose length is not a multiple of the
        readings' interval (the final policy is read too, for the over-optimisation audit)."""
        return bool(self.scores) and self.scores[-1][0] != step

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps, so that a resumed run compares against the same first reading."""
        return {"rewards": list(self.rewards), "scores": [list(s) for s in self.scores]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rewards = [float(r) for r in state["rewards"]]
        self.scores = [(int(step), float(v)) for step, v in state["scores"]]

    def finish(self) -> None:
        if self.scores:
            path = " -> ".join(self.show.format(v) for _, v in self.scores)
            self.health.passed("reward_hacking", f"{self.score_name} {path} at steps {[s for s, _ in self.scores]}")


# Blocks a format reward expects the completion to open; a chat template that opens one itself (a
# thinking model's ends the prompt with `<think>`) leaves the completion without it.
OPENING_TAGS = ("<reasoning>", "<think>")
DROPPED_SHARE = 0.1  # of the prompts, dropped as longer than the limit, before the guard fires


def check_stop_token(tokenizer: Any, stop_ids: list[int], health: Health) -> None:
    """The chat template closes an assistant turn with a token generation stops at: a model taught that
    template ends its answers with it, and completions that never stop run to the length limit (Llama
    3's base generation config stops at <|end_of_text|>, its chat template closes turns with <|eot_id|>)."""
    marker = "fitrl-stop-check"
    try:
        chat = [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": marker}]
        after = tokenizer.apply_chat_template(chat, tokenize=False).split(marker, 1)[1]
    except Exception as e:  # a template that takes no such chat: nothing to read
        health.passed("stop_token", f"not checked: the chat template renders no assistant turn ({type(e).__name__})")
        return
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    closing = next((i for i in tokenizer(after, add_special_tokens=False).input_ids if i in special), None)
    stops = ", ".join(repr(tokenizer.decode([i])) for i in stop_ids)
    if closing is None:
        health.passed("stop_token", f"the template closes an assistant turn with no special token; stops: {stops}")
    elif closing not in stop_ids:
        health.failed(
            "stop_token",
            f"the chat template closes an assistant turn with {tokenizer.decode([closing])!r} but generation stops "
            f"only at {stops}: completions will run to max_completion_length; add it to the model's "
            "generation_config.json eos_token_id, or make it the tokenizer's eos_token",
            0,
        )
    else:
        health.passed("stop_token", f"the template closes an assistant turn with {tokenizer.decode([closing])!r}")


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
    check_prompt_length(dropped, total, limit, health)


def check_prompt_length(dropped: int, total: int, limit: int, health: Health, cut: int = 0) -> None:
    """Few prompts are over the length limit: dropped ones are data lost, cut ones lost their start."""
    share = (dropped + cut) / max(total, 1)
    what = f"{dropped} of {total} prompts over {limit} tokens dropped" + (f", {cut} cut" if cut else "")
    if share > DROPPED_SHARE:
        health.failed("prompt_length", f"{what} ({share:.0%}); raise the prompt length limit", 0)
    else:
        health.passed("prompt_length", what)


Held = TypeVar("Held")


def heldout_set(health: Health, off: str | None, load: Callable[[], Held], fix: str) -> Held | None:
    """What the reward-hacking guard reads, from a held-out split that training never sees (`load` reads
    it; one data file's held-out share, `fitrl.data`). None, the guard recorded as not run, when it is
    `off` (the reason); a split that does not load is a usage error ending with `fix`."""
    if off is not None:
        health.not_run("reward_hacking", off)
        return None
    try:
        return load()
    except UsageError as e:
        raise UsageError(f"{e}; {fix}") from None
