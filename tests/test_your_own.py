"""A new user's journey, with their own model, data and reward, through the `fitrl` command and config
files only (issue: "your own model, data and reward"): a tiny Qwen2-style model with a ChatML chat
template, SFT on a `messages` file (the folder of configs run as a profile of the pipeline), PPO on
chat prompts against a scalar reward model whose tokenizer has no pad token and its evaluation, GRPO
with a reward function in a file of its own on question/answer data whose answers are plain numbers,
and a usage error that is one line and exit 2. The base is loaded in 4-bit, as QLoRA on a 16 GB card
would, with biased layers of odd sizes (bitsandbytes' CPU path).

Every model and file is built here, as a user would bring them; nothing comes from the hub or the demo.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fitrl.outputs import read_jsonl

from conftest import load_run_info

FITRL = Path(sys.executable).parent / "fitrl"
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
MY_REWARDS = '''
def brevity(completions, **kwargs):
    """Shorter answers score higher."""
    return [-len(c[0]["content"]) / 100 for c in completions]
'''
TINY = {"lora_r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "lora_target_modules": ["all-linear"]}


def _models(root: Path, demo_assets: Path) -> tuple[Path, Path]:
    """A tiny Qwen2-style policy with a ChatML template, and a scalar (one-output) reward model whose
    tokenizer has no pad token, as many on the hub are."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(demo_assets / "lm")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.eos_token, tokenizer.chat_template = "<|im_end|>", CHATML
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=40, intermediate_size=72, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    policy, scorer = root / "my-qwen", root / "my-reward-model"
    Qwen2ForCausalLM(config).save_pretrained(policy)
    tokenizer.save_pretrained(policy)
    # a Llama-style reward model (a tokenizer of that kind has no pad token unless one is set)
    shape = {k: getattr(config, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")}
    LlamaForSequenceClassification(LlamaConfig(**shape, num_attention_heads=4, num_labels=1)).save_pretrained(scorer)
    tokenizer.save_pretrained(scorer)
    return policy, scorer


def _data(root: Path) -> None:
    sums = [(a, b) for a in range(8) for b in range(4)]
    questions = [{"q": f"What is {a} + {b}?", "a": a + b} for a, b in sums]  # the answer: a number alone
    chats = [
        [{"role": "user", "content": q["q"]}, {"role": "assistant", "content": f"It is {q['a']}."}] for q in questions
    ]
    prompts = [[{"role": "system", "content": "Answer kindly."}, c[0]] for c in chats]
    # trl's conversational preference pairs: the prompt turns, then the right and a wrong answer
    pairs = [
        {"prompt": c[:1], "chosen": c[1:], "rejected": [{"role": "assistant", "content": f"It is {q['a'] + 1}."}]}
        for c, q in zip(chats, questions)
    ]
    for name, rows in [
        ("chats.jsonl", [{"messages": c} for c in chats]),
        ("prompts.jsonl", [{"messages": p} for p in prompts]),
        ("questions.jsonl", questions),
        ("pairs.jsonl", pairs),
    ]:
        (root / "data").mkdir(exist_ok=True)
        (root / "data" / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "my_rewards.py").write_text(MY_REWARDS)


def _configs(root: Path, policy: Path, scorer: Path) -> None:
    # QLoRA, as on a 16 GB card: a 4-bit base with biased projections of sizes no multiple of 64
    model = {"model_name_or_path": str(policy), "quantization": "4bit", "dtype": "float32", **TINY}
    configs = {
        "sft": {**model, "dataset": "data/chats.jsonl", "text_column": "messages", "block_size": 32,
                "output_dir": "outputs/sft", "max_steps": 2, "per_device_train_batch_size": 4, "logging_steps": 1},
        "rm": {**model, "dataset": "data/pairs.jsonl", "prompt_column": "prompt", "output_dir": "outputs/rm",
               "max_steps": 2, "per_device_train_batch_size": 4, "logging_steps": 1, "max_length": 64},
        "ppo": {**model, "dataset": "data/prompts.jsonl", "text_column": "messages", "max_prompt_tokens": 64,
                "response_min_tokens": 4, "response_max_tokens": 8, "reward_model": str(scorer),
                "output_dir": "outputs/ppo", "steps": 2, "batch_size": 8, "mini_batch_size": 4,
                "forward_batch_size": 8, "ppo_epochs": 1, "report_to": "none"},
        "dpo": {**model, "dataset": "data/pairs.jsonl", "prompt_column": "prompt", "output_dir": "outputs/dpo",
                "max_steps": 2, "per_device_train_batch_size": 4, "logging_steps": 1, "max_length": 64},
        "grpo": {**model, "dataset": "data/questions.jsonl", "question_column": "q", "answer_column": "a",
                 "reward_funcs": ["accuracy", "my_rewards:brevity"], "reward_weights": [1.0, 0.5],
                 "output_dir": "outputs/grpo", "max_steps": 2, "per_device_train_batch_size": 4,
                 "num_generations": 4, "max_completion_length": 8, "logging_steps": 1, "learning_rate": 1e-3,
                 "num_samples_to_show": 1, "report_to": "tensorboard"},
    }  # fmt: skip
    (root / "mine").mkdir()
    for stage, values in configs.items():
        (root / "mine" / f"{stage}.yaml").write_text(yaml.safe_dump(values, sort_keys=False))


def _fitrl(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(FITRL), *args], cwd=root, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_a_new_user_runs_their_own_model_data_and_reward_through_fitrl(tmp_path: Path, demo_assets: Path) -> None:
    policy, scorer = _models(tmp_path, demo_assets)
    _data(tmp_path)
    _configs(tmp_path, policy, scorer)

    # The folder is a profile of the pipeline too, run from here (its relative data paths read from here):
    # it would run sft, rm, ppo, dpo and grpo into outputs/mine; SFT goes that way, the rest one command each.
    planned = _fitrl(tmp_path, "pipeline", "--profile", "mine", "--dry_run")
    assert planned.returncode == 0, planned.stderr[-3000:]
    configs = [line.split("--config ")[1].split()[0] for line in planned.stdout.splitlines()]
    assert configs == [f"mine/{s}.yaml" for s in ("sft", "rm", "ppo", "dpo", "grpo")], planned.stdout
    sft = _fitrl(tmp_path, "pipeline", "--profile", "mine", "--stages", "sft")
    assert sft.returncode == 0, sft.stderr[-3000:]
    out = tmp_path / "outputs" / "mine" / "sft"
    assert (out / "adapter_model.safetensors").is_file() and (out / "chat_template.jinja").read_text() == CHATML
    assert len(read_jsonl(out / "metrics.jsonl")) >= 2
    assert "fitrl mine run" in (tmp_path / "outputs" / "mine" / "report.md").read_text()

    # Conversational pairs, rendered in the chat template; one data file: 10% of it held out, and said so.
    for stage in ("rm", "dpo"):
        trained = _fitrl(tmp_path, stage, "--config", f"mine/{stage}.yaml")
        assert trained.returncode == 0, trained.stderr[-3000:]
        held_out = json.loads((tmp_path / "outputs" / stage / "eval.json").read_text())
        assert held_out["n_pairs"] == 3 and held_out["split"] == "test: 10% held out of pairs.jsonl (seed 0)"
        assert held_out["carved_from"] == "pairs.jsonl"
        assert "on 3 pairs (test: 10% held out of pairs.jsonl (seed 0))" in trained.stdout + trained.stderr

    # PPO against that reward model on chat prompts: it reads them rendered, as it trained (no note)
    against_rm = _fitrl(tmp_path, "ppo", "--config", "mine/ppo.yaml", "--reward_adapter", "outputs/rm",
                        "--output_dir", "outputs/ppo_rm")  # fmt: skip
    assert against_rm.returncode == 0 and "note: the reward adapter" not in against_rm.stderr, against_rm.stderr[-3000:]

    refused = _fitrl(tmp_path, "ppo", "--config", "mine/ppo.yaml", "--reward_kind", "probability")
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr[-3000:]
    assert refused.stderr.startswith("error: ") and "a scalar reward model" in refused.stderr

    ppo = _fitrl(tmp_path, "ppo", "--config", "mine/ppo.yaml")
    assert ppo.returncode == 0, ppo.stderr[-3000:]
    out = tmp_path / "outputs" / "ppo"
    info = load_run_info(out)
    assert info["prompts"] == "29 prompts from 29 chats of data/prompts.jsonl"  # 3 of the 32 held out
    assert info["stop_at_eos"] is True  # a chat's turn ends at EOS (texts keep the blog's drawn lengths)
    assert ppo.stderr.count("has no pad token; padding with its EOS token") == 1
    # the chat in its template, read back (and by the reward model) as text without the special tokens
    assert "| system Answer kindly. user What is " in (out / "samples.md").read_text()
    rows = read_jsonl(out / "metrics.jsonl")
    assert len(rows) == 2 and rows[0]["env/reward_std"] > 0  # the scalar head's scores differ: a signal
    assert (out / "value_head.safetensors").is_file()
    evaluated = _fitrl(tmp_path, "eval", "--adapter_dir", "outputs/ppo", "--output_dir", "outputs/eval",
                       "--n_prompts", "8", "--batch_size", "8")  # fmt: skip
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    report = json.loads((tmp_path / "outputs" / "eval" / "eval.json").read_text())
    assert report["n_prompts"] == 3 and all(  # the 3 prompts held out of the file PPO trained on
        s["query"].startswith("system\nAnswer kindly.\nuser\n") for s in report["samples"]
    )

    grpo = _fitrl(tmp_path, "grpo", "--config", "mine/grpo.yaml")
    assert grpo.returncode == 0, grpo.stderr[-3000:]
    out = tmp_path / "outputs" / "grpo"
    info = load_run_info(out)
    assert info["problems"] == 29 and info["first_prompt_rendered"].endswith("<|im_start|>assistant\n")
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if "rewards/brevity/mean" in r]
    assert len(rows) == 2 and all(r["rewards/brevity/mean"] <= 0 for r in rows)
    assert all("rewards/accuracy_reward/mean" in r for r in rows)
    assert (out / "adapter_model.safetensors").is_file()
    assert list((out / "runs").rglob("events.out.tfevents.*"))  # the tracker's logs, in the output
