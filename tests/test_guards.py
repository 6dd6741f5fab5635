"""The guards against a run that trains silently wrong (`fitrl.guards`), each built to fire on a tiny
model, and their wiring into trl's loop (`fitrl.hf_trainer.guard_callback`). PPO's, on the demo, are
in tests/test_ppo.py; a clean demo run's, every guard passed, in tests/test_demo_learns.py."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from fitrl.artifacts import GuardVerdict
from fitrl.config import RunFailed
from fitrl.guards import (
    STEPS_WITHOUT_SIGNAL,
    GradientGuard,
    Health,
    check_reference,
    check_reward_signal,
    check_trainable,
)
from fitrl.hf_trainer import guard_callback


class TwoBranches(nn.Module):
    """`used` feeds the loss; `unused` is trainable but never reaches it (a LoRA target off the path)."""

    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x).pow(2).mean()


def _backward(model: nn.Module) -> None:
    model.zero_grad(set_to_none=True)
    model(torch.randn(3, 4)).backward()


def _step(model: nn.Module) -> None:
    """What an optimizer step with a learning rate above zero does: the parameters with gradients move."""
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.sub_(0.1 * p.grad)


def test_a_frozen_model_stops_before_the_first_step() -> None:
    """trl#6700: a frozen adapter trains nothing while its curves look normal."""
    model = TwoBranches().requires_grad_(False)
    with pytest.raises(RunFailed, match="nothing to train: the model has 0 trainable parameters"):
        check_trainable(model, Health())
    health = Health()
    assert check_trainable(TwoBranches(), health) == 40
    assert health.verdicts() == {"trainable": GuardVerdict(passed=True, saw="40 trainable parameters")}


def test_a_tensor_off_the_loss_path_is_named_after_the_first_optimizer_step() -> None:
    model, health = TwoBranches(), Health()
    guard = GradientGuard(health)
    _backward(model)
    guard(model)  # some gradient: LoRA's A might still read zero until the parameters moved
    guard(model)  # a zero learning rate (the first warmup step) moved nothing: still undecided
    assert health.seen == {}
    _step(model)
    _backward(model)
    with pytest.warns(UserWarning, match=r"guard 'gradients' at step 3: 2 of 4 trainable tensors received no gradient"):
        guard(model)
    assert health.seen["gradients"] == {
        "passed": False,
        "saw": "2 of 4 trainable tensors received no gradient once the parameters had moved (first: "
        "unused.weight): they do not train",
        "step": 3,
    }
    with warnings.catch_warnings():  # once: the verdict stays, nothing more is said
        warnings.simplefilter("error")
        guard(model)


def test_no_gradient_at_all_fires_at_the_first_step_and_strict_guards_stop() -> None:
    model = TwoBranches()
    with pytest.raises(RunFailed, match="guard 'gradients' at step 1: none of the 4 trainable tensors"):
        GradientGuard(Health(strict=True))(model)  # a loss detached from every trainable tensor: no .grad


def test_batches_without_signal_wait_and_then_fire() -> None:
    """GRPO's groups of equal rewards give an all-zero gradient: not broken wiring, until it lasts."""
    model, health = TwoBranches(), Health()
    guard = GradientGuard(health)
    _backward(model)
    model.zero_grad(set_to_none=False)  # zeros, not None
    for _ in range(STEPS_WITHOUT_SIGNAL - 1):
        guard(model)
    assert health.seen == {}
    with pytest.warns(UserWarning, match=f"the gradient was zero in each of the first {STEPS_WITHOUT_SIGNAL}"):
        guard(model)


