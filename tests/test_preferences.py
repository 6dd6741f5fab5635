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
