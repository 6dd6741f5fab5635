"""The over-optimisation audit (`fitrl.reward.audit`) on hand-made rows: each gold reading beside the
batch its policy sampled next, the peak, the saved policy nearest it, its report line and plot."""

from __future__ import annotations

from pathlib import Path

from fitrl.reward.audit import (
    DETAILS_KEY,
    Reading,
    audit,
    figures,
    nearest_saved,
    peak_eval_dir,
    plot,
    readings,
    saved_policies,
)

# Step s's batch was sampled by the policy after s - 1 updates; its KL and mean reward.
ROWS = [
    {"step": 1, "kl": -1e-4, "reward": 0.0},  # the sampled KL estimate dips below 0 at the reference
    {"step": 2, "kl": 1.0, "reward": 0.5},
    {"step": 3, "kl": 4.0, "reward": 1.0},
    {"step": 4, "kl": 9.0, "reward": 1.5},
]


def test_each_reading_is_set_beside_the_batch_its_policy_sampled_next() -> None:
    found = readings(ROWS, [(0, 0.1), (2, 0.6), (4, 0.3)], "reward", "kl")
    # after 0 updates: step 1's batch (sqrt of a negative KL: 0); after 2: step 3's; the last: the last batch
    assert found == [Reading(0, 0.0, 0.0, 0.1), Reading(2, 2.0, 1.0, 0.6), Reading(4, 3.0, 1.5, 0.3)]
    assert readings([], [(0, 0.1)], "reward", "kl") == []


def test_the_audit_names_the_saved_policy_nearest_the_judges_peak_and_its_command() -> None:
    found = readings(ROWS, [(0, 0.1), (2, 0.6), (4, 0.3)], "reward", "kl")
    saved = {1: "out.checkpoints/step-1", 3: "out.checkpoints/step-3"}
    result = audit("judge", found, saved, 4, "out", "eval {adapter_dir}")
    assert result is not None and result.peak == Reading(2, 2.0, 1.0, 0.6)
    # steps 1 and 3 are as near the peak as each other: the earlier, read less far from the reference
    assert (result.nearest_step, result.nearest, result.nearest_is_output) == (1, "out.checkpoints/step-1", False)
    assert result.command == "eval out.checkpoints/step-1"
    # no checkpoint: the run's own output; a peak at the end: the output too
    assert nearest_saved(2, {}, 4, "out") == (4, "out")
    assert nearest_saved(4, {2: "c/step-2"}, 4, "out") == (4, "out")
    assert nearest_saved(3, {2: "c/step-2"}, 6, "out") == (2, "c/step-2")
    # equal peaks: the earliest, the least KL spent for the same gold score
    tied = [Reading(0, 0, 0, 0.1), Reading(2, 1, 1, 0.5), Reading(4, 2, 2, 0.5)]
    tie = audit("judge", tied, {}, 4, "out", "{adapter_dir}")
    assert tie is not None and tie.peak.step == 2
    assert audit("judge", found[:1], {}, 4, "out", "{adapter_dir}") is None  # one reading: nothing to compare


def test_the_report_line_and_the_plot(tmp_path: Path) -> None:
    found = readings(ROWS, [(0, 0.1), (2, 0.6), (4, 0.3)], "reward", "kl")
    result = audit(
        "judge's verdict", found, {2: "out.checkpoints/step-2"}, 4, "out", "fitrl eval --adapter_dir {adapter_dir}"
    )
    assert result is not None
    recorded = result.to_json()
    assert recorded["peak_step"] == 2 and recorded["final_gold"] == 0.3 and recorded["nearest_is_output"] is False
    assert figures({DETAILS_KEY: recorded}) == [
        "over-optimisation audit: the judge's verdict peaked at step 2 (0.6 at sqrt KL 2.00), 0.3 at step 4 at sqrt KL "
        "3.00; "
        "the saved policy nearest the peak, the checkpoint of step 2: `out.checkpoints/step-2`; evaluate it: "
        "`fitrl eval --adapter_dir out.checkpoints/step-2`"
    ]
    assert figures({}) == []
    never = audit("judge", [Reading(0, 0.0, 0, 0.5), Reading(2, 1.0, 1, 0.4)], {}, 2, "out", "{adapter_dir}")
    assert never is not None and figures({DETAILS_KEY: never.to_json()}) == [
        "over-optimisation audit: the judge never rose above its first reading (0.5, before any update); 0.4 at "
        "step 2 at sqrt KL 1.00"
    ]
    rising = audit(
        "judge", [Reading(0, 0.0, 0, 0.1), Reading(2, 1.0, 1, 0.4)], {1: "c/step-1"}, 2, "out", "{adapter_dir}"
    )
    assert rising is not None and figures({DETAILS_KEY: rising.to_json()}) == [
        "over-optimisation audit: the judge peaked at its last reading, step 2 (0.4 at sqrt KL 1.00): the run's own "
        "output `out` is the policy to keep"
    ]
    plot(result, ROWS, "reward", "kl", tmp_path / "audit.png")
    assert (tmp_path / "audit.png").read_bytes()[:4] == b"\x89PNG"


def test_without_a_kl_the_audit_reads_along_the_steps(tmp_path: Path) -> None:
    """GRPO with beta 0 logs no KL, and every other step (logging_steps 2): a reading takes the first
    batch logged after it."""
    rows = [{"step": 2, "reward": 0.2}, {"step": 4, "reward": 0.4}, {"step": 6, "reward": 0.6}]
    found = readings(rows, [(0, 0.1), (3, 0.5), (6, 0.4)], "reward", None)
    assert found == [Reading(0, None, 0.2, 0.1), Reading(3, None, 0.4, 0.5), Reading(6, None, 0.6, 0.4)]
    result = audit("held-out accuracy", found, {}, 6, "out", "fitrl eval_gsm8k --adapter {adapter_dir}")
    assert result is not None and result.to_json()["readings"][1] == {
        "step": 3,
        "sqrt_kl": None,
        "proxy": 0.4,
        "gold": 0.5,
    }
    assert figures({DETAILS_KEY: result.to_json()})[0].startswith(
        "over-optimisation audit: the held-out accuracy peaked at step 3 (0.5), 0.4 at step 6; the saved policy "
        "nearest the peak, the run's own output: `out`"
    )
    plot(result, rows, "reward", None, tmp_path / "steps.png")
    assert (tmp_path / "steps.png").is_file()


def test_the_saved_policies_are_this_runs_complete_checkpoints(tmp_path: Path) -> None:
    out = tmp_path / "ppo"
    for step, complete in [(20, True), (30, True), (40, False), (80, True)]:
        checkpoint = tmp_path / "ppo.checkpoints" / f"step-{step}"
        checkpoint.mkdir(parents=True)
        (checkpoint / "trainer_state.json").write_text("{}")
        if complete:
            (checkpoint / "run_config.yaml").write_text("{}")
    # step-30: an earlier run's (not every 20 steps); step-40: a save cut off; step-80: past this run's end
    assert saved_policies(str(out), "step", 20, 60) == {20: str(tmp_path / "ppo.checkpoints" / "step-20")}
    assert saved_policies(str(out), "step", 0, 60) == {}  # no save_steps: none of them is this run's
    assert peak_eval_dir(str(out)) == str(tmp_path / "ppo_peak_eval")
