"""The embedded demo: built from a seed, deterministic, and good enough to stand in for the real job."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest
import torch

from fitrl import demo
from fitrl.outputs import read_jsonl


def _digests(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_assets_are_built_and_complete(demo_root: Path) -> None:
    train = read_jsonl(demo_root / "reviews" / "train.jsonl")
    test = read_jsonl(demo_root / "reviews" / "test.jsonl")
    assert len(train) + len(test) >= 2000
    assert {r["label"] for r in train} == {0, 1}
    assert abs(sum(r["label"] for r in train) / len(train) - 0.5) < 0.05
    assert len({r["text"] for r in train + test}) > 0.95 * (len(train) + len(test)), "reviews should be varied"
    for name in ["lm", "reasoner", "classifier"]:
        assert (demo_root / name / "config.json").is_file()
        assert (demo_root / name / "model.safetensors").is_file()
        assert (demo_root / name / "tokenizer.json").is_file()


def test_arithmetic_set_is_gsm8k_shaped_and_correct(demo_root: Path) -> None:
    for split in ["train", "test"]:
        rows = read_jsonl(demo_root / "arithmetic" / f"{split}.jsonl")
        assert len(rows) >= 200
        for r in rows:
            assert set(r) == {"question", "answer"}
            gold = re.search(r"#### (-?\d+)$", r["answer"])
            assert gold, r["answer"]
            # The final number is the result of the last worked step, and every step's arithmetic holds.
            steps = re.findall(r"<<([\d+\-*]+)=(-?\d+)>>", r["answer"])
            assert steps and steps[-1][1] == gold.group(1)
            for expr, value in steps:
                a, op, b = re.fullmatch(r"(\d+)([+\-*])(\d+)", expr).groups()
                assert {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op] == int(value)


def test_classifier_reaches_accuracy_bar_on_held_out_reviews(demo_root: Path) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = demo_root / "classifier"
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    assert model.config.id2label == {0: "NEGATIVE", 1: "POSITIVE"}
    test = read_jsonl(demo_root / "reviews" / "test.jsonl")
    with torch.no_grad():
        enc = tok([r["text"] for r in test], padding=True, truncation=True, return_tensors="pt")
        pred = model(**enc).logits.argmax(-1)
    accuracy = (pred == torch.tensor([r["label"] for r in test])).float().mean().item()
    assert accuracy >= 0.90


def test_second_call_reuses_cache(demo_cache: Path, demo_root: Path) -> None:
    before = (demo_root / "manifest.json").stat().st_mtime_ns
    assert demo.build(demo_cache) == demo_root
    assert (demo_root / "manifest.json").stat().st_mtime_ns == before


def test_asset_uris(demo_cache: Path, demo_root: Path) -> None:
    assert demo.resolve("demo://lm", demo_cache) == demo_root / "lm"
    from fitrl.config import UsageError

    with pytest.raises(UsageError, match="unknown demo asset"):
        demo.resolve("demo://nope", demo_cache)


@pytest.mark.slow
def test_build_is_deterministic(demo_root: Path, tmp_path: Path) -> None:
    """A second build from the same seed elsewhere gives byte-identical files."""
    again = demo.build(tmp_path)
    assert _digests(again) == _digests(demo_root)
