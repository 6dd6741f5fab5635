"""Preference pairs: the demo's are what it says they are, and a pair file a reward model or DPO cannot
learn from is refused by both stages with one line and exit 2, before a model loads."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from fitrl import demo
from fitrl.demo.corpus import opinion_polarity
from fitrl.outputs import read_jsonl

from conftest import CONFIGS, run_main

STAGES = [("rm.py", "rm.yaml"), ("dpo.py", "dpo.yaml")]


@pytest.mark.parametrize("split", ["train", "test"])
def test_demo_pairs_follow_the_rule_but_for_the_stated_share_of_swapped_labels(demo_assets: Path, split: str) -> None:
    pairs = read_jsonl(demo_assets / "preferences" / f"{split}.jsonl")
    agree = [opinion_polarity(p["chosen"]) > opinion_polarity(p["rejected"]) for p in pairs]
    # Exactly the stated share is swapped in each split, so 1 - FLIPPED_SHARE is the held-out ceiling.
    assert sum(not a for a in agree) == round(demo.FLIPPED_SHARE * len(pairs))
    assert demo.manifest(demo_assets)["pairs_flipped_share"] == demo.FLIPPED_SHARE
    for p in pairs:
        chosen, rejected = p["chosen"].split(". ", 1), p["rejected"].split(". ", 1)
        assert chosen[0] == rejected[0]  # both finish the prompt's sentence alike, then differ
        assert p["chosen"] != p["rejected"] and p["prompt"].strip()
        assert not re.search(r"was (not|never)\b", p["chosen"] + p["rejected"])  # no negated opinion


def _pairs(tmp_path: Path, rows: list[dict]) -> Path:
    folder = tmp_path / "pairs"
    folder.mkdir()
    for split in ("train", "test"):
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


GOOD = {"prompt": "The film", "chosen": " was wonderful.", "rejected": " was dull."}


@pytest.mark.parametrize(("script", "config"), STAGES)
@pytest.mark.parametrize(
    ("rows", "flags", "message"),
    [
        ([{"question": "a", "good": "b", "bad": "c"}], [], "has no column 'prompt'"),
        ([GOOD, {**GOOD, "rejected": " was wonderful. "}], [], "row 2: chosen and rejected are the same text"),
        ([GOOD, {**GOOD, "chosen": "  "}], [], "row 2: 'chosen' is empty"),
        ([{**GOOD, "prompt": None}], [], "row 1: 'prompt' is empty"),
        ([{**GOOD, "m": "big"}], ["--margin_column", "m"], "row 1: margin 'big' is not a number"),
        ([{**GOOD, "chosen": " was wonderful, and the acting was superb."}], ["--max_length", "8"], "every pair of"),
    ],
)
def test_a_pair_file_a_stage_cannot_learn_from_is_one_line_and_exit_2(
    tmp_path: Path,
    demo_assets: Path,
    capsys: pytest.CaptureFixture,
    script: str,
    config: str,
    rows: list[dict],
    flags: list[str],
    message: str,
) -> None:
    out = tmp_path / "out"
    code = run_main(
        script,
        *("--config", CONFIGS / "demo" / config, "--demo_assets", demo_assets, "--model_name_or_path", "demo://lm"),
        *("--dataset", _pairs(tmp_path, rows), "--output_dir", out, *flags),
    )
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and message in errors[0], (code, errors)
    assert not out.exists()


CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
USER = [{"role": "user", "content": "How was the film?"}]
CHOSEN = [{"role": "assistant", "content": "Wonderful."}]
REJECTED = [{"role": "assistant", "content": "Dull."}]


def _chat_tokenizer(demo_assets: Path):
    from fitrl.modeling import load_tokenizer

    tokenizer = load_tokenizer(str(demo_assets / "lm"))
    tokenizer.chat_template = CHATML
    return tokenizer


@pytest.mark.parametrize(
    ("row", "prompt_column"),
    [
        ({"prompt": USER, "chosen": CHOSEN, "rejected": REJECTED}, "prompt"),  # trl's explicit prompt
        ({"chosen": USER + CHOSEN, "rejected": USER + REJECTED}, None),  # trl's implicit prompt: whole chats
    ],
)
def test_conversational_pairs_are_rendered_with_the_chat_template_as_trl_renders_them(
    tmp_path: Path, demo_assets: Path, row: dict, prompt_column: str | None
) -> None:
    """rm and DPO used to refuse trl's conversational pairs ("'prompt' is not text (list)")."""
    from fitrl.tasks.preferences import PreferenceArguments, pair_texts, train_and_eval_pairs

    folder = _pairs(tmp_path, [row, row])
    args = PreferenceArguments(dataset=str(folder), prompt_column=prompt_column)
    train, held_out, dropped, chat = train_and_eval_pairs(args, _chat_tokenizer(demo_assets), str(demo_assets))
    cue = "<|im_start|>user\nHow was the film?<|im_end|>\n<|im_start|>assistant\n"
    assert train[0] == {"prompt": cue, "chosen": "Wonderful.<|im_end|>\n", "rejected": "Dull.<|im_end|>\n"}
    assert pair_texts(held_out[0]) == (cue + "Wonderful.<|im_end|>\n", cue + "Dull.<|im_end|>\n")
    assert dropped == 0 and chat


@pytest.mark.parametrize(
    ("row", "flags", "message"),
    [
        ({"prompt": USER + CHOSEN, "chosen": CHOSEN, "rejected": REJECTED}, ["--prompt_column", "prompt"],
         "row 1 of column 'prompt' ends with the assistant's turn"),
        ({"prompt": USER, "chosen": CHOSEN, "rejected": REJECTED}, ["--prompt_column", ""],
         "has a 'prompt' column beside chats, which prompt_column leaves out; set prompt_column: prompt"),
        ({"chosen": USER + CHOSEN, "rejected": REJECTED}, ["--prompt_column", ""],
         "row 1: chosen and rejected differ before their last turn; give the shared turns as 'prompt'"),
        ({"prompt": USER, "chosen": [{"role": "assistant"}], "rejected": REJECTED}, ["--prompt_column", "prompt"],
         "row 1 of column 'chosen' is not a chat"),
    ],
)  # fmt: skip
def test_a_conversational_pair_a_stage_cannot_learn_from_is_one_line(
    tmp_path: Path, demo_assets: Path, capsys: pytest.CaptureFixture, row: dict, flags: list[str], message: str
) -> None:
    out = tmp_path / "out"
    code = run_main(
        "rm.py",
        *("--config", CONFIGS / "demo" / "rm.yaml", "--demo_assets", demo_assets, "--model_name_or_path", "demo://lm"),
        *("--dataset", _pairs(tmp_path, [row]), "--output_dir", out, *flags),
    )
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and message in errors[0], (code, errors)
    assert not out.exists()


def test_the_reward_models_calibration_against_hand_computed_values() -> None:
    """sigmoid(reward difference) against how often the labelled text wins, each pair in both orders."""
    import math

    from fitrl.scripts.rm import calibration

    rows, error = calibration([{"chosen": 0.0, "rejected": 0.0}])  # 0.5 said, won once of twice: calibrated
    assert rows == [(0.5, 0.5, 2)] and error == 0.0
    rows, error = calibration([{"chosen": math.log(3), "rejected": 0.0}])  # 0.75 said, won every time
    assert [(round(q, 6), y, n) for q, y, n in rows] == [(0.25, 0.0, 1), (0.75, 1.0, 1)]
    assert error == pytest.approx(0.25)