def test_lora_a_without_gradient_at_the_first_step_is_expected() -> None:
    """LoRA's B starts at zero, so A's first gradient is exactly zero: not a failure."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(TwoBranches(), LoraConfig(r=2, target_modules=["used"]))
    health = Health()
    guard = GradientGuard(health)
    _backward(model)
    assert not model.base_model.model.used.lora_A["default"].weight.grad.any()
    guard(model)
    with torch.no_grad():
        model.base_model.model.used.lora_B["default"].weight.add_(0.1)  # what the first step does
    _backward(model)
    guard(model)
    assert health.seen["gradients"] == {"passed": True, "saw": "all 2 trainable tensors received gradients"}


def test_a_constant_reward_and_a_policy_unlike_its_reference_are_named() -> None:
    health = Health()
    with pytest.warns(UserWarning, match=r"guard 'reward_signal' at step 1: the reward is constant"):
        check_reward_signal(torch.full((16,), 0.731), health, 1)
    check_reward_signal(torch.tensor([0.1, 0.9]), health, 2)  # too late: the first batch decided
    assert not health.seen["reward_signal"]["passed"]
    fine = Health()
    check_reward_signal(torch.tensor([0.1, 0.9, 0.5]), fine, 1)
    check_reference(3e-7, fine, 1)
    assert all(v["passed"] for v in fine.seen.values())
    with pytest.raises(RunFailed, match=r"guard 'reference' at step 1: KL to the reference is 0.2000 per token"):
        check_reference(0.2, Health(strict=True), 1)


def test_the_trainer_callback_runs_the_guards_in_trl_order() -> None:
    """What trl's loop calls: train begin, then before each optimizer step, then each log."""
    health = Health()
    callback = guard_callback(health, reward_std_key="reward_std")
    args, state = SimpleNamespace(deepspeed=None, fsdp=None), SimpleNamespace(global_step=1)
    with pytest.raises(RunFailed, match="nothing to train"):
        callback.on_train_begin(args, state, None, model=TwoBranches().requires_grad_(False))
    model = TwoBranches()
    callback.on_train_begin(args, state, None, model=model)
    for _ in range(2):
        _backward(model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            callback.on_pre_optimizer_step(args, state, None, model=model)
        _step(model)
    assert "guard 'gradients' at step 2" in str(caught[0].message)
    with pytest.warns(UserWarning, match="guard 'reward_signal'"):
        callback.on_log(args, state, None, logs={"reward": 1.5, "reward_std": 0.0})
    assert [k for k, v in health.seen.items() if not v["passed"]] == ["gradients", "reward_signal"]
    sharded = Health()  # DeepSpeed keeps the gradients off the parameters: nothing to read, nothing said
    GradientGuard(sharded, sharded=True)(TwoBranches())
    assert sharded.seen == {}


def test_the_in_run_monitors_fire_once_on_their_limits_and_record_the_rest() -> None:
    from fitrl.guards import Limit, Monitors

    health = Health()
    monitors = Monitors(
        health,
        [
            Limit("kl", "objective/kl", "above", 10.0, "runs away"),
            Limit("entropy", "objective/entropy", "below_share", 0.5, "collapses"),
            Limit("clipping", "ppo/clipfrac", "above", 0.3, "too large", steps=3),
            Limit("off", "objective/kl", "above", float("inf"), "never"),
        ],
    )
    rows = [  # entropy halves past its floor at step 3; clipping is high twice, low, then three times
        {"objective/kl": 1.0, "objective/entropy": 4.0, "ppo/clipfrac": 0.5},
        {"objective/kl": 2.0, "objective/entropy": 3.0, "ppo/clipfrac": 0.5},
        {"objective/kl": 3.0, "objective/entropy": 1.9, "ppo/clipfrac": 0.1},
        {"objective/kl": 4.0, "objective/entropy": 1.0, "ppo/clipfrac": 0.4},
        {"objective/kl": 5.0, "objective/entropy": 3.0, "ppo/clipfrac": 0.4},
        {"objective/kl": 6.0, "objective/entropy": 3.0, "ppo/clipfrac": 0.4},
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, row in enumerate(rows, 1):
            monitors(row, step)
        monitors.finish()
    assert [str(w.message) for w in caught] == [
        "guard 'entropy' at step 3: objective/entropy 1.9 is below 2 (0.5 x its first 4): collapses",
        "guard 'clipping' at step 6: ppo/clipfrac 0.4 is above 0.3 for 3 logged steps: too large",
    ]
    assert health.seen["kl"] == {"passed": True, "saw": "objective/kl max 6"}
    assert "off" not in health.seen  # an infinite limit is off

    def kl_bounds(health: Health) -> Monitors:  # PPO's two bounds on one metric: runaway, and far below 0
        return Monitors(
            health, [Limit("kl", "objective/kl", "above", 30.0, "r"), Limit("kl", "objective/kl", "below", -1.0, "m")]
        )

    calm = Health()
    monitors = kl_bounds(calm)
    for step, kl in enumerate([0.5, 3.0, -0.2], 1):
        monitors({"objective/kl": kl}, step)
    monitors.finish()
    assert calm.seen["kl"] == {"passed": True, "saw": "objective/kl max 3, objective/kl min -0.2"}
    mismatched = kl_bounds(Health())
    mismatched({"objective/kl": 0.5}, 1)
    with pytest.warns(UserWarning, match=r"guard 'kl' at step 2: objective/kl -2.5 is below -1: m"):
        mismatched({"objective/kl": -2.5}, 2)


def test_repetition_is_the_share_of_repeated_ngrams() -> None:
    """seq-rep-3 by hand: (1,2,3,1,2,3) has 4 trigrams, 3 distinct: 1/4; five 5s: 3 trigrams, 1 distinct: 2/3."""
    from fitrl.guards import repetition

    assert repetition([[1, 2, 3, 1, 2, 3], [1, 2, 3, 4], [5, 5, 5, 5, 5], [7, 8, 9]]) == pytest.approx(
        (0.25 + 0.0 + 2 / 3) / 3
    )
    assert repetition([[1, 2], [3]]) != repetition([[1, 2], [3]])  # NaN: none long enough to repeat itself


def test_the_hacking_guard_fires_when_the_held_out_score_falls_as_the_reward_rises() -> None:
    from fitrl.guards import HackingGuard

    health = Health()
    guard = HackingGuard(health, "held-out accuracy", 0.1, "check the rewards")
    guard.score(0, 0.30)
    for r in [0.2, 0.2, 0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1]:
        guard.reward(r)
    guard.score(10, 0.25)  # a 5-point fall: under the 10 points that fire
    assert "reward_hacking" not in health.seen
    with pytest.warns(UserWarning, match=r"held-out accuracy fell 30% -> 15% \(steps 0 -> 20\) while the training "):
        guard.score(20, 0.15)
    assert health.seen["reward_hacking"]["step"] == 20
    # the same fall while the reward fell too is a policy getting worse, not gaming its reward
    calm, falling = Health(), HackingGuard(Health(), "x", 0.1, "")
    falling.health = calm
    falling.score(0, 0.3)
    for r in [1.0, 0.9, 0.8, 0.7]:
        falling.reward(r)
    falling.score(10, 0.1)
    falling.finish()
    assert calm.seen["reward_hacking"] == {"passed": True, "saw": "x 30% -> 10% at steps [0, 10]"}
    # a run's end is read unless its last reading was at that step (a run of 10 steps, read every 10)
    assert falling.unread(12) and not falling.unread(10) and not HackingGuard(Health(), "x", 0.1, "").unread(0)


def _word_tokenizer(words: list[str], max_length: int = 512) -> object:
    """A word-level tokenizer knowing only `words` (the rest reads as [UNK]), as a reward model's might."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[UNK]", "[PAD]", *words])}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=raw, unk_token="[UNK]", pad_token="[PAD]", model_max_length=max_length
    )


def test_the_reward_tokenizer_round_trip_names_texts_it_cannot_read_or_cuts() -> None:
    from fitrl.guards import check_reward_tokenizer

    texts = ["this film is great", "a dull film", "great acting", "this is dull"]
    full = _word_tokenizer(["this", "film", "is", "great", "a", "dull", "acting"])
    health = Health()
    check_reward_tokenizer(texts, full, full, health)
    assert health.seen["reward_tokenizer"] == {
        "passed": True,
        "saw": "the first 4 texts read back through the policy's own tokenizer, 0.0% lost",
    }
    narrow = _word_tokenizer(["this", "film", "is", "a"])  # no opinion words: the reward model reads [UNK]
    with pytest.warns(
        UserWarning,
        match=r"tokenizer \(its own tokenizer \(6 tokens\)\) loses 53.3% of the first batch's characters: "
        r"'great acting' reads as '\[UNK\] \[UNK\]'",  # 24 of 45 characters, spaces aside
    ):
        check_reward_tokenizer(texts, full, narrow, Health())
    short = _word_tokenizer(["this", "film", "is", "great", "a", "dull", "acting"], max_length=3)
    with pytest.warns(UserWarning, match="1 of 4 texts are longer than the reward model's 3 tokens and are cut"):
        check_reward_tokenizer(texts, full, short, Health())


def test_the_reference_guard_reads_trls_first_measured_log_ratios() -> None:
    """DPO's and GRPO's step-0 check: trl's first per-step values, before any update, are ~0."""
    from fitrl.hf_trainer import reference_guard

    def first_step(values: dict, step: int = 1, health: Health | None = None) -> Health:
        health = health or Health()
        trainer = SimpleNamespace(_metrics={"train": values}, callbacks=[])
        trainer.add_callback = trainer.callbacks.append
        reference_guard(trainer, health, ["rewards/chosen", "rewards/rejected"], 0.1 * 50, "per token")
        trainer.callbacks[0].on_step_end(None, SimpleNamespace(global_step=step), None)
        return health

    same = first_step({"rewards/chosen": [0.0, 0.4], "rewards/rejected": [1e-7]})  # later values: after updates
    assert same.seen["reference"]["passed"]
    with pytest.raises(RunFailed, match=r"guard 'reference' at step 1: rewards/chosen / rewards/rejected is -0.0400"):
        first_step({"rewards/chosen": [0.01], "rewards/rejected": [-0.2]}, health=Health(strict=True))
    assert first_step({"rewards/chosen": [5.0]}, step=7).seen == {}  # a resumed run: updates came before


def test_the_demo_classifier_reads_the_demo_lms_text_and_names_a_script_it_cannot(demo_assets) -> None:
    """The demo's real pair: the reward classifier (its own 353-token WordPiece) reads the review text the
    policy's tokenizer decodes; text in a script it has no tokens for, it reads as [UNK]."""
    from transformers import AutoTokenizer

    from fitrl.guards import check_reward_tokenizer
    from fitrl.outputs import read_jsonl

    policy = AutoTokenizer.from_pretrained(demo_assets / "lm")
    reward = AutoTokenizer.from_pretrained(demo_assets / "classifier")
    reviews = [r["text"][:120] for r in read_jsonl(demo_assets / "reviews" / "test.jsonl")[:32]]
    health = Health()
    check_reward_tokenizer(reviews, policy, reward, health)
    assert health.seen["reward_tokenizer"]["passed"], health.seen
    assert "its own tokenizer (353 tokens)" in health.seen["reward_tokenizer"]["saw"]
    foreign = [f"{r} 東京でとても良い映画でした" for r in reviews]
    with pytest.warns(UserWarning, match=r"guard 'reward_tokenizer' at step 1: the reward model's tokenizer"):
        check_reward_tokenizer(foreign, policy, reward, Health())


def test_a_frozen_adapter_on_the_demo_model_stops_before_the_first_step(demo_assets, tmp_path) -> None:
    """trl#6700: an adapter loaded for inference (peft's default, `is_trainable=False`) handed to the
    trainer trains nothing while its curves (and, with beta != 0, its KL) look normal. The callback trl's
    loop calls at train begin stops the run."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    def base() -> nn.Module:
        return AutoModelForCausalLM.from_pretrained(demo_assets / "reasoner")

    get_peft_model(base(), LoraConfig(r=4, target_modules=["query_key_value"])).save_pretrained(tmp_path / "a")
    frozen = PeftModel.from_pretrained(base(), tmp_path / "a")
    args = SimpleNamespace(deepspeed=None, fsdp=None)
    with pytest.raises(RunFailed, match="nothing to train: the model has 0 trainable parameters"):
        guard_callback(Health()).on_train_begin(args, SimpleNamespace(global_step=0), None, model=frozen)


def test_the_stages_own_monitors_fire_on_collapsing_looping_or_mismatched_runs() -> None:
    """GRPO's and PPO's limits as their configs set them (defaults), fed the rows such runs log."""
    from fitrl.guards import Monitors
    from fitrl.stages import grpo, ppo

    health = Health()
    watch = Monitors(health, grpo.monitors(grpo.GRPOArguments()))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, length in enumerate([20.0, 12.0, 3.0, 3.0, 3.0, 3.0, 3.0], 1):  # learns to stop at once
            watch({"completions/mean_length": length, "completions/clipped_ratio": 0.0}, step)
    assert [str(w.message) for w in caught] == [
        "guard 'length' at step 7: completions/mean_length 3 is below 4 (0.2 x its first 20) for 5 logged "
        "steps: completions collapse toward nothing: a reward that pays for ending early?"
    ]
    loops = Health()
    watch = Monitors(loops, ppo.monitors(ppo.PPOArguments()))
    with pytest.warns(UserWarning, match=r"guard 'repetition' at step 5: env/repetition 0.45 is above 0.3 for 5"):
        for step in range(1, 6):
            watch({"env/repetition": 0.45, "objective/kl": 2.0}, step)
    with pytest.warns(UserWarning, match=r"guard 'kl' at step 6: objective/kl -3 is below -1: the sampling"):
        watch({"objective/kl": -3.0}, 6)
