"""Stage 3 as a user runs it: PPO raises the demo reward, resumes exactly, runs under DDP, fails cleanly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fitrl.distributed import tensor_digest
from fitrl.outputs import read_jsonl

from conftest import CONFIGS, Payload, accelerate_launch, error_line, load_run_info, run_script, sigterm_when

PPO_YAML = CONFIGS / "demo" / "ppo.yaml"
# The demo base stands in for the merged model and the demo classifier scores, so these tests do not
# depend on the stages before PPO (tests/test_adapter_reward.py scores with an rm stage's adapter).
CLASSIFIER = ["--reward_adapter", ""]
SMALL = ["--batch_size", "16", "--forward_batch_size", "16", "--mini_batch_size", "8"]


def _ppo(out: Path, demo_assets: Path, *extra: str, launcher: list[str] | None = None):
    return run_script(
        "ppo.py",
        "--config",
        PPO_YAML,
        "--model_name_or_path",
        "demo://lm",
        "--demo_assets",
        demo_assets,
        "--output_dir",
        out,
        *CLASSIFIER,
        *extra,
        launcher=launcher,
    )


@pytest.mark.slow
def test_two_steps_plus_resume_equals_four_straight(tmp_path: Path, demo_assets: Path) -> None:
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert _ppo(straight, demo_assets, *SMALL, "--steps", "4").returncode == 0
    first = _ppo(split, demo_assets, *SMALL, "--steps", "2", "--save_steps", "2")
    assert first.returncode == 0, first.stderr[-2000:]
    assert (tmp_path / "split.checkpoints" / "step-2" / "trainer_state.json").is_file()
    resumed = _ppo(
        split,
        demo_assets,
        *SMALL,
        "--steps",
        "4",
        "--resume_from_checkpoint",
        "latest",
        "--overwrite_output_dir",
        "true",
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    a, b = read_jsonl(straight / "metrics.jsonl"), read_jsonl(split / "metrics.jsonl")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b):
        assert set(ra) == set(rb), ra["step"]  # the judge reads at the same steps: not again at the resume
        for key, value in ra.items():
            if isinstance(value, float) and not key.startswith(("time/", "tokens_per", "memory/")):
                assert rb[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (ra["step"], key)
    assert tensor_digest(load_file(straight / "adapter_model.safetensors")) == tensor_digest(
        load_file(split / "adapter_model.safetensors")
    )
    # A run started afresh beside an earlier run's checkpoints says so, and how to continue that one.
    again = _ppo(split, demo_assets, *SMALL, "--steps", "1", "--overwrite_output_dir", "true")
    assert again.returncode == 0, again.stderr[-2000:]
    step2 = tmp_path / "split.checkpoints" / "step-2"
    assert f"note: {step2} is an earlier run's checkpoint; this run starts at step 0" in again.stdout


@pytest.mark.slow
def test_speed_options_leave_the_experience_unchanged(tmp_path: Path, demo_assets: Path) -> None:
    """Old log-probs and values read off the sampling pass, and a no-grad batch smaller than the
    generation batch, give the experience that recomputing them in one forward of the whole batch
    gives: the same samples (same seed and generation batch), and the first step's reward, KL,
    entropy and value fit within float rounding.

    Only the first step: the PPO update turns last-bit differences of the old log-probs into visibly
    different weights (a 3e-6 perturbation moves the first step's mean ratio by 0.3%, whichever
    way the old log-probs were computed), so later steps sample other tokens. What the policy learns
    with the fast path on is checked in test_demo_learns. On an fp32 base: bitsandbytes' 8-bit matmul
    picks its outlier columns over the whole input, so 8-bit forwards of 8 and 16 rows differ by more."""
    base, fast = tmp_path / "recomputed", tmp_path / "fast"
    common = [*("--quantization", "none", "--batch_size", "16", "--mini_batch_size", "8", "--steps", "1")]
    common += ["--generation_batch_size", "16"]
    slow_run = _ppo(base, demo_assets, *common, "--forward_batch_size", "16", "--policy_from_generation", "false")
    assert slow_run.returncode == 0, slow_run.stderr[-2000:]
    fast_run = _ppo(fast, demo_assets, *common, "--forward_batch_size", "8", "--policy_from_generation", "true")
    assert fast_run.returncode == 0, fast_run.stderr[-2000:]
    (a,), (b,) = read_jsonl(base / "metrics.jsonl"), read_jsonl(fast / "metrics.jsonl")
    for key in ["env/reward_mean", "env/reward_std", "env/response_length"]:
        assert b[key] == a[key], key  # the very same samples
    assert a["objective/kl"] == 0.0  # a fresh adapter (B = 0): the policy is the reference, bit for bit
    assert abs(b["objective/kl"]) < 1e-3  # nats per response, summed over its tokens
    for key in ["objective/entropy", "objective/non_score_reward", "ppo/explained_variance"]:
        assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-4), key


@pytest.mark.slow
def test_two_process_ddp_stays_in_sync_on_different_prompts(tmp_path: Path, demo_assets: Path) -> None:
    out = tmp_path / "ddp"
    result = _ppo(out, demo_assets, *SMALL, "--steps", "2", launcher=accelerate_launch(2))
    assert result.returncode == 0, result.stderr[-3000:]
    info = load_run_info(out)
    assert info["world_size"] == 2
    assert len(info["rank_weight_digests"]) == 2 and len(set(info["rank_weight_digests"])) == 1
    rank0, rank1 = info["rank_first_prompts"]
    assert not set(rank0) & set(rank1), "both ranks generated from the same prompts"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--batch_size", "30", "--mini_batch_size", "8"], "invalid value for 'batch_size': must be a multiple of"),
        (["--positive_label", "LABEL_7"], "reward model has no label 'LABEL_7'"),
        (["--resume_from_checkpoint", "latest"], "no complete checkpoint to resume"),
        (["--kl_estimator", "huge"], "invalid choice"),
        # a causal LM has the label LABEL_0 too, but its classification head would be random
        (["--reward_model", "demo://lm", "--positive_label", "LABEL_0"], "not a trained sequence classifier"),
        (["--guard_judge_model", "demo://classifier", "--guard_judge_positive_label", "GOOD"], "has no label 'GOOD'"),
        (["--reward_function", "nowhere.py:f"], "reward_function: file nowhere.py does not exist"),
    ],
)
def test_bad_config_exits_2(tmp_path: Path, demo_assets: Path, extra: list[str], message: str) -> None:
    out = tmp_path / "out"
    result = _ppo(out, demo_assets, *extra)
    assert result.returncode == 2, result.stderr[-2000:]
    assert message in error_line(result)
    assert not out.exists()


@pytest.mark.slow
def test_non_finite_loss_stops_and_keeps_the_last_checkpoint(tmp_path: Path, demo_assets: Path) -> None:
    out = tmp_path / "run"
    assert _ppo(out, demo_assets, *SMALL, "--steps", "1", "--save_steps", "1").returncode == 0
    checkpoint = tmp_path / "run.checkpoints" / "step-1"
    # A learning rate of 1e6 blows the first update up to inf/NaN.
    result = _ppo(out, demo_assets, *SMALL, "--steps", "3", "--learning_rate", "1e6", "--overwrite_output_dir", "true")
    assert result.returncode == 1
    line = error_line(result)
    assert "non-finite" in line and str(checkpoint) in line
    assert (checkpoint / "adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_exits_143(tmp_path: Path, demo_assets: Path) -> None:
    out = tmp_path / "run"
    args = ["--config", PPO_YAML, "--model_name_or_path", "demo://lm", "--demo_assets", demo_assets, *CLASSIFIER]
    args += ["--output_dir", out, *SMALL, "--steps", "500", "--save_steps", "0"]
    code, line = sigterm_when("ppo.py", *args, watch=tmp_path / ".run.partial" / "metrics.jsonl", rows=1)
    assert code == 143 and "stopped by SIGTERM after step" in line, line
    step = int(line.split("after step ")[1].split(";")[0])
    checkpoint = tmp_path / "run.checkpoints" / f"step-{step}"
    assert f"saved {checkpoint}" in line and (checkpoint / "run_config.yaml").is_file()
    assert not out.exists() and not (tmp_path / ".run.partial").exists()


@pytest.mark.slow
def test_a_reward_classifier_without_its_head_weights_is_refused(tmp_path: Path, demo_assets: Path) -> None:
    """Saved without its head (its config still says ...ForSequenceClassification), a classifier would
    load with a random head and PPO would train against noise."""
    import shutil

    headless = tmp_path / "headless"
    shutil.copytree(demo_assets / "classifier", headless)
    weights = load_file(headless / "model.safetensors")
    save_file({k: v for k, v in weights.items() if "classifier" not in k}, headless / "model.safetensors")
    out = tmp_path / "never"
    result = _ppo(out, demo_assets, *SMALL, "--steps", "1", "--reward_model", headless)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "has no saved weights for" in error_line(result) and "head would be random" in error_line(result)
    assert not out.exists()


def test_a_constant_reward_is_named_by_its_guard_and_strict_guards_stop_the_run(
    tmp_path: Path, demo_assets: Path
) -> None:
    """A reward model whose score head reads nothing gives every text the same reward: PPO gets no
    signal. The guard says so once, at step 1, and the run's health records it beside the guards that
    passed; with `--strict_guards true` the run stops there and writes nothing."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    constant = tmp_path / "constant-rm"
    model = AutoModelForSequenceClassification.from_pretrained(demo_assets / "lm", num_labels=1)
    torch.nn.init.zeros_(model.score.weight)
    model.save_pretrained(constant)
    AutoTokenizer.from_pretrained(demo_assets / "lm").save_pretrained(constant)
    out = tmp_path / "run"
    result = _ppo(out, demo_assets, *SMALL, "--steps", "2", "--reward_model", constant)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count("guard 'reward_signal' at step 1: the reward is constant on the first batch") == 1
    health = load_run_info(out)["health"]
    assert {k: v["passed"] for k, v in health.items()} == {
        "reward_hacking": True,  # one reading of the judge (at step 0): nothing to compare yet
        "trainable": True,
        "reward_tokenizer": True,
        "reference": True,  # the policy is its reference before any update: KL ~0
        "reward_signal": False,
        "gradients": True,
        "kl": True,  # the in-run monitors, with the extreme each saw
        "entropy": True,
        "clipping": True,
        "repetition": True,
        "prompt_length": True,  # the demo's prefix shaping: no prompt over the limit
        "reward_probes": True,  # a constant reward pays no probe more than the references
    }, health
    stopped = _ppo(tmp_path / "strict", demo_assets, *SMALL, "--steps", "2", "--reward_model", constant,
                   "--strict_guards", "true")  # fmt: skip
    assert stopped.returncode == 1
    assert "guard 'reward_signal' at step 1" in error_line(stopped) and "strict_guards stopped the run" in error_line(
        stopped
    )
    assert not (tmp_path / "strict").exists()


