"""The GSM8K task: problems, prompts, and the GRPO and evaluation scripts run as a user would."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from fitrl.config import UsageError
from fitrl.distributed import tensor_digest
from fitrl.outputs import read_jsonl
from fitrl.tasks.answer_format import ensure_chat_template, format_solution, prompt_messages, render_prompt
from fitrl.tasks.grading import is_correct, is_strict_format
from fitrl.tasks.gsm8k import GSM8KDataArguments, add_prompts, load_problems

from conftest import (
    CONFIGS,
    Payload,
    accelerate_launch,
    assert_memory_planned_and_measured,
    error_line,
    run_script,
    sigterm_when,
)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_demo_problems_have_numeric_golds(demo_assets: Path) -> None:
    ds, skipped = load_problems(GSM8KDataArguments(dataset="demo://arithmetic", dataset_split="test"), str(demo_assets))
    assert skipped == [] and len(ds) == 300
    assert set(ds.column_names) == {"question", "answer", "gold"}
    row = ds[0]
    assert row["answer"].endswith(f"#### {row['gold']}")
    # the format the demo teaches its reasoner is the format the rewards ask for, with the gold inside
    solution = format_solution(row["answer"])
    assert is_strict_format(solution) and is_correct(solution, row["gold"])
    assert "<<" not in solution  # GSM8K's calculator annotations are not part of the reasoning


def test_non_numeric_gold_is_skipped_and_reported(tmp_path: Path, demo_assets: Path) -> None:
    rows = [
        {"question": "What is 2 + 2?", "answer": "2 + 2 = 4\n#### 4"},
        {"question": "Name a colour.", "answer": "#### blue"},
        {"question": "What is 10 * 100?", "answer": "#### 1,000"},
    ]
    args = GSM8KDataArguments(dataset=str(write_jsonl(tmp_path / "test.jsonl", rows)), dataset_split="test")
    ds, skipped = load_problems(args, str(demo_assets))  # the held-out file itself: read whole
    assert ds["gold"] == ["4", "1,000"]
    assert skipped == [{"row": 1, "gold": "blue"}]


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{"question": "q", "solution": "#### 4"}], "no column 'answer'"),
        ([{"prompt": "q", "answer": "#### 4"}], "no column 'question'"),
        (
            [{"question": "q", "answer": "#### 4"}, {"question": "q2", "answer": "four"}],
            "row 1: answer 'four' is neither",
        ),
        ([{"question": "q", "answer": "#### four"}], "no row has a numeric gold"),
    ],
)
def test_bad_gsm8k_data_is_a_usage_error(tmp_path: Path, demo_assets: Path, rows: list, message: str) -> None:
    args = GSM8KDataArguments(dataset=str(write_jsonl(tmp_path / "test.jsonl", rows)), dataset_split="test")
    with pytest.raises(UsageError, match=message):
        load_problems(args, str(demo_assets))


def test_plain_numeric_answers_in_columns_of_other_names_are_read(tmp_path: Path, demo_assets: Path) -> None:
    """A user's own question/answer data: the answer a bare number (text or numeric), the columns named."""
    rows = [{"q": "What is 2 + 2?", "a": 4, "id": 1}, {"q": "Half of 7?", "a": "3.5", "id": 2}]
    args = GSM8KDataArguments(
        dataset=str(write_jsonl(tmp_path / "test.jsonl", rows)), dataset_split="test", question_column="q",
        answer_column="a",
    )  # fmt: skip
    ds, skipped = load_problems(args, str(demo_assets))
    assert ds["question"] == ["What is 2 + 2?", "Half of 7?"] and ds["gold"] == ["4", "3.5"] and not skipped


