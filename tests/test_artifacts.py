"""The files one program writes and another reads (`fitrl.artifacts`): each layout defined once, written
in field order, read back field by field, a damaged file one line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fitrl.artifacts import (
    GSM8KScores,
    GSM8KSummary,
    GuardVerdict,
    MemoryFigures,
    MergeInfo,
    RMEval,
    RunInfo,
    written_by,
)
from fitrl.config import UsageError

SCORES = GSM8KScores(
    accuracy=0.25,
    pass_at_k=0.25,
    format_compliance=0.5,
    k=1,
    harness_strict_match=0.0,
    harness_flexible_extract=0.25,
    failures={"no_answer_block": 1, "unparsable_answer": 0, "wrong_number": 2},
)


def test_run_info_is_written_in_its_layout_and_read_back_equal(tmp_path: Path) -> None:
    info = RunInfo(
        stage="ppo",
        resolved_model_path="/models/lm",
        world_size=1,
        trainable_parameters=10,
        rank_weight_digests=["ab"],
        memory=MemoryFigures(13.5, device="cpu", peak_rss_mb=464.4),
        health={"kl": GuardVerdict(True, "ok"), "entropy": GuardVerdict(False, "fell", step=7)},
        guard_seconds=0.5,
        details={"n_prompts": 64, "prompts": "demo://reviews"},
    )
    info.write(tmp_path)
    written = json.loads((tmp_path / "run_info.json").read_text())
    assert list(written) == [
        "stage", "resolved_model_path", "world_size", "resumed_from", "trainable_parameters",
        "rank_weight_digests", "memory", "health", "guard_seconds", "n_prompts", "prompts",
    ]  # fmt: skip
    assert written["resumed_from"] is None  # a training run always says whether it resumed
    # The tensor peak is written even when unmeasured; a CUDA-only or CPU-only figure only where measured.
    assert written["memory"] == {
        "planned_peak_mb": 13.5,
        "device": "cpu",
        "measured_peak_mb": None,
        "peak_rss_mb": 464.4,
    }
    assert written["health"] == {
        "kl": {"passed": True, "saw": "ok"},
        "entropy": {"passed": False, "saw": "fell", "step": 7},
    }
    assert RunInfo.read(tmp_path) == info
    assert written_by(tmp_path) == "ppo" and written_by(tmp_path / "nothing") is None


def test_a_merge_run_info_reads_as_a_run_info_too(tmp_path: Path) -> None:
    merge = MergeInfo("merge", "demo://lm", "/m", "/a", "streaming", "float32", 12, 500.0, 20.0, 1.5)
    merge.write(tmp_path)
    assert "verify_max_logit_diff" not in json.loads((tmp_path / "run_info.json").read_text())  # not verified
    assert MergeInfo.read(tmp_path) == merge
    info = RunInfo.read(tmp_path)
    assert info.stage == "merge" and info.resolved_model_path is None and info.details["adapted_tensors"] == 12


def test_nested_and_flattened_fields_round_trip_and_a_spread_of_one_is_null(tmp_path: Path) -> None:
    summary = GSM8KSummary("m", None, "demo://arithmetic", "test", 0, 4, 0, 0, "greedy", SCORES, without_adapter=None)
    summary.write(tmp_path)
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written["accuracy"] == 0.25 and written["without_adapter"] is None and "rewards" not in written
    assert GSM8KSummary.read(tmp_path) == summary
    RMEval("test", 1, 1.0, 0.5, 0.5, 0.0, float("nan"), pairs=[{"chosen": 0.5, "rejected": 0.0}]).write(tmp_path)
    assert json.loads((tmp_path / "eval.json").read_text())["reward_std"] is None  # readable JSON, never NaN
    assert RMEval.read(tmp_path).reward_std is None and not math.isnan(RMEval.read(tmp_path).accuracy)


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ('{"stage": "pp', "is not JSON"),
        ("[1, 2]", "does not hold a JSON object"),
        ('{"world_size": 1}', "is not a RunInfo (it has no 'stage')"),
        ('{"stage": "ppo", "health": {"kl": {"passed": "yes", "saw": "x"}}}', "(health.kl.passed is not bool)"),
        ('{"stage": "ppo", "world_size": true}', "(world_size is not int)"),
        ('{"stage": "ppo", "memory": {"planned_peak_mb": "13"}}', "(memory.planned_peak_mb is not float)"),
    ],
)
def test_a_damaged_run_info_is_one_line_naming_the_file_and_the_field(
    tmp_path: Path, content: str, problem: str
) -> None:
    (tmp_path / "run_info.json").write_text(content)
    with pytest.raises(UsageError) as e:
        RunInfo.read(tmp_path)
    assert str(e.value).startswith(f"{tmp_path / 'run_info.json'} ") and problem in str(e.value)
    assert str(e.value).endswith("it is damaged: rerun the stage that wrote it (or delete the file)")
