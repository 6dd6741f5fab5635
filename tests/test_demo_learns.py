"""The demo as a new user first runs it (`bash pipeline.sh`, every stage, the shipped demo profile) learns
what the real recipes learn: an LM that writes the corpus's sentences, a reward model that ranks
held-out preference pairs as well as their label noise allows, PPO against that reward model and DPO
that turn responses positive (which a second judge confirms) without drifting into word salad, and GRPO
that raises accuracy.

One pipeline run serves every test here; the margins are stated where they are asserted.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from fitrl import demo
from fitrl.outputs import read_jsonl
from fitrl.reward.audit import figures as audit_figures

from conftest import CONFIGS, assert_memory_planned_and_measured, bash_pipeline, demo_project, load_run_info, run_script


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory, demo_assets: Path) -> Path:
    project = demo_project(tmp_path_factory.mktemp("project"), demo_assets, "demo")
    result = bash_pipeline(project, "--profile", "demo", timeout=1800)
    assert result.returncode == 0, result.stderr[-4000:]
    return project / "outputs" / "demo"


def test_the_demo_lm_writes_held_out_text_well(demo_assets: Path) -> None:
    # A 2-layer model after 40 pretraining steps (demo v2) had a held-out perplexity of ~107 and wrote
    # word salad; the shipped LM is at 3.45 on the test reviews, which it never saw.
    assert demo.manifest(demo_assets)["lm_test_perplexity"] < 4.0


@pytest.mark.slow
def test_ppo_against_the_trained_reward_model_turns_fluent_reviews_positive_and_the_judge_agrees(
    demo_run: Path,
) -> None:
    report = json.loads((demo_run / "eval" / "eval.json").read_text())
    policy, reference, judge = report["policy"], report["reference"], report["judge"]
    # PPO scored by the rm stage's reward model, an adapter on its own backbone (the run config says so).
    assert yaml.safe_load((demo_run / "ppo" / "run_config.yaml").read_text())["reward_adapter"] == "outputs/demo/rm"
    # On 96 held-out prompts a share's standard error is at most 5 points. What the shipped profile gave
    # (demo v7, seeds 0 / 1 / 2, on an Intel box's own AVX-512 kernels and on ATen's and MKL's AVX2
    # paths): called positive by the reward model 27-39% -> 82-91%, corpus words 98.4-98.5% / 97.1-98.4%,
    # the judge +29 to +50 points (the issue asks +25), KL 4.3-5.7 nats (docs/demo.md). The bars sit two
    # standard errors under the lowest of these; the corpus words at the 95%. Where a policy
    # leans on the reward model's blind spot (negated praise: up to a third of one seed's responses hold
    # a negation), the judge's gain is the lowest.
    assert policy["positive_share"] >= 0.75 > reference["positive_share"], (policy, reference)
    # Both sides write the corpus's sentences: the reference (the SFT model) and the PPO policy (word
    # salad, which the demo's early LM led PPO into, is far below).
    assert reference["corpus_word_share"] >= 0.95, reference
    assert policy["corpus_word_share"] >= 0.95, policy
    # the second judge, which PPO never trained against, sees a gain
    assert judge["model"] == "demo://lexicon"
    assert judge["policy"] >= judge["reference"] + 0.19, judge
    # and the policy stayed near the KL the controller aims at (per response, in nats)
    target = yaml.safe_load((CONFIGS / "demo" / "ppo.yaml").read_text())["target_kl"]
    assert 0 < report["kl_mean"] < 1.5 * target, report["kl_mean"]
    rewards = [r["env/reward_mean"] for r in read_jsonl(demo_run / "ppo" / "metrics.jsonl")]
    # Each step's mean is over 32 responses with std ~1.5: a 5-step mean has a standard error of ~0.12.
    # The shipped profile's rise: 1.5 to 1.9.
    assert sum(rewards[-5:]) / 5 - sum(rewards[:5]) / 5 > 0.6, rewards


@pytest.mark.slow
def test_sft_lowers_the_loss(demo_run: Path) -> None:
    losses = [r["loss"] for r in read_jsonl(demo_run / "sft" / "metrics.jsonl") if "loss" in r]
    assert len(losses) >= 5
    # The shipped profile: 1.074 -> 0.988 / 0.990 over 11 logged steps on two CPU code paths (demo v7;
    # v6: 1.100 -> 0.987 on four).
    first, last = sum(losses[:2]) / 2, sum(losses[-2:]) / 2
    assert last < 0.95 * first, f"loss did not fall clearly: {losses}"


@pytest.mark.slow
def test_the_reward_model_ranks_held_out_pairs_as_well_as_their_noise_allows(demo_run: Path) -> None:
    rm = demo_run / "rm"
    e = json.loads((rm / "eval.json").read_text())
    # Exactly a tenth of the 250 held-out labels are swapped: no model can agree with more than 90%. The
    # issue's bar is 5 points under that ceiling. The shipped profile agrees with 88.8% / 89.2% of the
    # labels on two CPU code paths (demo v7; v6: 89.6%, and 90.0% for seeds 1 and 2). One pair is 0.4
    # points.
    assert e["n_pairs"] == len(e["pairs"]) == 250
    assert e["accuracy"] >= (1 - demo.FLIPPED_SHARE) - 0.05, e["accuracy"]
    assert e["margin_mean"] > 0 and e["reward_chosen_mean"] > e["reward_rejected_mean"]
    assert e["accuracy"] == pytest.approx(sum(p["chosen"] > p["rejected"] for p in e["pairs"]) / 250)
    # the score head was trained and saved beside the adapter, so the adapter alone is the reward model
    weights = load_file(rm / "adapter_model.safetensors")
    assert any(".score." in k for k in weights) and any("lora_B" in k for k in weights)
    assert (rm / "rewards_hist.png").is_file() and (rm / "loss.png").is_file()
    assert_memory_planned_and_measured(load_run_info(rm))


@pytest.mark.slow
def test_dpo_turns_responses_positive_on_ppos_prompts_and_the_report_sets_them_side_by_side(demo_run: Path) -> None:
    dpo, ppo = (json.loads((demo_run / s / "eval.json").read_text()) for s in ("eval_dpo", "eval"))
    assert [s["query"] for s in dpo["samples"]] == [s["query"] for s in ppo["samples"]]  # the same prompts
    # The judge's positive share on the 96 held-out prompts (PPO's responses: 16 tokens, cut after their last
    # sentence), 21-22% for the reference: demo v7, seeds 42 / 1 / 2, +32 / +27 / +32 points on an Intel
    # box's own kernels, +28 for seed 42 on the AVX2 path. The issue asks +20; the bar is two standard
    # errors (10 points) under the lowest. (At 4-16 tokens a response seldom got past the opening
    # sentence to an opinion: +10 to +18.)
    judge = dpo["judge"]
    assert judge["policy"] >= judge["reference"] + 0.17, judge
    assert dpo["policy"]["corpus_word_share"] >= 0.92, dpo["policy"]  # RPO's NLL term keeps it fluent
    # On the held-out pairs, the implicit reward ranks chosen above rejected (0 before training).
    held_out = json.loads((demo_run / "dpo" / "eval.json").read_text())
    assert held_out["margin"] > 0 and held_out["accuracy"] > 0.7, held_out
    assert_memory_planned_and_measured(load_run_info(demo_run / "dpo"))
    report = (demo_run / "report.md").read_text()
    assert "## side by side" in report and "| ppo (eval) |" in report and "| dpo (eval_dpo) |" in report


def test_every_guard_passed_in_the_clean_demo_run_and_the_report_says_so(demo_run: Path) -> None:
    """A clean run shows every guard passed, per training stage, in run_info.json and the report."""
    from fitrl import stages

    every = {"trainable", "gradients"}
    policy = {"reward_signal", "entropy", "repetition", "reward_hacking"}
    expected = {
        "sft": every,
        "rm": every | {"reward_probes"},
        "dpo": every | {"reference"},
        "ppo": every | policy | {"reward_tokenizer", "reference", "kl", "clipping", "prompt_length", "reward_probes"},
        # GRPO's kl and reference need beta > 0: the demo's is 0
        "grpo": every
        | policy
        | {"format_only", "template", "prompt_length", "stop_token", "length", "learning_signal", "reward_probes"},
    }
    report = (demo_run / "report.md").read_text()
    for name, guards in expected.items():
        info = load_run_info(demo_run / stages.get(name).output_dir)
        health = info["health"]
        assert set(health) == guards and all(v["passed"] for v in health.values()), (name, health)
        assert f"guards passed: {', '.join(health)}" in report
        assert 0 < info["guard_seconds"]
    assert "fired at step" not in report
    # the reward-hacking guard read its held-out score through the run: at the start and every N steps
    assert load_run_info(demo_run / "ppo")["health"]["reward_hacking"]["saw"].endswith("at steps [0, 20, 40, 60]")
    assert load_run_info(demo_run / "grpo")["health"]["reward_hacking"]["saw"].endswith("at steps [0, 50, 100, 120]")


@pytest.mark.slow
def test_ppo_writes_its_outputs_and_leaves_the_base_untouched(demo_run: Path) -> None:
    ppo = demo_run / "ppo"
    for name in [
        "adapter_config.json",
        "adapter_model.safetensors",
        "value_head.safetensors",
        "run_config.yaml",
        "run_info.json",
        "metrics.jsonl",
        "ppo_curves.png",
        "samples.md",
    ]:
        assert (ppo / name).is_file(), name
    info = load_run_info(ppo)
    assert info["frozen_base_verified"] and info["frozen_base_digest"]  # hashed before and after: unchanged
    assert_memory_planned_and_measured(info)
    # Only the LoRA weights and the value head were trained: B (zero at init) moved, the head differs from init.
    lora_b = [t for k, t in load_file(ppo / "adapter_model.safetensors").items() if "lora_B" in k]
    assert lora_b and all(t.abs().max() > 0 for t in lora_b)
    head = load_file(ppo / "value_head.safetensors")
    assert head["bias"].abs().item() > 0  # zero at init
    # Every training stage's adapter has a model card: its base, figures, guards and how to load it
    for stage in ["sft", "rm", "ppo", "dpo", "grpo"]:
        card = (demo_run / stage / "README.md").read_text()
        assert card.startswith("---\nbase_model: ") and f"tags: [fitrl, {stage}, lora]" in card, card
        assert "## Results" in card and "guards passed: " in card and "PeftModel.from_pretrained" in card, card
        assert "More Information Needed" not in card  # peft's empty template
    row = read_jsonl(ppo / "metrics.jsonl")[-1]
    for key in [
        "objective/kl",
        "objective/kl_coef",
        "objective/entropy",
        "ppo/policy_loss",
        "ppo/value_loss",
        "ppo/clipfrac",
        "ppo/approx_kl",
        "ppo/explained_variance",
        "env/response_length",
        "time/generate",
        "time/score",
        "time/forward",
        "time/optimise",
        "tokens_per_second",
    ]:
        assert key in row, key
    assert "| query | response | reward |" in (ppo / "samples.md").read_text()


@pytest.mark.slow
def test_the_sentiment_evaluation_reports_every_sample_and_repeats_exactly(demo_run: Path, tmp_path: Path) -> None:
    out = demo_run / "eval"
    report = json.loads((out / "eval.json").read_text())
    assert report["n_prompts"] == len(report["samples"]) == 96
    # Better beyond noise: the paired per-prompt gain must clear three standard errors.
    gains = torch.tensor([s["policy_reward"] - s["reference_reward"] for s in report["samples"]])
    standard_error = gains.std() / len(gains) ** 0.5
    assert gains.mean() > 3 * standard_error, f"gain {gains.mean():.2f} +- {standard_error:.2f}"
    assert report["policy"]["mean"] == pytest.approx(report["reference"]["mean"] + gains.mean().item(), abs=1e-4)
    # the reward classifier's verdicts, the second judge's and the corpus-word shares, read back per sample
    samples = report["samples"]
    for who in ("policy", "reference"):
        share = sum(s[f"{who}_positive"] for s in samples) / len(samples)
        assert report[who]["positive_share"] == pytest.approx(share)
        assert report["judge"][who] == pytest.approx(sum(s[f"{who}_judge"] > 0 for s in samples) / len(samples))
    table = (out / "eval.md").read_text()
    assert (
        (out / "reward_hist.png").is_file() and "reference (adapter off)" in table and "judge (demo://lexicon)" in table
    )
    # the same settings (its own run_config.yaml, paths relative to the project) give the same
    # evaluation, sample for sample
    config = out.relative_to(demo_run.parents[1]) / "run_config.yaml"
    again = run_script("eval.py", "--config", config, "--output_dir", tmp_path / "again", cwd=demo_run.parents[1])
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((tmp_path / "again" / "eval.json").read_text())["samples"] == samples


@pytest.mark.slow
def test_the_reward_pre_flight_flags_cut_responses_and_the_audit_names_the_judges_peak(
    demo_run: Path, tmp_path: Path
) -> None:
    """The demo's reward model learnt whole texts. With the shipped `response_end: sentence` no response
    it scores is cut mid-sentence, which the pre-flight states; PPO against it with `response_end: length`
    feeds it cut text, and the pre-flight flags the `cut_mid_sentence` swing before the first update.

    Margin: the swing on the demo's prompts cut at a length, seeds 0-2 (seed 2 also under AVX2): 0.63-0.84
    against the bar 0.4; the sentiment classifier, which reads what a text says, 0.02-0.13."""
    project = demo_run.parents[1]
    probes = load_run_info(demo_run / "ppo")
    cut = probes["reward_probes"]["cut"]
    assert 2 * cut["n"] <= cut["of"] and "does not steer the reward" in probes["health"]["reward_probes"]["saw"]
    report = (demo_run / "report.md").read_text()
    assert report.count("| probe | n | mean score | share above the median reference |") == 3  # rm, ppo, grpo
    out = tmp_path / "length"
    flags = ["--steps", "1", "--save_steps", "0", "--guard_judge_model", "", "--response_end", "length"]
    result = run_script("ppo.py", "--config", CONFIGS / "demo" / "ppo.yaml", "--output_dir", out, *flags, cwd=project)
    assert result.returncode == 0, result.stderr[-3000:]
    info = load_run_info(out)
    verdict, cut = info["health"]["reward_probes"], info["reward_probes"]["cut"]
    assert verdict["passed"] is False and "cut_mid_sentence: " in verdict["saw"], verdict
    assert 2 * cut["n"] > cut["of"] and cut["swing"] > 0.4, cut

    # The over-optimisation audit: the judge's readings against sqrt(KL), its peak, and the saved policy
    # nearest it, which the named command evaluates.
    audit = probes["overoptimisation"]
    assert [r["step"] for r in audit["readings"]] == [0, 20, 40, 60] and audit["readings"][0]["sqrt_kl"] < 0.1
    peak = max(audit["readings"], key=lambda r: r["gold"])
    assert audit["peak_gold"] == peak["gold"] and audit["nearest_step"] == audit["peak_step"]  # saved every 20
    assert (demo_run / "ppo" / "overoptimisation.png").is_file() and "ppo/overoptimisation.png" in report
    assert audit_figures({"overoptimisation": audit})[0] in report  # its line: the peak, the policy, the command
    fitrl, *args = audit["command"].split()
    assert fitrl == "fitrl" and args[0] == "eval"
    evaluated = run_script("eval.py", *args[1:], "--n_prompts", "8", cwd=project)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    evaluation = json.loads((project / args[args.index("--output_dir") + 1] / "eval.json").read_text())
    assert evaluation["adapter_dir"] == audit["nearest"] and evaluation["n_prompts"] == 8


@pytest.mark.slow
def test_grpos_audit_names_the_checkpoint_nearest_the_held_out_peak_and_its_command_evaluates_it(
    demo_run: Path,
) -> None:
    """GRPO's over-optimisation audit: the held-out accuracy readings (steps 0, 50, 100 and the end, 120)
    beside the training reward, along the steps (beta 0: trl logs no KL), and the saved policy nearest
    their peak among the checkpoints of every 50 steps and the output."""
    project = demo_run.parents[1]
    audit = load_run_info(demo_run / "grpo")["overoptimisation"]
    readings = audit["readings"]
    assert [r["step"] for r in readings] == [0, 50, 100, 120] and all(r["sqrt_kl"] is None for r in readings)
    assert audit["peak_gold"] == max(r["gold"] for r in readings)
    saved = {50: "checkpoint-50", 100: "checkpoint-100", 120: None}
    nearest = min(saved, key=lambda s: (abs(s - audit["peak_step"]), s))
    assert audit["nearest_step"] == nearest and audit["nearest_is_output"] == (nearest == 120)
    assert audit["nearest"].endswith(saved[nearest] or "grpo")
    report = (demo_run / "report.md").read_text()
    assert "grpo/overoptimisation.png" in report and (demo_run / "grpo" / "overoptimisation.png").is_file()
    fitrl, *args = audit["command"].split()
    assert fitrl == "fitrl" and args[0] == "eval_gsm8k"
    evaluated = run_script("eval_gsm8k.py", *args[1:], "--max_samples", "16", "--compare_to_base", "false", cwd=project)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    summary = json.loads((project / args[args.index("--output_dir") + 1] / "summary.json").read_text())
    assert summary["problems"] == 16 and summary["adapter"] == audit["nearest"]


@pytest.mark.slow
def test_grpo_raises_accuracy_in_training_and_on_held_out_problems(demo_run: Path) -> None:
    rows = [r for r in read_jsonl(demo_run / "grpo" / "metrics.jsonl") if "reward" in r]
    k = len(rows) // 5
    accuracy = [r["rewards/accuracy_reward/mean"] for r in rows]
    first, last = sum(accuracy[:k]) / k, sum(accuracy[-k:]) / k
    # A fifth of the run is 24 steps x 64 completions (0 or 2 each); its mean moves step to step with a
    # standard deviation of 0.18-0.23, so the difference of two fifths has a standard error of 0.05-0.07.
    # The shipped assets and profile (sampling at 1.0), seeds 42 / 1 / 2: 0.28 -> 0.39 / 0.31 -> 0.42 /
    # 0.28 -> 0.44 (+0.11 to +0.15), the same on ATen's AVX-512, AVX2 and portable kernels of an Intel
    # Xeon. Two standard errors under the lowest rise is no rise: the bar is the direction.
    assert last > first, f"accuracy reward {first:.3f} -> {last:.3f}"

    summary = json.loads((demo_run / "eval_gsm8k" / "summary.json").read_text())
    before = summary["without_adapter"]
    # Greedy accuracy on the 300 held-out problems, GRPO adapter vs the same model with it off: 17.7% ->
    # 25.7% / 28.3% / 27.0% for seeds 42 / 1 / 2 (+8.0 to +10.7 points), the same on the three code
    # paths above and for seed 42 on two threads. A paired difference where about 40 problems change
    # verdict has a standard error near 2 points: the bar, 4 points, is two of them under the lowest
    # gain measured (and two above no gain).
    assert summary["accuracy"] >= before["accuracy"] + 0.04, (summary["accuracy"], before["accuracy"])
    assert before["accuracy"] > 0.1
    assert summary["format_compliance"] >= before["format_compliance"]
