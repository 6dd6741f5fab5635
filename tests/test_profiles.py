"""Every shipped profile runs through `pipeline.sh` as written, with tiny stand-ins for its hub ids.

A setting only a real profile uses (tensorboard in PPO, an 8-bit optimizer, fp16 on an 8-bit base, a
786-token completion limit, a judge model) is exercised here: the profile's YAML files are copied
unchanged except that each hub id becomes a local stand-in (`STAND_INS`) and each stage stops after
two steps (PPO and GRPO, whose rollouts take most of their time, after one), an evaluation after one
batch (`SHORT`). A step of SFT, the reward model or DPO accumulates two micro-batches, and PPO makes
one pass over its batch: the same code as the profile's 8-32 micro-batches and 4 passes, repeated
fewer times. A hub id without a stand-in fails the test, so a new profile gets one. The demo profile
runs whole in `tests/test_demo_learns.py`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from fitrl.stages import get

from conftest import CONFIGS, ROOT, bash_pipeline

SHIPPED = sorted(p.name for p in CONFIGS.iterdir() if p.is_dir() and p.name not in ("accelerate", "demo"))

# Each hub id a profile names, and what stands in for it: a demo asset, or the tiny Llama built below.
STAND_INS = {
    "EleutherAI/gpt-neox-20b": "demo://lm",
    "stanfordnlp/imdb": "demo://reviews",
    "lvwerra/distilbert-imdb": "demo://classifier",
    "siebert/sentiment-roberta-large-english": "demo://classifier",
    "meta-llama/Llama-3.2-1B-Instruct": "{tiny_llama}",
    "openai/gsm8k": "demo://arithmetic",
    "Anthropic/hh-rlhf": "demo://preferences",
    "Dahoas/rm-static": "demo://preferences",
    "Qwen/Qwen2.5-0.5B-Instruct": "{tiny_llama}",
}
# Per stage, what makes it short: two steps (PPO and GRPO one), one batch of an evaluation.
SHORT = {
    "sft": {"max_steps": 2, "gradient_accumulation_steps": 2},
    "rm": {"max_steps": 2, "max_eval_samples": 8, "gradient_accumulation_steps": 2},
    "ppo": {"steps": 1, "ppo_epochs": 1},
    "dpo": {"max_steps": 2, "max_eval_samples": 8, "gradient_accumulation_steps": 2},
    "grpo": {"max_steps": 1},
    "eval": {"n_prompts": 8},
    "eval_dpo": {"n_prompts": 8},
    "eval_gsm8k": {"max_samples": 8},
}
# What one profile runs at its worst case another need not: llama1b-16gb generates GRPO's and its
# evaluation's 786 tokens; qwen0.5b-16gb's, the same code at 512, stop at 64 so that the suite stays
# inside CI's 20 minutes (the planner test plans its GRPO at 512).
SHORTER = {"qwen0.5b-16gb": {"grpo": {"max_completion_length": 64}, "eval_gsm8k": {"max_new_tokens": 64}}}
HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory, demo_assets: Path) -> Path:
    """A Llama-architecture model of a few hundred thousand parameters, with the demo reasoner's tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = AutoTokenizer.from_pretrained(demo_assets / "reasoner")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _stand_in(value: object, tiny_llama: Path) -> object:
    if isinstance(value, str) and value in STAND_INS:
        return STAND_INS[value].format(tiny_llama=tiny_llama)
    if isinstance(value, list):
        return [_stand_in(v, tiny_llama) for v in value]
    return value


def profile_project(root: Path, profile: str, demo_assets: Path, tiny_llama: Path) -> Path:
    """A project directory at `root` with the real scripts, whose one profile is `profile` with stand-ins."""
    for name in ["pipeline.sh"]:
        (root / name).symlink_to(ROOT / name)
    (root / "configs").mkdir()
    (root / "configs" / "accelerate").symlink_to(CONFIGS / "accelerate")
    (root / "configs" / profile).mkdir()
    for config in sorted((CONFIGS / profile).glob("*.yaml")):
        values = {k: _stand_in(v, tiny_llama) for k, v in yaml.safe_load(config.read_text()).items()}
        unknown = [v for v in values.values() if isinstance(v, str) and HUB_ID.match(v) and not Path(v).exists()]
        assert not unknown, f"{config}: add a stand-in for {unknown} to STAND_INS"
        values.update(SHORT.get(config.stem, {}), demo_assets=str(demo_assets))
        values.update(SHORTER.get(profile, {}).get(config.stem, {}))
        (root / "configs" / profile / config.name).write_text(yaml.safe_dump(values, sort_keys=False))
    return root


@pytest.mark.slow
@pytest.mark.parametrize("profile", SHIPPED)
def test_a_shipped_profile_runs_through_the_pipeline(
    profile: str, tmp_path: Path, demo_assets: Path, tiny_llama: Path
) -> None:
    project = profile_project(tmp_path, profile, demo_assets, tiny_llama)
    result = bash_pipeline(project, "--profile", profile, timeout=1200)
    assert result.returncode == 0, result.stderr[-4000:]
    run_dir = project / "outputs" / profile
    stages = sorted(p.stem for p in (CONFIGS / profile).glob("*.yaml"))
    for stage in stages:
        assert (run_dir / get(stage).output_dir / "run_config.yaml").is_file(), stage
    timings = json.loads((run_dir / "logs" / "timings.json").read_text())
    assert sorted(timings) == stages
    assert (run_dir / "report.md").is_file()
    for stage in stages:  # the profile's own tracker wrote its logs into the output
        settings = yaml.safe_load((run_dir / get(stage).output_dir / "run_config.yaml").read_text())
        if settings.get("report_to") == "tensorboard":
            assert list((run_dir / get(stage).output_dir / "runs").rglob("events.out.tfevents.*")), stage