def test_prompts_use_the_system_message_and_long_ones_are_dropped(demo_assets: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_assets / "lm")
    assert ensure_chat_template(tok) is True  # a base model's tokenizer gets the plain template
    assert ensure_chat_template(tok) is False
    text = render_prompt(tok, prompt_messages("What is 2 + 2?"))
    assert text.startswith("Respond in the following format:\n<reasoning>")
    assert text.endswith("What is 2 + 2?\nAnswer:\n")

    ds, _ = load_problems(GSM8KDataArguments(dataset="demo://arithmetic", max_samples=50), str(demo_assets))
    lengths = sorted(len(tok(render_prompt(tok, prompt_messages(q))).input_ids) for q in ds["question"])
    limit = lengths[len(lengths) // 2]
    kept, dropped = add_prompts(ds, tok, "Respond in the following format:", 10_000)
    assert dropped == 0 and kept[0]["prompt"][0]["role"] == "system"
    kept, dropped = add_prompts(ds, tok, GSM8KDataArguments().system_prompt, limit)
    assert dropped == sum(n > limit for n in lengths) > 0 and len(kept) == 50 - dropped
    with pytest.raises(UsageError, match="raise max_prompt_length"):
        add_prompts(ds, tok, GSM8KDataArguments().system_prompt, lengths[0] - 1)


def test_demo_reasoner_has_learned_the_format(demo_assets: Path) -> None:
    """GRPO needs a start that sometimes earns the format reward: the demo's reasoner mostly does."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fitrl.outputs import read_jsonl
    from fitrl.rollout import complete_chats

    tok = AutoTokenizer.from_pretrained(demo_assets / "reasoner")
    tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(demo_assets / "reasoner")
    problems = read_jsonl(demo_assets / "arithmetic" / "test.jsonl")[:32]
    completions = complete_chats(model, tok, [prompt_messages(p["question"]) for p in problems], 96, batch_size=32)
    assert sum(is_strict_format(c[0]) for c in completions) >= 16


# --- the scripts, as a user runs them -------------------------------------------------------------

SMOKE = [
    "--max_steps",
    "3",
    "--per_device_train_batch_size",
    "8",
    "--num_generations",
    "4",
    "--max_completion_length",
    "32",  # the reasoner's answers take about 20 tokens: a cap near them keeps the memory plan near the step
    "--max_samples",
    "64",
    "--num_samples_to_show",
    "2",
]
# The smoke run's model settings, which its resume and its repeat must share: an 8-bit base (the demo
# profile's is unquantized) and a KL term to the adapter-off reference.
SMOKE_MODEL = ["--quantization", "8bit", "--beta", "0.1"]


@pytest.fixture(scope="module")
def grpo_smoke(tmp_path_factory: pytest.TempPathFactory, demo_assets: Path) -> Path:
    """A 3-step GRPO run on the demo: 8-bit frozen base, LoRA, a KL term to the adapter-off reference."""
    out = tmp_path_factory.mktemp("grpo") / "run"
    result = run_script(
        "grpo.py",
        "--config",
        CONFIGS / "demo" / "grpo.yaml",
        "--demo_assets",
        demo_assets,
        "--output_dir",
        out,
        *SMOKE_MODEL,
        "--save_steps",
        "2",
        *SMOKE,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return out


@pytest.mark.slow
def test_grpo_smoke_run_in_8bit_with_lora(grpo_smoke: Path) -> None:
    from safetensors.torch import load_file

    for name in [
        "adapter_model.safetensors",
        "adapter_config.json",
        "run_config.yaml",
        "run_info.json",
        "grpo_curves.png",
        "samples.md",
        "tokenizer_config.json",
    ]:
        assert (grpo_smoke / name).is_file(), name
    rows = [r for r in read_jsonl(grpo_smoke / "metrics.jsonl") if "reward" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for key in [
        "rewards/strict_format_reward/mean",
        "rewards/soft_format_reward/mean",
        "rewards/accuracy_reward/mean",
        "completions/mean_length",
        "kl",
        "peak_memory_mb",
    ]:
        assert all(isinstance(r[key], (int, float)) for r in rows), key
    assert rows[-1]["kl"] > 0  # the reference (adapter off) really differs from the trained policy
    # LoRA's B starts at zero: a non-zero B means the adapter was trained
    adapter = load_file(grpo_smoke / "adapter_model.safetensors")
    assert any(t.abs().sum() > 0 for k, t in adapter.items() if "lora_B" in k)
    info = json.loads((grpo_smoke / "run_info.json").read_text())
    assert info["problems"] == 64 and info["memory"]["peak_rss_mb"] > 0
    assert_memory_planned_and_measured(info)
    assert "| question | gold | before | after |" in (grpo_smoke / "samples.md").read_text()
    # checkpoints live beside the output, so a stopped run keeps them
    assert (grpo_smoke.with_name("run.checkpoints") / "checkpoint-2" / "trainer_state.json").is_file()


@pytest.mark.slow
def test_grpo_resumes_from_a_checkpoint(grpo_smoke: Path, demo_assets: Path, tmp_path: Path) -> None:
    checkpoint = grpo_smoke.with_name("run.checkpoints") / "checkpoint-2"
    out = tmp_path / "resumed"
    result = run_script(
        "grpo.py",
        "--config",
        CONFIGS / "demo" / "grpo.yaml",
        "--demo_assets",
        demo_assets,
        "--output_dir",
        out,
        *SMOKE_MODEL,
        "--resume_from_checkpoint",
        checkpoint,
        *SMOKE[:-2],
        "--num_samples_to_show",
        "0",
        "--max_steps",
        "4",
        "--save_steps",
        "0",
    )
    assert result.returncode == 0, result.stderr[-4000:]
    rows = read_jsonl(out / "metrics.jsonl")
    steps = [r["step"] for r in rows if "reward" in r]
    assert steps == [1, 2, 3, 4]  # the whole history: steps 1-2 from the checkpoint, 3-4 from this run
    before = [r for r in read_jsonl(grpo_smoke / "metrics.jsonl") if "reward" in r][:2]
    assert [r for r in rows if "reward" in r][:2] == before
    # the summary's train_loss covers all four steps, not only the two this process ran
    summary = next(r for r in rows if "train_loss" in r)
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 4 and summary["train_loss"] == pytest.approx(sum(losses) / 4, rel=1e-6)
    # no save_steps: no checkpoint directory is left behind
    assert not out.with_name("resumed.checkpoints").exists()
    assert json.loads((out / "run_info.json").read_text())["resumed_from"] == str(checkpoint)


@pytest.mark.slow
def test_two_process_ddp_ends_with_identical_adapters(tmp_path: Path, demo_assets: Path) -> None:
    from safetensors.torch import load_file

    out = tmp_path / "ddp"
    result = run_script(
        "grpo.py",
        "--config",
        CONFIGS / "demo" / "grpo.yaml",
        "--demo_assets",
        demo_assets,
        "--output_dir",
        out,
        *SMOKE[:-2],
        "--num_samples_to_show",
        "0",
        "--max_steps",
        "2",
        launcher=accelerate_launch(2),
    )
    assert result.returncode == 0, result.stderr[-4000:]
    info = json.loads((out / "run_info.json").read_text())
    assert info["world_size"] == 2
    digests = info["rank_weight_digests"]
    assert len(digests) == 2 and digests[0] == digests[1]
    adapter = load_file(out / "adapter_model.safetensors")
    assert tensor_digest(adapter) == digests[0]  # the digest is of the weights rank 0 wrote
    assert any(t.abs().sum() > 0 for k, t in adapter.items() if "lora_B" in k)


@pytest.mark.slow
def test_evaluate_gsm8k_with_and_without_the_adapter(grpo_smoke: Path, demo_assets: Path, tmp_path: Path) -> None:
    data = write_jsonl(
        tmp_path / "test.jsonl",
        [
            {"question": "Mia has 4 apples. Mia gets 3 more. How many apples does Mia have now?", "answer": "#### 7"},
            {"question": "Name a colour.", "answer": "#### blue"},
            {"question": "Leo has 9 books and gives away 2. How many books are left?", "answer": "#### 7"},
        ],
    )
    # docs/gsm8k.md's own reward, as written there (it reads `completion_ids`, as trl passes them)
    (tmp_path / "my_rewards.py").write_text(
        "def brevity(completions, completion_ids, **kw): return [-len(c) / 100 for c in completion_ids]\n"
    )
    out = tmp_path / "eval"
    result = run_script(
        "eval_gsm8k.py",
        "--config",
        CONFIGS / "demo" / "eval_gsm8k.yaml",
        "--demo_assets",
        demo_assets,
        "--dataset",
        data,
        "--adapter",
        grpo_smoke,
        "--quantization",
        "8bit",  # the smoke adapter's base
        "--output_dir",
        out,
        "--num_samples",
        "3",
        "--temperature",
        "1.0",
        "--max_new_tokens",
        "48",
        # GRPO's own rewards and the documented one of the user's, called as GRPO calls them
        *["--reward_funcs", "accuracy", "strict_format", f"{tmp_path / 'my_rewards.py'}:brevity"],
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "skipped 1 problems whose gold answer is not a number" in result.stdout
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert summary["problems"] == 2 and summary["k"] == 3 and len(rows) == 6
    assert set(rows[0]) == {
        "question",
        "gold",
        "sample",
        "completion",
        "parsed_answer",
        "correct",
        "failure",
        "strict_format",
    }
    # the summary is the metric over exactly these completions
    assert summary["accuracy"] == pytest.approx(sum(r["correct"] for r in rows) / 6)
    assert summary["format_compliance"] == pytest.approx(sum(r["strict_format"] for r in rows) / 6)
    scores = {"accuracy", "pass_at_k", "format_compliance", "k", "harness_strict_match", "harness_flexible_extract"}
    assert set(summary["without_adapter"]) == scores | {"failures", "rewards"}
    rewards = summary["rewards"]  # the training rewards read the same completions as the metric
    assert rewards["accuracy_reward"] == pytest.approx(2.0 * summary["accuracy"])
    assert rewards["strict_format_reward"] == pytest.approx(0.5 * summary["format_compliance"])
    assert -0.48 <= rewards["brevity"] < 0  # minus a hundredth per token of completions of at most 48
    # every completion that is not correct says why, and the summary counts the same reasons
    assert all((r["failure"] is None) == r["correct"] for r in rows)
    assert sum(summary["failures"].values()) == sum(not r["correct"] for r in rows)
    assert summary["split"] == "test"  # a local test.jsonl is the test split, whatever dataset_split says


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model_name_or_path", "/nonexistent/model"], "/nonexistent/model"),
        (["--num_generations", "1"], "invalid value for 'num_generations'"),
        (["--per_device_train_batch_size", "6", "--num_generations", "4"], "divisible"),
        (["--resume_from_checkpoint", "latest"], "no complete checkpoint to resume"),
        (["--max_samples", "4", "--max_steps", "-1"], "4 problems fill less than one optimizer step"),
        (["--max_samples", "2"], "2 problems fill less than one optimizer step"),  # max_steps: trl finds no batch
        (["--loss_type", "ppo"], "invalid choice: 'ppo'"),
        (["--reward_funcs", "accurcy"], "reward_funcs: unknown reward 'accurcy'; give a registry name"),
        (["--reward_funcs", "accuracy", "--reward_weights", "1", "2"], "invalid value for 'reward_weights'"),
        (["--guard_heldout_split", "validation"], "set guard_heldout_split to a held-out split, or guard_heldout"),
    ],
)
def test_grpo_bad_config_exits_2(tmp_path: Path, demo_assets: Path, args: list[str], message: str) -> None:
    out = tmp_path / "never"
    result = run_script(
        "grpo.py",
        "--config",
        CONFIGS / "demo" / "grpo.yaml",
        "--demo_assets",
        demo_assets,
        "--output_dir",
        out,
        *args,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert message in error_line(result)
    assert not out.exists() and not out.with_name(".never.partial").exists()


@pytest.mark.parametrize("script", ["grpo.py", "eval_gsm8k.py"])
def test_scripts_reject_answers_that_state_no_number(tmp_path: Path, demo_assets: Path, script: str) -> None:
    # test.jsonl: the evaluation reads it whole; GRPO trains on it whole (one row: none held out)
    data = write_jsonl(tmp_path / "test.jsonl", [{"question": "What is 2 + 2?", "answer": "about four"}])
    config, extra = ("grpo", []) if script.startswith("grpo") else ("eval_gsm8k", ["--adapter", "null"])
    result = run_script(
        script,
        "--config",
        CONFIGS / "demo" / f"{config}.yaml",
        "--demo_assets",
        demo_assets,
        "--dataset",
        data,
        "--output_dir",
        tmp_path / "out",
        *extra,
    )
    assert result.returncode == 2
    assert "row 0: answer 'about four' is neither a number nor a solution ending '#### <number>'" in error_line(result)
    assert not (tmp_path / "out").exists()


def test_evaluate_rejects_a_missing_adapter(tmp_path: Path, demo_assets: Path) -> None:
    result = run_script(
        "eval_gsm8k.py",
        "--config",
        CONFIGS / "demo" / "eval_gsm8k.yaml",
        "--demo_assets",
        demo_assets,
        "--adapter",
        tmp_path / "nothing",
        "--output_dir",
        tmp_path / "out",
    )
    assert result.returncode == 2
    assert "has no adapter_config.json" in error_line(result)


def test_a_missing_gsm8k_column_says_which_columns_are_needed(tmp_path: Path, demo_assets: Path) -> None:
    args = GSM8KDataArguments(dataset=str(write_jsonl(tmp_path / "bad.jsonl", [{"q": "What is 2 + 2?"}])))
    with pytest.raises(UsageError, match="no column 'question'.*set question_column and answer_column"):
        load_problems(args, str(demo_assets))


@pytest.mark.slow
def test_grpo_with_the_same_seed_writes_the_same_adapter(grpo_smoke: Path, demo_assets: Path, tmp_path: Path) -> None:
    """The seed covers the LoRA init, the sampling and the data order: a second run repeats the first."""
    again = tmp_path / "again"
    result = run_script(
        "grpo.py",
        "--config",
        CONFIGS / "demo" / "grpo.yaml",
        "--demo_assets",
        demo_assets,
        "--output_dir",
        again,
        *SMOKE_MODEL,
        *SMOKE,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    name = "adapter_model.safetensors"
    assert (again / name).read_bytes() == (grpo_smoke / name).read_bytes()
    rewards = [[r["reward"] for r in read_jsonl(d / "metrics.jsonl") if "reward" in r] for d in (grpo_smoke, again)]
    assert rewards[0] == rewards[1]


def test_fewshot_examples_are_solved_train_problems_before_the_question(demo_assets: Path) -> None:
    from transformers import AutoTokenizer

    from fitrl.tasks.gsm8k import fewshot_examples

    args = GSM8KDataArguments(dataset="demo://arithmetic", dataset_split="test")
    examples = fewshot_examples(args, 2, seed=5, demo_assets=str(demo_assets))
    assert examples == fewshot_examples(args, 2, seed=5, demo_assets=str(demo_assets))  # the seed fixes them
    train_questions = set(
        load_problems(dataclasses.replace(args, dataset_split="train"), str(demo_assets))[0]["question"]
    )
    assert all(q in train_questions and is_strict_format(a) for q, a in examples)
    tok = AutoTokenizer.from_pretrained(demo_assets / "lm")
    ensure_chat_template(tok)
    text = render_prompt(tok, prompt_messages("What is 2 + 2?", examples=examples))
    assert text.index(examples[0][0]) < text.index(examples[1][0]) < text.index("What is 2 + 2?")
    assert text.count("<answer>") == 1 + 2  # the system prompt's, then one per example
    assert text.endswith("What is 2 + 2?\nAnswer:\n")
    with pytest.raises(UsageError, match="lower num_fewshot"):
        fewshot_examples(dataclasses.replace(args, max_samples=3), 10_000, 0, str(demo_assets))


def test_harness_extractions_read_as_lm_evaluation_harness_does() -> None:
    from fitrl.tasks.gsm8k import grade, harness_answers

    assert harness_answers("so she pays 5 + 13 = 18.\n#### 18") == ("18", "18")
    assert harness_answers("<answer>\n$1,000.\n</answer>") == (None, "$1,000.")
    assert harness_answers("no number here") == (None, None)
    completions = [["#### 1,000", "It is 1000."], ["<answer>\n7\n</answer>", "<answer>\nseven\n</answer>"]]
    scores = grade(completions, ["1000", "7"])
    assert scores["harness_strict_match"] == 0.25 and scores["harness_flexible_extract"] == 0.75
    assert scores["failures"] == {"no_answer_block": 2, "unparsable_answer": 0, "wrong_number": 0}


@pytest.mark.slow
def test_sampled_evaluation_repeats_with_the_same_seed(grpo_smoke: Path, demo_assets: Path, tmp_path: Path) -> None:
    runs = []
    for name in ["a", "b"]:
        result = run_script(
            "eval_gsm8k.py",
            "--config",
            CONFIGS / "demo" / "eval_gsm8k.yaml",
            "--demo_assets",
            demo_assets,
            "--adapter",
            grpo_smoke,
            "--output_dir",
            tmp_path / name,
            "--max_samples",
            "8",
            "--num_samples",
            "2",
            "--temperature",
            "1.0",
            "--max_new_tokens",
            "32",
        )
        assert result.returncode == 0, result.stderr[-3000:]
        runs.append([json.loads(line)["completion"] for line in (tmp_path / name / "completions.jsonl").open()])
    assert runs[0] == runs[1] and len(set(runs[0])) > 1


# --- checkpoints after real faults ----------------------------------------------------------------


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_the_run_resumes_from_it(tmp_path: Path, demo_assets: Path) -> None:
    """A preempted machine sends SIGTERM: the step finishes, a complete checkpoint is saved, the process
    exits 143 with one line and leaves no half-written output; `latest` resumes there."""
    out = tmp_path / "run"
    args = ["--config", CONFIGS / "demo" / "grpo.yaml", "--demo_assets", demo_assets, "--output_dir", out]
    args += [*SMOKE_MODEL, *SMOKE[:-2], "--num_samples_to_show", "0"]
    staged = tmp_path / ".run.partial" / "metrics.jsonl"
    code, line = sigterm_when("grpo.py", *args, "--max_steps", "500", watch=staged, rows=2)
    assert code == 143 and "stopped by SIGTERM after step" in line and "--resume_from_checkpoint latest" in line
    step = int(line.split("after step ")[1].split(";")[0])
    assert step >= 2 and line.split("saved ")[1].startswith(str(tmp_path / "run.checkpoints" / f"checkpoint-{step}"))
    assert (tmp_path / "run.checkpoints" / f"checkpoint-{step}" / "run_config.yaml").is_file()
    assert not out.exists() and not staged.parent.exists()

    result = run_script(*["grpo.py", *args], "--max_steps", str(step + 1), "--resume_from_checkpoint", "latest")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows if "reward" in r] == list(range(1, step + 2))
    # the held-out guard read at the start, as an uninterrupted run would (not again at the resume), and the
    # final policy at the end (outside metrics.jsonl: no step is logged after it)
    assert [r["step"] for r in rows if "heldout/accuracy" in r] == [1]
    info = json.loads((out / "run_info.json").read_text())
    assert info["resumed_from"].endswith(f"checkpoint-{step}")
    assert info["health"]["reward_hacking"]["saw"].endswith(f"at steps [0, {step + 1}]")


@pytest.fixture
def copied_checkpoints(grpo_smoke: Path, tmp_path: Path) -> Path:
    """The smoke run's checkpoints under a fresh output name; returns that output directory."""
    import shutil

    shutil.copytree(grpo_smoke.with_name("run.checkpoints"), tmp_path / "run.checkpoints")
    return tmp_path / "run"


def _grpo_main(out: Path, demo_assets: Path, *extra: str | Path) -> int:
    from conftest import run_main

    args = ["--config", CONFIGS / "demo" / "grpo.yaml", "--demo_assets", demo_assets, "--output_dir", out]
    return run_main("grpo.py", *args, *SMOKE_MODEL, "--save_steps", "2", *SMOKE, *extra)


def _strict_run_with_template(tmp_path: Path, demo_assets: Path, old: str, new: str, *extra_tokens: str):
    """GRPO under strict_guards on the demo reasoner whose plain chat template has `old` replaced by `new`
    (and `extra_tokens` added as special tokens); returns (exit code, stderr). Nothing may be written."""
    import shutil

    from transformers import AutoTokenizer

    from fitrl.tasks.answer_format import PLAIN_CHAT_TEMPLATE

    model = tmp_path / "chat"
    shutil.copytree(demo_assets / "reasoner", model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    if extra_tokens:
        tokenizer.add_tokens(list(extra_tokens), special_tokens=True)
    assert old in PLAIN_CHAT_TEMPLATE
    tokenizer.chat_template = PLAIN_CHAT_TEMPLATE.replace(old, new)
    tokenizer.save_pretrained(model)
    return _grpo_main(tmp_path / "run", demo_assets, "--model_name_or_path", model, "--strict_guards", "true")


def test_a_template_that_opens_the_reasoning_block_is_named_before_any_step(
    tmp_path: Path, demo_assets: Path, capsys: pytest.CaptureFixture
) -> None:
    """A thinking-style chat template ends the prompt with the block the format reward expects the
    completion to open: completions never write it and the format reward reads 0 (ms-swift#9764).
    With strict_guards the run stops in its preflight, before the model loads, and writes nothing."""
    code = _strict_run_with_template(tmp_path, demo_assets, "{{ 'Answer:\\n' }}", "{{ 'Answer:\\n<reasoning>\\n' }}")
    err = capsys.readouterr().err
    assert code == 1, err[-2000:]
    assert "error: guard 'template' at step 0: the chat template ends each prompt with <reasoning>" in err
    assert not (tmp_path / "run").exists()


def test_a_turn_end_token_generation_does_not_stop_at_is_named_before_any_step(
    tmp_path: Path, demo_assets: Path, capsys: pytest.CaptureFixture
) -> None:
    """A chat template that closes the assistant's turn with a token the generation never stops at (Llama
    3's <|eot_id|> beside a base config's <|end_of_text|>): completions run to the length limit."""
    closing = "message['content'] + eos_token"
    code = _strict_run_with_template(tmp_path, demo_assets, closing, "message['content'] + '<|end|>'", "<|end|>")
    err = capsys.readouterr().err
    assert code == 1, err[-2000:]
    assert "error: guard 'stop_token' at step 0: the chat template closes an assistant turn with '<|end|>'" in err
    assert not (tmp_path / "run").exists()


def test_format_only_rewards_without_a_kl_term_are_named_before_any_step(
    tmp_path: Path, demo_assets: Path, capsys: pytest.CaptureFixture
) -> None:
    """trl's default beta 0 with rewards that only score the format: the policy games the format with
    empty content (FAI-RL#96). With strict_guards the run stops before the model loads."""
    args = ["--reward_funcs", "strict_format", "soft_format", "--beta", "0", "--strict_guards", "true"]
    code = _grpo_main(tmp_path / "run", demo_assets, *args)
    err = capsys.readouterr().err
    assert code == 1, err[-2000:]
    assert (
        "error: guard 'format_only' at step 0: every reward (strict_format, soft_format) scores only the format" in err
    )
    assert not (tmp_path / "run").exists()


# A reward a user might write by mistake: it pays for repeating a word the reasoner uses ("Mia has ...").
REPEATED_WORD_REWARD = """
def repeat_word(completions, **kwargs):
    texts = [c[0]["content"] for c in completions]  # chat completions: one assistant message each
    return [min(t.split().count("has"), 8) / 4 for t in texts]
"""


@pytest.mark.slow
def test_a_reward_for_a_repeated_word_trips_the_hacking_and_repetition_guards(
    tmp_path: Path, demo_assets: Path
) -> None:
    """The user's own reward function, in a module of its own in the working directory, with no content
    reward: the training reward rises while held-out accuracy falls and completions loop on the word.

    Measured on this demo (lr 2e-3, 20 steps, graded at steps 0/10/20), seeds 42 / 1 / 2: held-out
    accuracy 28% -> 0% / 0% / 0% at step 20 (the guard needs a 10-point fall); seq-rep-3 peaks 0.41 /
    0.58 / 0.40 against the test's 0.15 (5 steps in a row; the clean demo run's peak is 0.02)."""
    (tmp_path / "my_rewards.py").write_text(REPEATED_WORD_REWARD)
    out = tmp_path / "run"
    result = run_script(
        "grpo.py",
        *["--config", CONFIGS / "demo" / "grpo.yaml", "--demo_assets", demo_assets, "--output_dir", out],
        *["--reward_funcs", "my_rewards:repeat_word", "--learning_rate", "2e-3", "--max_steps", "20"],
        *["--guard_heldout_every", "10", "--guard_repetition_max", "0.15", "--num_samples_to_show", "0"],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    health = json.loads((out / "run_info.json").read_text())["health"]
    assert not health["reward_hacking"]["passed"], health["reward_hacking"]
    assert "held-out accuracy fell " in health["reward_hacking"]["saw"]
    assert not health["repetition"]["passed"] and health["format_only"]["passed"]
    rows = read_jsonl(out / "metrics.jsonl")
    readings = [r["heldout/accuracy"] for r in rows if "heldout/accuracy" in r]
    assert len(readings) == 3 and readings[-1] <= readings[0] - 0.1  # steps 0, 10, 20
    assert "rewards/repeat_word/mean" in rows[0]
    assert "guard 'reward_hacking' at step" in result.stderr  # warned once, the run went on


@pytest.mark.slow
def test_a_reward_that_scores_every_completion_alike_trips_the_learning_signal_guard(
    tmp_path: Path, demo_assets: Path
) -> None:
    """Groups whose completions all score the same give GRPO no advantage to learn from (trl logs their
    share as frac_reward_zero_std; the clean demo run's peak is 0.75, its mean 0.37): a constant reward
    makes it 1 at every step, and the guard names it after 5 logged steps."""
    (tmp_path / "flat.py").write_text("def flat(completions, **kw): return [1.0] * len(completions)\n")
    out = tmp_path / "run"
    result = run_script(
        "grpo.py",
        *["--config", CONFIGS / "demo" / "grpo.yaml", "--demo_assets", demo_assets, "--output_dir", out],
        *["--reward_funcs", f"{tmp_path / 'flat.py'}:flat", "--max_steps", "6", "--guard_heldout_every", "0"],
        *["--num_samples_to_show", "0", "--per_device_train_batch_size", "16", "--num_generations", "4"],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    health = json.loads((out / "run_info.json").read_text())["health"]
    assert health["learning_signal"]["passed"] is False and health["learning_signal"]["step"] == 5, health
    assert "the completions of most questions all score the same" in health["learning_signal"]["saw"]
    assert health["reward_hacking"] == {"passed": None, "saw": "not run: guard_heldout_every is 0"}


@pytest.mark.slow
def test_latest_skips_checkpoints_whose_save_did_not_finish(
    copied_checkpoints: Path, demo_assets: Path, capsys: pytest.CaptureFixture
) -> None:
    """`kill -9` or a full disk during a save leaves a newest checkpoint without its settings file (or an
    empty folder): `latest` takes the newest complete one; naming an incomplete one is refused."""
    import shutil

    from fitrl.checkpoints import latest_checkpoint, resume_checkpoint
    from fitrl.config import load_run_config

    root = copied_checkpoints.with_name("run.checkpoints")
    newest = latest_checkpoint(root, "checkpoint")
    n = int(newest.name.removeprefix("checkpoint-"))
    cut = root / f"checkpoint-{n + 1}"
    shutil.copytree(newest, cut)
    (cut / "run_config.yaml").unlink()  # cut off before its last file
    (cut / "optimizer.pt").write_bytes(b"\x80")  # and mid-write
    (root / f"checkpoint-{n + 2}").mkdir()
    settings = load_run_config(newest)
    assert resume_checkpoint("latest", copied_checkpoints, "checkpoint", "GRPO", settings) == newest
    assert "skipping" in capsys.readouterr().out
    assert _grpo_main(copied_checkpoints, demo_assets, "--resume_from_checkpoint", cut) == 2
    err = capsys.readouterr().err
    assert f"{cut.name} is incomplete" in err and f"resume from {newest} instead" in err
    assert not copied_checkpoints.exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "damage", "message"),
    [
        ("trainer_state.json", "truncate", "the checkpoint is damaged"),
        ("optimizer.pt", "truncate", "the checkpoint is damaged"),
        ("optimizer.pt", "craft", "holds objects other than tensors"),
        ("scheduler.pt", "craft", "holds objects other than tensors"),
        ("rng_state.pth", "craft", "holds objects other than tensors"),
        ("adapter_model.safetensors", "truncate", "the checkpoint is damaged"),
    ],
)
def test_a_damaged_or_crafted_checkpoint_is_one_line_and_runs_nothing(
    copied_checkpoints: Path, demo_assets: Path, capsys: pytest.CaptureFixture, name: str, damage: str, message: str
) -> None:
    import pickle

    from fitrl.checkpoints import latest_checkpoint

    path = latest_checkpoint(copied_checkpoints.with_name("run.checkpoints"), "checkpoint") / name
    marker = path.parent.parent / "payload-ran"
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[: max(1, path.stat().st_size // 2)])
    else:
        path.write_bytes(pickle.dumps(Payload(marker)))
    assert _grpo_main(copied_checkpoints, demo_assets, "--resume_from_checkpoint", "latest") == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and message in errors[0] and name in errors[0], errors
    assert not marker.exists() and not copied_checkpoints.exists()
