"""The embedded demo: built from a seed, deterministic, and good enough to stand in for the real job."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest
import torch

from fitrl import demo
from fitrl.answer_format import FORMAT_TAGS, format_solution
from fitrl.demo.corpus import opinion_polarity
from fitrl.outputs import read_jsonl
from fitrl.sentiment import corpus_vocabulary, corpus_word_share


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
        # an easy level (one step, numbers up to 5 in, up to 10 out) that a tiny model can start on
        easy = [
            r for r in rows if r["answer"].count("<<") == 1 and max(map(int, re.findall(r"\d+", r["answer"]))) <= 10
        ]
        assert 0.35 < len(easy) / len(rows) < 0.65


def test_reasoner_spells_each_format_tag_as_one_token_and_decodes_it_back(demo_root: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    tok, lm_tok = AutoTokenizer.from_pretrained(demo_root / "reasoner"), AutoTokenizer.from_pretrained(demo_root / "lm")
    for tag in FORMAT_TAGS:
        assert len(tok(tag, add_special_tokens=False).input_ids) == 1, tag
        assert len(lm_tok(tag, add_special_tokens=False).input_ids) >= 6, tag  # the LM's own BPE
    solution = format_solution("Zoe has 16 - 3 = <<16-3=13>>13 pencils left.\n#### 13")
    ids = tok(solution, add_special_tokens=False).input_ids
    assert len(ids) < len(lm_tok(solution, add_special_tokens=False).input_ids) / 2
    assert tok.decode(ids, skip_special_tokens=True) == solution  # the rewards read the decoded text
    assert AutoConfig.from_pretrained(demo_root / "reasoner").vocab_size == len(tok)


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


def test_the_built_assets_are_the_recorded_bytes(demo_root: Path) -> None:
    """The session's build is the same bytes as the build recorded in `fitrl.demo.ASSETS_DIGEST`: a build
    that drifts (another CPU's code path, a library's kernel, a changed corpus) is caught here."""
    assert demo.assets_digest(demo_root) == demo.ASSETS_DIGEST, _digests(demo_root)


def _quick_build(out: Path, **env: str) -> Path:
    """The demo's build entry (`python -m fitrl.demo`) in a child on the pinned path, its models trained
    for a few steps: the same code path, the same random draws and threads as the full build."""
    import os
    import subprocess
    import sys

    code = (
        "import sys, runpy; from fitrl.demo import models; "
        "models.PRETRAIN_STEPS, models.REASONER_STEPS, models.CLASSIFIER_EPOCHS = 30, 10, 1; "
        f"sys.argv = ['fitrl.demo', {str(out)!r}, '{demo.DEFAULT_SEED}']; "
        "runpy.run_module('fitrl.demo', run_name='__main__')"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env, **demo.BUILD_ENV}, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return out


# `assets_digest` of `_quick_build` on the pinned path (recorded with the machine's own kernels; update
# it beside `demo.ASSETS_DIGEST` when the build changes).
QUICK_BUILD_DIGEST = "d3bcbb539999ad84975936f4498cb0b48f54bc0bb4e95966fdf7f0f8ce2ca4af"


@pytest.mark.slow
def test_the_pinned_build_is_the_same_bytes_whatever_the_cpu_path(demo_root: Path, tmp_path: Path) -> None:
    """A build where the machine would take another code path gives the recorded bytes: ATen's portable
    kernels, MKL's AVX2 branch (which an Intel CPU takes and an AMD one does not) and one thread each give
    other bits than the pinned path (measured on the demo LM), as another CPU's dispatch would. The pinned
    path (`demo.BUILD_ENV`: ATen's AVX2 kernels, MKL's COMPATIBLE branch, two threads) overrides them all."""
    built = _quick_build(tmp_path / "a", ATEN_CPU_CAPABILITY="default", MKL_CBWR="AVX2", OMP_NUM_THREADS="1")
    assert demo.assets_digest(built) == QUICK_BUILD_DIGEST, _digests(built)
    # and the texts, which no step count touches, are the session's build's
    data = {k: v for k, v in _digests(demo_root).items() if k.endswith(".jsonl")}
    assert data and data.items() <= _digests(built).items()


@pytest.mark.parametrize(
    ("text", "polarity"),
    [
        ("The acting was truly superb.", 1),
        ("The acting was not at all dull.", 1),  # a negated complaint is praise
        ("The ending was never clever.", -1),
        ("The plot was not. Dull", -1),  # a negation stops at its sentence
        ("I loved the cast. I hated the pacing.", 0),
        ("I could not stand the script. Skip this one.", -2),
        ("It stayed with me for days.", 1),
        ("The Silent Harbor is a drama directed by Anna Keller.", 0),
        (" in@hef not[ performance2 givesad", 0),  # word salad says nothing to the judge
    ],
)
def test_lexicon_judge_reads_opinions_by_hand(text: str, polarity: int) -> None:
    assert opinion_polarity(text) == polarity


def test_lexicon_judge_agrees_with_the_generator_on_every_review(demo_root: Path) -> None:
    rows = read_jsonl(demo_root / "reviews" / "train.jsonl") + read_jsonl(demo_root / "reviews" / "test.jsonl")
    assert all((opinion_polarity(r["text"]) > 0) == bool(r["label"]) for r in rows)


def test_corpus_word_share_counts_words_only() -> None:
    vocabulary = corpus_vocabulary(["The acting was dull.", "It runs 90 minutes."])
    assert vocabulary == {"the", "acting", "was", "dull", "it", "runs", "minutes"}
    # 4 words: "acting", "was" in the corpus, "xq", "zzz" not; digits and punctuation are no words
    assert corpus_word_share(["", "The"], [" Acting was xq, 42", " zzz!"], vocabulary) == 0.5
    assert corpus_word_share(["It runs"], [" 42 ..."], vocabulary) == 1.0
    # a word the query began is read whole ("act" + "ing"); one cut by the length limit is left out,
    # unless it is all the response wrote
    assert corpus_word_share(["The act"], ["ing was du"], vocabulary) == 1.0
    assert corpus_word_share(["The act"], ["ing was xq"], vocabulary) == 1.0
    assert corpus_word_share(["The act"], ["ing xq was."], vocabulary) == 2 / 3
    assert corpus_word_share(["The"], [" xq"], vocabulary) == 0.0


def test_a_classifier_judge_gives_verdicts_and_refuses_an_unknown_label(demo_cache: Path) -> None:
    from fitrl.config import UsageError
    from fitrl.sentiment import SentimentJudge

    judge = SentimentJudge("demo://classifier", "POSITIVE", str(demo_cache), torch.device("cpu"))
    texts = ["The acting was superb. I loved the ending. Highly recommended.", "The plot was awful. Avoid it."]
    assert judge(texts).tolist() == [1.0, -1.0]
    assert SentimentJudge("demo://lexicon", "POSITIVE", str(demo_cache), torch.device("cpu"))(texts).tolist() == [1, -1]
    with pytest.raises(UsageError, match="no label 'GOOD'"):
        SentimentJudge("demo://classifier", "GOOD", str(demo_cache), torch.device("cpu"))
