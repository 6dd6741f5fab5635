"""The run report (`fitrl.report`) read back from what stages wrote: its first page, and its HTML."""

from __future__ import annotations

from pathlib import Path

from fitrl import report, stages
from fitrl.artifacts import GuardVerdict, MemoryFigures, RunInfo
from fitrl.outputs import write_jsonl


def _stage_output(run_dir: Path, name: str, losses: list[float], health: dict, memory: dict) -> None:
    out = run_dir / stages.get(name).output_dir
    out.mkdir(parents=True)
    write_jsonl(out / "metrics.jsonl", [{"step": i + 1, "loss": v} for i, v in enumerate(losses)])
    verdicts = {k: GuardVerdict(**v) for k, v in health.items()}
    RunInfo(stage=name, health=verdicts, memory=MemoryFigures(**memory) if memory else None).write(out)


def test_the_first_page_sums_up_each_stage_and_the_html_renders_code(tmp_path: Path) -> None:
    ok = {"trainable": {"passed": True, "saw": "x"}, "gradients": {"passed": True, "saw": "y"}}
    fired = {**ok, "reward_hacking": {"passed": False, "saw": "fell", "step": 20}}
    _stage_output(tmp_path, "sft", [2.0, 1.5], ok, {"planned_peak_mb": 200.4, "measured_peak_mb": 189.0})
    _stage_output(tmp_path, "rm", [0.7, 0.5], fired, {"planned_peak_mb": 67.0})
    (tmp_path / "logs").mkdir()
    report.write_timings(tmp_path, {"sft": 52.3, "rm": 150.0})
    md_path, html_path = report.write(tmp_path, title="t")
    md = md_path.read_text()
    assert md.index("## summary") < md.index("## sft")  # the summary comes first
    assert "| sft | loss 2.000 -> 1.500 over 2 logged steps | all 2 passed | 52 s | 200 / 189 |" in md
    assert "| rm | loss 0.700 -> 0.500 over 2 logged steps | fired: reward_hacking (step 20) | 2.5 min | 67 / - |" in md
    assert "- peak memory planned 200 MiB, measured 189 MiB on ? (tensors)" in md
    page = html_path.read_text()
    assert f"Output: <code>{tmp_path / 'sft'}</code>" in page and "`" not in page


def test_a_guard_that_could_not_run_is_reported_as_not_run_never_as_passed(tmp_path: Path) -> None:
    """A run without a held-out split has no reward-hacking reading: the report says so rather than
    counting that guard among those that passed."""
    from fitrl.guards import Health

    health = Health()
    health.passed("trainable", "x")
    health.not_run("reward_hacking", "guard_heldout_every is 0")
    health.passed("reward_hacking", "a later pass does not turn it into a pass")
    assert health.seen["reward_hacking"]["passed"] is True  # ... unless the guard did run after all
    health.not_run("reward_hacking", "guard_heldout_every is 0")
    _stage_output(tmp_path, "dpo", [0.7, 0.5], {k: vars(v) for k, v in health.verdicts().items()}, {})
    md = report.write(tmp_path, title="t")[0].read_text()
    assert "| all 1 passed, 1 not run |" in md
    assert "- guards passed: trainable; not run: reward_hacking (guard_heldout_every is 0)" in md
