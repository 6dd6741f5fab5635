"""pipeline.sh: which stages a profile runs, in what order, and how it refuses a bad request."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import CONFIGS, ROOT


def _pipeline(**env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "pipeline.sh"], cwd=ROOT, env={**os.environ, "DRY_RUN": "1", **env}, capture_output=True, text=True
    )


def _scripts(stdout: str) -> list[str]:
    return [
        word.removeprefix("scripts/")
        for line in stdout.splitlines()
        for word in line.split()
        if word.startswith("scripts/")
    ]


@pytest.mark.parametrize(
    ("profile", "scripts"),
    [
        (
            "demo",
            [
                "plan_memory.py",
                "sft_lora.py",
                "merge_adapter.py",
                "plan_memory.py",
                "ppo_sentiment.py",
                "evaluate_sentiment.py",
                "plan_memory.py",
                "grpo_gsm8k.py",
                "evaluate_gsm8k.py",
            ],
        ),
        (
            "neox20b-24gb",
            [
                "plan_memory.py",
                "sft_lora.py",
                "merge_adapter.py",
                "plan_memory.py",
                "ppo_sentiment.py",
                "evaluate_sentiment.py",
            ],
        ),
        ("llama1b-16gb", ["plan_memory.py", "grpo_gsm8k.py", "evaluate_gsm8k.py"]),
    ],
)
def test_profile_runs_every_stage_it_has_a_config_for(profile: str, scripts: list[str]) -> None:
    """Every training stage is planned (scripts/plan_memory.py) before it runs."""
    result = _pipeline(PROFILE=profile)
    assert result.returncode == 0, result.stderr
    assert _scripts(result.stdout) == scripts
    for line in result.stdout.splitlines()[:-1]:
        assert f"--config configs/{profile}/" in line
        assert (CONFIGS.parent / line.split("--config ")[1].split()[0]).is_file()


def test_stages_picks_a_subset_and_launch_is_used_for_training() -> None:
    result = _pipeline(STAGES="grpo eval_gsm8k", LAUNCH="accelerate launch --multi_gpu --num_processes 2")
    assert result.returncode == 0, result.stderr
    plan, grpo, evaluation = result.stdout.splitlines()[:3]
    assert plan.startswith("python scripts/plan_memory.py --config configs/demo/grpo.yaml")
    assert grpo.startswith("accelerate launch --multi_gpu --num_processes 2 scripts/grpo_gsm8k.py")
    assert evaluation.startswith("python scripts/evaluate_gsm8k.py")


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"STAGES": "sft bogus"}, "error: unknown stage 'bogus'"),
        ({"PROFILE": "llama1b-16gb", "STAGES": "sft"}, "error: profile 'llama1b-16gb' has no stage 'sft'"),
        ({"PROFILE": "nope"}, "error: no profile configs/nope"),
        ({"PROFILE": "accelerate"}, "error: no profile configs/accelerate"),  # launcher configs, no stages
    ],
)
def test_bad_request_exits_2_with_one_line(env: dict[str, str], message: str) -> None:
    result = _pipeline(**env)
    assert result.returncode == 2
    assert result.stdout == "", "nothing may run before the request is checked"
    assert result.stderr.strip().splitlines()[-1].startswith(message)


@pytest.mark.slow
def test_a_failing_stage_under_accelerate_exits_2_with_one_line(tmp_path: Path) -> None:
    """accelerate reports any failed child as exit 1 with a traceback; the pipeline keeps the stage's own 2."""
    (tmp_path / "configs" / "broken").mkdir(parents=True)
    for name in ["pipeline.sh", "scripts"]:
        (tmp_path / name).symlink_to(ROOT / name)
    (tmp_path / "configs" / "broken" / "ppo.yaml").write_text(
        (CONFIGS / "demo" / "ppo.yaml").read_text().replace("outputs/demo/merged", str(tmp_path / "no-such-model"))
    )
    result = subprocess.run(
        ["bash", str(tmp_path / "pipeline.sh")],
        cwd=tmp_path,
        env={**os.environ, "PROFILE": "broken", "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "does not exist" in errors[0], result.stderr[-3000:]
    assert "Traceback" not in result.stderr
