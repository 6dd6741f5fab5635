"""`python -m fitrl.doctor` and `bash pipeline.sh --check`: what would stop a run, one line each, in
seconds, before any model loads."""

from __future__ import annotations

import shutil
from collections import namedtuple
from pathlib import Path

import pytest

from fitrl import doctor, stages
from fitrl.architectures import architecture

from conftest import CONFIGS, bash_pipeline, demo_project


def _lines(capsys: pytest.CaptureFixture) -> list[str]:
    return capsys.readouterr().out.splitlines()


def _doctor(*args: str | Path) -> int:
    with pytest.raises(SystemExit) as stop:
        doctor.main([str(a) for a in args])
    return stop.value.code


def test_the_demo_profile_is_ready(tmp_path: Path, demo_assets: Path, capsys: pytest.CaptureFixture) -> None:
    project = demo_project(tmp_path, demo_assets, "mine")
    assert _doctor("--profile", project / "configs" / "mine", "--run_dir", tmp_path / "run") == 0
    lines = _lines(capsys)
    assert lines[-1] == "ready"
    assert not [line for line in lines if line.startswith("error")], lines
    # Each dataset split read once, by the first stage that reads it, with that stage's own loader
    data = [line.split(":")[0].removeprefix("ok    ") for line in lines if " data demo://" in line]
    assert data == [
        "sft data demo",  # reviews, train (PPO's prompts too)
        "rm data demo",  # preferences, train (DPO's too)
        "eval data demo",  # reviews, test (eval_dpo's too)
        "grpo data demo",
        "eval_gsm8k data demo",
    ], lines
    for name in stages.PLANNABLE:  # every training stage planned
        assert any(line.startswith(f"ok    {name}: memory plan: peak") for line in lines), (name, lines)
    assert any(line.startswith("ok    demo://lexicon: the demo's, in ") for line in lines)  # PPO's judge
    # The stages that read an earlier stage's output are not sent looking for it
    assert not any(str(tmp_path / "run") in line for line in lines[:-1] if "free at" not in line)


def test_ppo_on_the_runs_own_reward_model_is_ready_before_the_rm_stage_has_run(
    tmp_path: Path, demo_assets: Path, capsys: pytest.CaptureFixture
) -> None:
    import yaml

    project = demo_project(tmp_path, demo_assets, "mine")
    ppo = project / "configs" / "mine" / "ppo.yaml"
    ppo.write_text(yaml.safe_dump({**yaml.safe_load(ppo.read_text()), "reward_adapter": "outputs/mine/rm"}))
    assert _doctor("--profile", project / "configs" / "mine", "--run_dir", tmp_path / "run") == 0
    assert _lines(capsys)[-1] == "ready"
    assert _doctor("--profile", "demo", "--demo_assets", demo_assets) == 2  # not a doctor option: one line
    assert capsys.readouterr().err.splitlines() == ["error: unrecognized arguments: --demo_assets " + str(demo_assets)]


def test_what_would_stop_a_run_is_one_error_line_each(
    tmp_path: Path, demo_assets: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    no_config = tmp_path / "not-a-model"
    no_config.mkdir()
    overrides = {
        "sft": {"text_column": "body"},
        "ppo": {"reward_model": str(no_config), "reward_adapter": None},  # a classifier that is not one
        "rm": {"chosen_column": "better"},
        "grpo": {"model_name_or_path": "someone/not-downloaded-1b"},
    }
    project = demo_project(tmp_path, demo_assets, "mine", overrides)
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(2**40, 2**40 - 2**20, 2**20))
    assert _doctor("--profile", project / "configs" / "mine", "--run_dir", tmp_path / "run") == 2
    lines = _lines(capsys)
    errors = [line for line in lines if line.startswith("error")]
    expected = [
        "error: sft: dataset demo://reviews has no column 'body'",
        "error: rm: dataset demo://preferences has no column 'better'",
        f"error: {no_config} has no config.json; give a model directory",
        f"error: ppo: cannot plan for model {no_config}",  # the planner counts the reward model beside
        "error: someone/not-downloaded-1b is not in the hub cache and HF_HUB_OFFLINE=1",
        "error: 0.0 GiB free at",
    ]
    assert len(errors) == len(expected), "\n".join(errors)
    for line, start in zip(errors, expected, strict=True):
        assert line.startswith(start), (line, start)
    assert "note  grpo: no memory plan (cannot plan for model someone/not-downloaded-1b" in "\n".join(lines)
    assert lines[-1] == "6 problem(s) would stop this run: see the error lines above"


def test_a_stage_that_does_not_fit_the_card_is_an_error_with_a_move(capsys: pytest.CaptureFixture) -> None:
    stage = stages.get("sft")
    configs = stage.parse(["--config", str(CONFIGS / "neox20b-24gb" / "sft.yaml")])
    findings = doctor.Findings()
    doctor.check_plan(findings, stage, configs, architecture("EleutherAI/gpt-neox-20b"), 16 * doctor.GiB, True)
    (line,) = _lines(capsys)
    assert findings.errors == 1
    assert line.startswith("error: sft: memory plan: peak 23.47 GiB")
    assert "it does not fit the card named: try --" in line


def test_packages_are_read_against_the_pins(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    requirements = tmp_path / "requirements.txt"
    requirements.write_text("# pins\nno-such-package-here==1.0\ntorch==0.0.1  # a comment\n-e .\n")
    findings = doctor.Findings()
    doctor.check_packages(findings, requirements)
    lines = _lines(capsys)
    assert findings.errors == 1
    assert f"error: no-such-package-here is not installed; pip install -r {requirements} (or make setup)" in lines
    assert any(line.startswith("note  versions other than the pins") and "(pinned 0.0.1)" in line for line in lines)


@pytest.mark.slow
def test_pipeline_check_runs_the_doctor_for_its_profile(tmp_path: Path, demo_assets: Path) -> None:
    project = demo_project(tmp_path, demo_assets, "mine", stages=["sft", "merge", "rm", "ppo"])
    result = bash_pipeline(project, "--profile", "mine", "--check", timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.splitlines()[-1] == "ready"
    assert "ok    ppo: memory plan" in result.stdout
    assert not (project / "outputs").exists()  # it ran nothing and wrote nothing


def test_sft_on_a_column_of_chats_is_ready(tmp_path: Path, demo_assets: Path, capsys: pytest.CaptureFixture) -> None:
    """SFT takes chats (`messages`) as well as texts: the doctor reads them as the stage does, and still
    names a row that is not a chat."""
    import json

    chats = tmp_path / "chats.jsonl"
    turn = [{"role": "user", "content": "Any good?"}, {"role": "assistant", "content": "The acting was wonderful."}]
    chats.write_text("".join(json.dumps({"messages": turn}) + "\n" for _ in range(4)))
    project = demo_project(tmp_path, demo_assets, "mine", {"sft": {"dataset": str(chats), "text_column": "messages"}})
    assert _doctor("--profile", project / "configs" / "mine", "--run_dir", tmp_path / "run") == 0
    lines = _lines(capsys)
    assert f"ok    sft data {chats}: the first 4 rows read as the stage reads them" in lines, lines
    chats.write_text(chats.read_text() + json.dumps({"messages": [{"role": "user"}]}) + "\n")
    assert _doctor("--profile", project / "configs" / "mine", "--run_dir", tmp_path / "run") == 2
    assert any(line.startswith("error: sft: row 5 of column 'messages'") for line in _lines(capsys))
