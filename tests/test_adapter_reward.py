"""PPO against a trained reward model on its own backbone: the rm stage's adapter and score head loaded
beside the policy's adapter score exactly as the reward model does alone, leave the policy bit for bit
as it was, and run in PPO and its evaluation; a reward model of another base is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fitrl.adapter_reward import AdapterReward
from fitrl.config import load_run_info
from fitrl.modeling import LoraArguments, ModelArguments, add_lora, load_causal_lm, load_tokenizer

from conftest import CONFIGS, run_main, run_script

TEXTS = [
    "The Silent Harbor is a drama. The acting was wonderful.",
    "It runs about 95 minutes. The plot was dull. Skip this one.",
    "I saw The Quiet River on a Sunday.",
]


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory: pytest.TempPathFactory, demo_cache: Path) -> Path:
    """A reward model trained for two steps on the demo LM, PPO's test base."""
    out = tmp_path_factory.mktemp("rm") / "rm"
    result = run_script(
        "train_reward.py",
        *("--config", CONFIGS / "demo" / "rm.yaml", "--demo_cache_dir", demo_cache, "--output_dir", out),
        *("--model_name_or_path", "demo://lm", "--max_steps", "2", "--max_eval_samples", "8"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def _policy(demo_root: Path) -> tuple:
    args = ModelArguments(str(demo_root / "lm"), quantization="8bit", dtype="float32")
    tokenizer = load_tokenizer(args.model_name_or_path)
    model = load_causal_lm(args, path=args.model_name_or_path, pad_token_id=tokenizer.pad_token_id)
    policy = add_lora(model, LoraArguments(lora_r=8, lora_dropout=0.0, lora_target_modules=["all-linear"]))
    torch.manual_seed(0)
    with torch.no_grad():  # a policy that differs from its base, as one does after some PPO steps
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.02)
    return policy, tokenizer


@pytest.mark.slow
def test_scoring_on_the_shared_backbone_equals_the_reward_model_and_leaves_the_policy_bit_for_bit(
    reward_model: Path, demo_root: Path
) -> None:
    from peft import PeftModel

    policy, tokenizer = _policy(demo_root)
    enc = tokenizer(TEXTS, padding=True, return_tensors="pt")
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    with torch.no_grad():
        before = policy(**enc).logits.log_softmax(-1)
    reward = AdapterReward(policy, reward_model, tokenizer, batch_size=2)
    shared, positive = reward.classify(TEXTS)
    with torch.no_grad():
        after = policy(**enc).logits.log_softmax(-1)
    assert torch.equal(before, after)  # the policy's log-probs, bit for bit, after adding and scoring
    assert {n for n, p in policy.named_parameters() if p.requires_grad} == trainable  # the reward stays frozen
    assert torch.equal(positive, shared > 0)

    # The same texts through the reward model alone: its 8-bit base with a score head, and its adapter.
    args = ModelArguments(str(demo_root / "lm"), quantization="8bit", dtype="float32")
    alone = load_causal_lm(args, path=args.model_name_or_path, pad_token_id=tokenizer.pad_token_id, score_head=True)
    alone = PeftModel.from_pretrained(alone, reward_model).eval()
    batch = tokenizer([t + tokenizer.eos_token for t in TEXTS], padding=True, return_tensors="pt")
    with torch.no_grad():
        expected = alone(**batch).logits[:, 0]
    assert torch.allclose(shared, expected, atol=1e-4), (shared, expected)
    assert shared.std() > 0  # the texts differ, so do their rewards


@pytest.mark.slow
def test_ppo_and_its_evaluation_score_with_the_reward_adapter(
    reward_model: Path, tmp_path: Path, demo_cache: Path
) -> None:
    out = tmp_path / "ppo"
    common = ["--demo_cache_dir", demo_cache, "--reward_adapter", reward_model]
    result = run_script(
        "ppo_sentiment.py",
        *("--config", CONFIGS / "demo" / "ppo.yaml", "--model_name_or_path", "demo://lm", "--output_dir", out),
        *("--steps", "2", "--batch_size", "16", "--forward_batch_size", "16", "--mini_batch_size", "8", *common),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    info = load_run_info(out)
    assert info["frozen_base_verified"]  # the base and the reward adapter, hashed before and after
    assert not (out / "reward").exists()  # only the policy's adapter is written
    evaluation = run_script(
        "evaluate_sentiment.py",
        *("--config", CONFIGS / "demo" / "eval.yaml", "--adapter_dir", out, "--output_dir", tmp_path / "eval"),
        *("--n_prompts", "8", "--demo_cache_dir", demo_cache),
    )
    assert evaluation.returncode == 0, evaluation.stderr[-3000:]
    report = json.loads((tmp_path / "eval" / "eval.json").read_text())
    # the evaluation took the reward adapter from the PPO run, and scored with it
    rewards = [s["policy_reward"] for s in report["samples"]]
    assert len(set(rewards)) > 1 and report["n_prompts"] == 8


@pytest.mark.slow
def test_a_reward_model_of_another_base_is_refused_in_one_line(
    reward_model: Path, tmp_path: Path, demo_cache: Path, capsys: pytest.CaptureFixture
) -> None:
    code = run_main(
        "ppo_sentiment.py",
        *("--config", CONFIGS / "demo" / "ppo.yaml", "--model_name_or_path", "demo://reasoner"),
        *("--output_dir", tmp_path / "out", "--demo_cache_dir", demo_cache, "--reward_adapter", reward_model),
    )
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1, errors
    assert "reward_adapter:" in errors[0] and "train the reward model on demo://reasoner" in errors[0]
    assert not (tmp_path / "out").exists()
