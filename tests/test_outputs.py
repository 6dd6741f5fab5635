"""Nothing lost: where a stage may write, and what --overwrite_output_dir may replace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fitrl.config import UsageError
from fitrl.outputs import OUTPUT_MARKER, check_output_dir, staged_output_dir

from conftest import CONFIGS, run_main


def _precious(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "precious.txt").write_text("a user's file")
    return directory / "precious.txt"


@pytest.mark.parametrize("where", [".", "..", "home", "root"])
def test_cwd_its_parents_home_and_root_are_refused_even_with_overwrite(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    work = tmp_path / "home" / "work"
    keep = _precious(work)
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    target = {"home": str(tmp_path / "home"), "root": "/"}.get(where, where)
    code = run_main("merge.py", "--adapter_dir", work, "--output_dir", target, "--overwrite_output_dir", "true")
    assert code == 2
    assert keep.read_text() == "a user's file"
    with pytest.raises(UsageError, match="current, home or root directory"):
        check_output_dir(target, overwrite=True)


@pytest.mark.parametrize("relation", ["equal", "inside", "containing"])
def test_an_output_overlapping_an_input_is_refused(tmp_path: Path, relation: str) -> None:
    adapter = tmp_path / "runs" / "sft"
    keep = _precious(adapter)
    output = {"equal": adapter, "inside": adapter / "merged", "containing": tmp_path / "runs"}[relation]
    with pytest.raises(UsageError, match=f"overlaps the stage's input {adapter}"):
        check_output_dir(output, overwrite=True, inputs=[str(adapter), "some/hub-id", None])
    assert keep.is_file()


def test_merge_into_its_own_adapter_dir_keeps_the_adapter(tmp_path: Path) -> None:
    adapter = tmp_path / "sft"
    keep = _precious(adapter)
    code = run_main("merge.py", "--adapter_dir", adapter, "--output_dir", adapter, "--overwrite_output_dir", "true")
    assert code == 2 and keep.is_file()


def test_overwrite_refuses_a_directory_fitrl_did_not_write(tmp_path: Path) -> None:
    keep = _precious(tmp_path / "mine")
    with pytest.raises(UsageError, match="not written by fitrl"):
        check_output_dir(tmp_path / "mine", overwrite=True)
    with pytest.raises(UsageError, match="not written by fitrl"), staged_output_dir(tmp_path / "mine", True):
        pass
    assert keep.is_file()


def test_overwrite_replaces_what_fitrl_wrote_and_nothing_else(tmp_path: Path) -> None:
    out = tmp_path / "run"
    with staged_output_dir(out, stage="test") as staging:
        (staging / "metrics.jsonl").write_text("{}\n")
        (staging / "sub").mkdir()
        (staging / "sub" / "weights.bin").write_bytes(b"0")
    marker = json.loads((out / OUTPUT_MARKER).read_text())
    assert marker == {"fitrl_stage": "test", "files": ["metrics.jsonl", "sub/weights.bin"]}
    # a second run may replace its own output...
    with staged_output_dir(out, overwrite=True, stage="test") as staging:
        (staging / "metrics.jsonl").write_text('{"step": 1}\n')
    assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n' and not (out / "sub").exists()
    # ...but not a file a user put there since
    keep = _precious(out)
    with pytest.raises(UsageError, match="holds precious.txt, which fitrl did not write"):
        check_output_dir(out, overwrite=True)
    assert keep.is_file()


def test_smooth_is_a_centred_rolling_mean() -> None:
    from fitrl.outputs import smooth, smoothing_window

    assert smooth([0, 3, 6, 9, 12], window=3) == [1.5, 3.0, 6.0, 9.0, 10.5]
    assert smooth([5.0]) == [5.0]
    assert smoothing_window(10) == 3 and smoothing_window(120) == 13 and smoothing_window(40) == 5


def _fitrl_output(path: Path) -> Path:
    """An output directory fitrl wrote: one file, listed in its marker."""
    with staged_output_dir(path, stage="sft") as out:
        (out / "adapter_model.safetensors").write_text("weights")
    return path


@pytest.mark.parametrize("kind", ["link", "empty folder"])
def test_overwrite_keeps_a_users_link_or_empty_folder_inside_a_fitrl_output(tmp_path: Path, kind: str) -> None:
    out = _fitrl_output(tmp_path / "run")
    keep = _precious(tmp_path / "elsewhere")
    if kind == "link":
        (out / "mine").symlink_to(keep.parent, target_is_directory=True)
    else:
        (out / "mine").mkdir()
    with pytest.raises(UsageError, match="holds mine, which fitrl did not write"):
        check_output_dir(out, overwrite=True)
    assert (out / "mine").exists() and keep.read_text() == "a user's file"


def test_a_second_run_on_a_busy_output_is_refused_and_the_first_keeps_its_work(tmp_path: Path) -> None:
    out = tmp_path / "run"
    with staged_output_dir(out, stage="sft") as staging:
        (staging / "half.txt").write_text("the first run's work")
        with pytest.raises(UsageError, match="is in use by another run"):
            with staged_output_dir(out, stage="sft"):
                pass
        assert (staging / "half.txt").is_file()
    assert (out / "half.txt").read_text() == "the first run's work"


@pytest.mark.parametrize(
    ("stage", "loads", "note"),
    [
        ("sft", 'base = AutoModelForCausalLM.from_pretrained("/models/base")\n', None),
        ("rm", '    "/models/base", num_labels=1, pad_token_id=tokenizer.pad_token_id\n', "t + eos for t in texts"),
        ("ppo", 'base = AutoModelForCausalLM.from_pretrained("/models/base")\n', "value_head.safetensors"),
    ],
)
def test_a_model_card_loads_the_base_as_its_stage_record_says(
    tmp_path: Path, stage: str, loads: str, note: str | None
) -> None:
    """The card's snippet comes from the stage's record (`card_model_class`, `card_model_kwargs`,
    `card_notes`, `card_snippet`) and names the base as it resolved: a reward model loads as a one-label
    sequence classifier with the pad token and scores with EOS appended, PPO names its value head."""
    from fitrl.artifacts import MemoryFigures
    from fitrl.ending import TrainingEnd, model_card
    from fitrl.stages import get

    configs = get(stage).parse(["--config", str(CONFIGS / "demo" / f"{stage}.yaml")])
    end = TrainingEnd(
        stage=stage, configs=configs, model_path="/models/base", world_size=1, trained={},
        save_weights=lambda out: None, tokenizer=None, trainable_parameters=1, memory=MemoryFigures(),
        metrics=[], curves=[], plot="p.png", title="T", summary="s",
    )  # fmt: skip
    card = model_card(end, tmp_path)
    assert loads in card and card.startswith("---\nbase_model: /models/base\n"), card
    assert (note in card) if note else "value_head" not in card


def test_a_sample_with_control_characters_stays_in_its_table_cell() -> None:
    """A sampled response may hold `\\r`, a tab, a NUL or an escape: the samples table (and the report
    that embeds it) keeps one row per sample and one cell per column."""
    from fitrl.ending import samples_markdown

    response = "fine\rthen\x00a | b\x1b[2Kend\n"
    table = samples_markdown("PPO samples", {"first step": [{"query": "q", "response": response, "reward": 1.0}]})
    rows = [line for line in table.splitlines() if line.startswith("| q |")]
    assert rows == ["| q | fine then a \\| b [2Kend  | 1.000 |"], table


def test_an_evaluation_of_one_prompt_writes_json_every_reader_takes(tmp_path: Path) -> None:
    """The spread of one value is NaN, which Python's json writes and most readers refuse: null instead."""
    from fitrl.outputs import write_json

    write_json(tmp_path / "eval.json", {"reward_std": float("nan"), "rows": [{"kl": float("inf"), "n": 1}], "x": 0.5})
    assert json.loads((tmp_path / "eval.json").read_text()) == {
        "reward_std": None,
        "rows": [{"kl": None, "n": 1}],
        "x": 0.5,
    }
    assert "NaN" not in (tmp_path / "eval.json").read_text()


def test_a_refused_or_failed_run_leaves_no_new_parent_folders(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Refused before it starts (a missing model) or failing inside its staged output, a run removes the
    folders it made for its output, and never one that was there before."""
    out = tmp_path / "new" / "deeper" / "out"
    code = run_main("sft.py", "--config", CONFIGS / "demo" / "sft.yaml", "--output_dir", out,
                    "--model_name_or_path", tmp_path / "no-such-model")  # fmt: skip
    assert code == 2 and "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
    (tmp_path / "kept").mkdir()
    with pytest.raises(RuntimeError), staged_output_dir(tmp_path / "kept" / "made" / "out") as staging:
        (staging / "half.txt").write_text("half-written")
        raise RuntimeError("the stage failed")
    assert list(tmp_path.iterdir()) == [tmp_path / "kept"] and not any((tmp_path / "kept").iterdir())
