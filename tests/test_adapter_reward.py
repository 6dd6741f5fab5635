"""PPO against a trained reward model on its own backbone: the rm stage's adapter and score head loaded
beside the policy's adapter score exactly as the reward model does alone, leave the policy bit for bit
as it was, and run in PPO and its evaluation; a reward model of another base is loaded on its own copy
of that base and scores the same."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fitrl.modeling import LoraArguments, ModelArguments, add_lora, load_causal_lm, load_tokenizer
from fitrl.outputs import read_jsonl
from fitrl.reward.adapter import AdapterReward, SeparateAdapterReward
from fitrl.reward.settings import RewardArguments

from conftest import CONFIGS, load_run_info, run_main, run_script

TEXTS = [
    "The Silent Harbor is a drama. The acting was wonderful.",
    "It runs about 95 minutes. The plot was dull. Skip this one.",
    "I saw The Quiet River on a Sunday.",
]


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory: pytest.TempPathFactory, demo_assets: Path) -> Path:
    """A reward model trained for two steps on the demo LM, PPO's test base."""
    out = tmp_path_factory.mktemp("rm") / "rm"
    result = run_script(
        "rm.py",
        *("--config", CONFIGS / "demo" / "rm.yaml", "--demo_assets", demo_assets, "--output_dir", out),
        *("--model_name_or_path", "demo://lm", "--max_steps", "2", "--max_eval_samples", "8"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def _policy(demo_assets: Path) -> tuple:
    args = ModelArguments(str(demo_assets / "lm"), quantization="8bit", dtype="float32")
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
    reward_model: Path, demo_assets: Path
) -> None:
    from peft import PeftModel

    policy, tokenizer = _policy(demo_assets)
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
    args = ModelArguments(str(demo_assets / "lm"), quantization="8bit", dtype="float32")
    alone = load_causal_lm(args, path=args.model_name_or_path, pad_token_id=tokenizer.pad_token_id, score_head=True)
    alone = PeftModel.from_pretrained(alone, reward_model).eval()
    batch = tokenizer([t + tokenizer.eos_token for t in TEXTS], padding=True, return_tensors="pt")
    with torch.no_grad():
        expected = alone(**batch).logits[:, 0]
    assert torch.allclose(shared, expected, atol=1e-4), (shared, expected)
    assert shared.std() > 0  # the texts differ, so do their rewards
    # loaded on its own copy of its base, as a reward model of another base than the policy's is
    rm = RewardArguments(reward_adapter=str(reward_model), reward_quantization="8bit", reward_batch_size=2)
    separate, _ = SeparateAdapterReward(str(demo_assets / "lm"), rm, torch.device("cpu")).classify(TEXTS)
    assert torch.allclose(separate, expected, atol=1e-4), (separate, expected)


@pytest.mark.slow
def test_the_reward_models_card_loads_from_anywhere_and_scores_as_fitrl_does(
    reward_model: Path, demo_assets: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The card's snippet, run as written from another directory, gives fitrl's scores: the base is
    recorded as it resolved (an absolute path), batches need the tokenizer's pad token, and fitrl
    appends EOS before scoring (without it the scores differ)."""
    base = str((demo_assets / "lm").resolve())
    card = (reward_model / "README.md").read_text()
    assert card.startswith(f"---\nbase_model: {base}\n"), card[:200]
    assert json.loads((reward_model / "adapter_config.json").read_text())["base_model_name_or_path"] == base
    assert load_run_info(reward_model)["reload_check"]["max_reward_diff"] <= 1e-4  # reloaded, it scores as trained
    # its own pre-flight: degenerate continuations, a negated copy among them, beside the chosen texts
    assert {"empty", "repeat", "negated"} <= set(load_run_info(reward_model)["reward_probes"]["kinds"])
    code = card.split("```python\n", 1)[1].split("```", 1)[0]
    code = code.replace("<this folder or its hub id>", str(reward_model))
    code = code.replace('texts = ["The acting was superb.", "The plot was dull."]', f"texts = {TEXTS!r}")
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(code, scope)
    rm = RewardArguments(reward_adapter=str(reward_model), reward_batch_size=2)
    fitrl_scores, _ = SeparateAdapterReward(base, rm, torch.device("cpu")).classify(TEXTS)
    assert torch.allclose(scope["rewards"].float(), fitrl_scores, atol=1e-4), (scope["rewards"], fitrl_scores)


@pytest.mark.slow
def test_ppo_and_its_evaluation_score_with_the_reward_adapter(
    reward_model: Path, tmp_path: Path, demo_assets: Path
) -> None:
    out = tmp_path / "ppo"
    common = ["--demo_assets", demo_assets, "--reward_adapter", reward_model]
    result = run_script(
        "ppo.py",
        *("--config", CONFIGS / "demo" / "ppo.yaml", "--model_name_or_path", "demo://lm", "--output_dir", out),
        *("--steps", "2", "--batch_size", "16", "--forward_batch_size", "16", "--mini_batch_size", "8", *common),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    info = load_run_info(out)
    assert info["frozen_base_verified"]  # the base and the reward adapter, hashed before and after
    assert not (out / "reward").exists()  # only the policy's adapter is written
    evaluation = run_script(
        "eval.py",
        *("--config", CONFIGS / "demo" / "eval.yaml", "--adapter_dir", out, "--output_dir", tmp_path / "eval"),
        *("--n_prompts", "8", "--demo_assets", demo_assets),
    )
    assert evaluation.returncode == 0, evaluation.stderr[-3000:]
    report = json.loads((tmp_path / "eval" / "eval.json").read_text())
    # the evaluation took the reward adapter from the PPO run, and scored with it
    rewards = [s["policy_reward"] for s in report["samples"]]
    assert len(set(rewards)) > 1 and report["n_prompts"] == 8


@pytest.mark.slow
def test_a_reward_model_of_another_base_is_loaded_beside_the_policy_and_planned(
    reward_model: Path, tmp_path: Path, demo_assets: Path
) -> None:
    """The rm adapter was trained on the demo LM; PPO's policy here is the demo reasoner."""
    out = tmp_path / "ppo"
    result = run_script(
        "ppo.py",
        *("--config", CONFIGS / "demo" / "ppo.yaml", "--model_name_or_path", "demo://reasoner"),
        *("--output_dir", out, "--demo_assets", demo_assets, "--reward_adapter", reward_model),
        *("--steps", "2", "--batch_size", "16", "--forward_batch_size", "16", "--mini_batch_size", "8"),
        *("--guard_judge_model", ""),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"PPO: reward adapter {reward_model} loaded on its own copy of " in result.stdout
    info = load_run_info(out)
    # the plan counts that copy, and the measured step holds it: within the planner's 10%
    memory = info["memory"]
    assert abs(memory["measured_peak_mb"] - memory["planned_peak_mb"]) <= 0.1 * memory["planned_peak_mb"], memory
    rows = read_jsonl(out / "metrics.jsonl")
    assert rows[0]["env/reward_std"] > 0


@pytest.mark.slow
def test_the_planner_counts_a_reward_adapter_only_when_it_has_a_base_of_its_own(
    reward_model: Path, demo_assets: Path
) -> None:
    from fitrl import planner
    from fitrl.stages import get
    from fitrl.stages.ppo import reward_model as reward_spec

    def spec(model: str, *extra: str):
        return reward_spec(get("ppo").parse(["--config", str(CONFIGS / "demo" / "ppo.yaml"), "--model_name_or_path",
                                             model, "--reward_adapter", str(reward_model),
                                             "--demo_assets", str(demo_assets), *extra]))  # fmt: skip

    assert spec("demo://lm") is None  # its LoRA rides on the policy's backbone: nothing more to plan
    separate = spec("demo://reasoner")
    assert separate is not None and Path(separate.name).name == "lm"
    assert planner.reward_model_bytes(separate) > 0
    assert spec("demo://lm", "--reward_adapter_shared", "false") == separate


@pytest.mark.slow
def test_a_reward_adapter_of_another_stage_is_refused_without_offering_a_force_that_ppo_lacks(
    reward_model: Path, demo_assets: Path, tmp_path: Path
) -> None:
    """PPO and its evaluation have no `--force`: refusing an adapter that no rm run made names the fix."""
    import dataclasses
    import shutil

    from fitrl.artifacts import RunInfo
    from fitrl.config import UsageError
    from fitrl.reward.adapter import separate_base

    made_by_dpo = tmp_path / "dpo"
    shutil.copytree(reward_model, made_by_dpo)
    dataclasses.replace(RunInfo.read(made_by_dpo), stage="dpo").write(made_by_dpo)
    lm = str(demo_assets / "lm")
    with pytest.raises(UsageError) as refused:
        separate_base(made_by_dpo, "demo://lm", lm, str(demo_assets), True, "ppo", "rm")
    assert str(refused.value) == f"{made_by_dpo} is the output of the dpo stage; ppo takes the rm stage's"


@pytest.mark.slow
def test_a_reward_model_that_does_not_reload_as_trained_is_not_written(
    tmp_path: Path, demo_assets: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """The rm stage loads its saved adapter and head back and scores the held-out pairs again: a head that
    did not save (here: replaced by a random one) fails the run, with nothing written."""
    from safetensors.torch import load_file, save_file

    import fitrl.scripts.rm as rm

    saved = rm.save_reward_model

    def random_head(trainer, out: Path) -> None:
        saved(trainer, out)
        weights = load_file(out / "adapter_model.safetensors")
        head = "base_model.model.score.weight"
        weights[head] = torch.randn(weights[head].shape, generator=torch.Generator().manual_seed(0))
        save_file(weights, out / "adapter_model.safetensors")

    monkeypatch.setattr(rm, "save_reward_model", random_head)
    out = tmp_path / "rm"
    code = run_main(
        "rm.py",
        *("--config", CONFIGS / "demo" / "rm.yaml", "--demo_assets", demo_assets, "--output_dir", out),
        *("--model_name_or_path", "demo://lm", "--max_steps", "2", "--max_eval_samples", "8"),
    )
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert code == 1 and len(errors) == 1, (code, errors)
    assert (
        "the saved reward model does not score as the trained one" in errors[0] and "nothing was written" in errors[0]
    )
    assert not out.exists()