@pytest.mark.slow
def test_a_reward_at_odds_with_the_judge_trips_the_reward_hacking_guard(tmp_path: Path, demo_assets: Path) -> None:
    """The reward is the classifier's NEGATIVE logit while the guard's judge (the same classifier, read for
    POSITIVE) wants the opposite: the training reward rises while the judge's mean verdict on held-out
    prompts falls, and the guard names it (the run goes on: strict_guards is off).

    Measured here (16 prompts a step, lr 2e-3, KL coefficient 0.05, judged at steps 0/10/20), seeds
    0 / 1 / 2: the verdict fell 0.44 / 0.94 / 0.75 by step 20, against the test's 0.1 (default 0.2)."""
    out = tmp_path / "run"
    result = _ppo(
        out,
        demo_assets,
        *SMALL,
        *["--steps", "20", "--learning_rate", "2e-3", "--init_kl_coef", "0.05", "--positive_label", "NEGATIVE"],
        *["--guard_judge_model", "demo://classifier", "--guard_judge_every", "10", "--guard_judge_drop", "0.1"],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    health = load_run_info(out)["health"]
    assert not health["reward_hacking"]["passed"], health["reward_hacking"]
    assert "the judge's mean verdict fell " in health["reward_hacking"]["saw"]
    assert health["reward_tokenizer"]["passed"] and health["repetition"]["passed"]
    readings = [r["heldout/judge_mean"] for r in read_jsonl(out / "metrics.jsonl") if "heldout/judge_mean" in r]
    assert len(readings) == 3 and min(readings[1:]) <= readings[0] - 0.1


# A reward that pays for repeating a word: the pre-flight's `repeat` probe wins it every time.
PAYS_REPEATS = """
def pays_repeats(completions, **kwargs):
    return [len(t.split()) - len(set(t.split())) for t in completions]
"""


def test_a_reward_function_paying_for_a_repeated_word_is_flagged_before_training(
    tmp_path: Path, demo_assets: Path
) -> None:
    """The reward pre-flight (`fitrl.reward.probes`) scores degenerate completions beside the reference's
    own before the first update: the repeated word outscores the median reference completion on every
    prompt, so the guard fires at step 0; with `--strict_guards true` nothing trains or is written."""
    (tmp_path / "mine.py").write_text(PAYS_REPEATS)
    function = f"{tmp_path / 'mine.py'}:pays_repeats"
    out = tmp_path / "run"
    result = _ppo(out, demo_assets, *SMALL, "--steps", "1", "--reward_function", function, "--guard_judge_model", "")
    assert result.returncode == 0, result.stderr[-3000:]
    info = load_run_info(out)
    assert info["health"]["reward_probes"]["passed"] is False
    assert "repeat 100%" in info["health"]["reward_probes"]["saw"]
    kinds = info["reward_probes"]["kinds"]
    assert kinds["repeat"]["share_above_median"] == 1.0 and kinds["empty"]["share_above_median"] == 0.0
    stopped = _ppo(tmp_path / "strict", demo_assets, *SMALL, "--steps", "1", "--reward_function", function,
                   "--guard_judge_model", "", "--strict_guards", "true")  # fmt: skip
    assert stopped.returncode == 1 and "guard 'reward_probes' at step 0: degenerate completions" in error_line(stopped)
    assert not (tmp_path / "strict").exists()


# A reward a user writes in a file of their own, in trl's convention: one number per completion.
SAYS_GREAT = """
def says_great(completions, **kwargs):
    return [t.lower().split().count("great") - 0.5 for t in completions]
"""


@pytest.mark.slow
def test_a_reward_function_in_a_file_of_its_own_scores_ppo_and_its_evaluation(
    tmp_path: Path, demo_assets: Path
) -> None:
    (tmp_path / "my_reward.py").write_text(SAYS_GREAT)
    function = f"{tmp_path / 'my_reward.py'}:says_great"
    out = tmp_path / "run"
    result = _ppo(out, demo_assets, *SMALL, "--steps", "2", "--reward_function", function)
    assert result.returncode == 0, result.stderr[-3000:]
    info = load_run_info(out)
    assert info["health"]["reward_tokenizer"]["saw"] == "a reward function reads the text itself"
    samples = (out / "samples.md").read_text()
    assert "first step" in samples
    config = (out / "run_config.yaml").read_text()
    assert f"reward_function: {function}" in config
    evaluated = run_script(
        "eval.py",
        *["--config", CONFIGS / "demo" / "eval.yaml", "--model_name_or_path", "demo://lm"],
        *["--demo_assets", demo_assets, "--adapter_dir", out, "--output_dir", tmp_path / "eval"],
        *["--reward_function", function, "--n_prompts", "8", "--batch_size", "8"],
    )
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    report = json.loads((tmp_path / "eval" / "eval.json").read_text())
    for row in report["samples"]:  # each score is the function's, of the response it read (trl's completion)
        for who in ("policy", "reference"):
            text = row[f"{who}_response"]
            assert row[f"{who}_reward"] == text.lower().split().count("great") - 0.5


@pytest.mark.slow
def test_tensorboard_logging_starts_and_its_logs_land_in_the_output(tmp_path: Path, demo_assets: Path) -> None:
    """`report_to: tensorboard`, PPO's default and the 20B profile's setting, died at start-up for want of
    a logging directory. Its logs go into the staged output, so they end up in `<output_dir>/runs`."""
    out = tmp_path / "run"
    result = _ppo(out, demo_assets, *SMALL, "--steps", "2", "--report_to", "tensorboard")
    assert result.returncode == 0, result.stderr[-3000:]
    events = list((out / "runs").rglob("events.out.tfevents.*"))
    assert events and all(e.stat().st_size > 0 for e in events)
    assert not list(tmp_path.glob(".*.partial"))


# --- what a resume refuses ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ppo_checkpoints(tmp_path_factory: pytest.TempPathFactory, demo_assets: Path) -> Path:
    """A 2-step run that kept both checkpoints; tests copy them before changing anything."""
    out = tmp_path_factory.mktemp("ppo-ckpt") / "run"
    result = _ppo(out, demo_assets, *SMALL, "--steps", "2", "--save_steps", "1")
    assert result.returncode == 0, result.stderr[-3000:]
    return out.with_name("run.checkpoints")


def _copy(checkpoints: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(checkpoints, tmp_path / "run.checkpoints"))


@pytest.mark.slow
def test_a_crafted_checkpoint_file_is_refused_without_running(
    ppo_checkpoints: Path, demo_assets: Path, tmp_path: Path
) -> None:
    """The optimizer state is the one pickle a PPO checkpoint holds (the adapter and value head are
    safetensors): a payload in it never runs."""
    name = "optimizer.pt"
    root = _copy(ppo_checkpoints, tmp_path)
    ran = tmp_path / "payload-ran"
    torch.save({"state": Payload(ran)}, root / "step-2" / name)
    result = _ppo(tmp_path / "run", demo_assets, *SMALL, "--steps", "3", "--resume_from_checkpoint", "latest")
    assert result.returncode == 2, result.stderr[-3000:]
    assert name in error_line(result) and "refused" in error_line(result)
    assert not ran.exists(), "the checkpoint's payload ran"


@pytest.mark.slow
def test_a_truncated_adapter_names_the_file_and_the_previous_checkpoint(
    ppo_checkpoints: Path, demo_assets: Path, tmp_path: Path
) -> None:
    root = _copy(ppo_checkpoints, tmp_path)
    adapter = root / "step-2" / "adapter" / "adapter_model.safetensors"
    adapter.write_bytes(adapter.read_bytes()[:100])
    result = _ppo(tmp_path / "run", demo_assets, *SMALL, "--steps", "3", "--resume_from_checkpoint", "latest")
    assert result.returncode == 2, result.stderr[-3000:]
    line = error_line(result)
    assert str(adapter) in line and f"resume from {root / 'step-1'}" in line


@pytest.mark.slow
@pytest.mark.parametrize(
    ("change", "allowed"),
    [(["--lora_r", "8"], False), (["--batch_size", "8"], False), (["--log_samples", "2"], True)],
)
def test_resume_refuses_settings_that_change_the_model_or_data(
    ppo_checkpoints: Path, demo_assets: Path, tmp_path: Path, change: list[str], allowed: bool
) -> None:
    root = _copy(ppo_checkpoints, tmp_path)
    result = _ppo(
        tmp_path / "run", demo_assets, *SMALL, "--steps", "3", "--resume_from_checkpoint", str(root / "step-2"), *change
    )
    if allowed:
        assert result.returncode == 0, result.stderr[-3000:]
        assert f"changed setting: {change[0].removeprefix('--')}" in result.stdout
    else:
        assert result.returncode == 2, result.stderr[-3000:]
        assert f"was made with {change[0].removeprefix('--')}=" in error_line(result)


def _adapter_from(tmp_path: Path, stage: str, model: str | None) -> Path:
    """An adapter directory as a stage writes it: peft's config, and the run's config and info."""
    import yaml

    adapter = tmp_path / f"{stage}-adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "base_model_name_or_path": model}))
    save_file({"lora_A": torch.zeros(1)}, adapter / "adapter_model.safetensors")
    (adapter / "run_info.json").write_text(json.dumps({"stage": stage}))
    (adapter / "run_config.yaml").write_text(yaml.safe_dump({"model_name_or_path": model}))
    return adapter


@pytest.mark.parametrize(
    ("stage", "trained_on", "message"),
    [
        ("grpo", "demo://lm", "is the output of the grpo stage; eval takes the ppo stage's"),
        ("sft", "demo://lm", "is the output of the sft stage"),  # already merged into the model
        ("ppo", "demo://reasoner", "was trained on demo://reasoner, not demo://lm"),
    ],
)
def test_evaluation_refuses_an_adapter_of_another_stage_or_model(
    tmp_path: Path, demo_assets: Path, stage: str, trained_on: str, message: str
) -> None:
    result = run_script(
        "eval.py",
        "--config",
        CONFIGS / "demo" / "eval.yaml",
        "--model_name_or_path",
        "demo://lm",
        "--demo_assets",
        demo_assets,
        "--adapter_dir",
        _adapter_from(tmp_path, stage, trained_on),
        "--output_dir",
        tmp_path / "out",
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert message in error_line(result)
    assert not (tmp_path / "out").exists()


def test_the_adapter_check_compares_resolved_paths(tmp_path: Path, demo_assets: Path) -> None:
    from fitrl.checkpoints import check_adapter_base
    from fitrl.config import UsageError

    adapter = _adapter_from(tmp_path, "grpo", "demo://reasoner")
    reasoner = str(demo_assets / "reasoner")
    (adapter / "run_info.json").write_text(json.dumps({"stage": "grpo", "resolved_model_path": reasoner}))
    # the same base named by its path, by a path with a detour, or by its demo:// name: accepted
    for name in [reasoner, str(demo_assets / "lm" / ".." / "reasoner"), "demo://reasoner"]:
        check_adapter_base(adapter, name, reasoner, "eval_gsm8k", force=False, producer="grpo")
    with pytest.raises(UsageError, match="was trained on demo://reasoner"):
        check_adapter_base(adapter, "demo://lm", str(demo_assets / "lm"), "eval_gsm8k", force=False, producer="grpo")
    check_adapter_base(adapter, "demo://lm", str(demo_assets / "lm"), "eval_gsm8k", force=True, producer="grpo")
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "adapter_config.json").write_text("{}")
    with pytest.raises(UsageError, match="records no base model"):
        check_adapter_base(bare, "demo://lm", str(demo_assets / "lm"), "eval_gsm8k", force=False, producer="grpo")


@pytest.mark.slow
def test_ppo_runs_on_the_arithmetic_problems_graded_against_each_problems_own_answer(
    tmp_path: Path, demo_assets: Path
) -> None:
    """The engine is the sentiment stage's and knows no task: the arithmetic config hands it the questions
    as chats and GRPO's accuracy function, which gets each problem's `answer` column beside it. Every
    kept sample's reward is the accuracy of its own answer against its own problem's gold."""
    from fitrl.tasks.grading import ACCURACY_REWARD, extract_gold, is_correct

    out = tmp_path / "ppo"
    result = run_script(
        "ppo.py",
        *["--config", CONFIGS / "demo-arithmetic" / "ppo.yaml", "--demo_assets", demo_assets],
        *["--output_dir", out, "--steps", "2", "--batch_size", "8", "--forward_batch_size", "8"],
        *["--mini_batch_size", "8", "--ppo_epochs", "1", "--log_samples", "8", "--save_steps", "2"],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    gold = {
        row["question"]: extract_gold(row["answer"]) for row in read_jsonl(demo_assets / "arithmetic" / "train.jsonl")
    }
    assert load_run_info(out)["health"]["reward_tokenizer"]["saw"] == "a reward function reads the text itself"
    # The checkpoint keeps the samples as they were scored (samples.md flattens them into table cells).
    state = json.loads((tmp_path / "ppo.checkpoints" / "step-2" / "trainer_state.json").read_text())
    samples = state["samples"]["first"] + state["samples"]["last"]
    assert len(samples) == 16
    for sample in samples:
        question = next(q for q in gold if q in sample["query"])  # the chat holds the question as its user turn
        correct = is_correct(sample["response"], gold[question])
        assert sample["reward"] == (ACCURACY_REWARD if correct else 0.0), sample
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1, 2]
