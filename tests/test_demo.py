"""The embedded demo: shipped as the files its build made, checked against their digests, good enough to stand
in for the real job; and the build from the seed still runs and its models learn."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fitrl import demo
from fitrl.demo.corpus import opinion_polarity
from fitrl.outputs import read_jsonl
from fitrl.tasks.answer_format import FORMAT_TAGS, format_solution
from fitrl.tasks.sentiment import corpus_vocabulary, corpus_word_share


def test_assets_are_shipped_and_complete(demo_assets: Path) -> None:
    train = read_jsonl(demo_assets / "reviews" / "train.jsonl")
    test = read_jsonl(demo_assets / "reviews" / "test.jsonl")
    assert len(train) + len(test) >= 2000
    assert {r["label"] for r in train} == {0, 1}
    assert abs(sum(r["label"] for r in train) / len(train) - 0.5) < 0.05
    assert len({r["text"] for r in train + test}) > 0.95 * (len(train) + len(test)), "reviews should be varied"
    for name in ["lm", "reasoner", "classifier"]:
        assert (demo_assets / name / "config.json").is_file()
        assert (demo_assets / name / "model.safetensors").is_file()
        assert (demo_assets / name / "tokenizer.json").is_file()


def test_arithmetic_set_is_gsm8k_shaped_and_correct(demo_assets: Path) -> None:
    for split in ["train", "test"]:
        rows = read_jsonl(demo_assets / "arithmetic" / f"{split}.jsonl")
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


def test_reasoner_spells_each_format_tag_as_one_token_and_decodes_it_back(demo_assets: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    tok, lm_tok = (
        AutoTokenizer.from_pretrained(demo_assets / "reasoner"),
        AutoTokenizer.from_pretrained(demo_assets / "lm"),
    )
    for tag in FORMAT_TAGS:
        assert len(tok(tag, add_special_tokens=False).input_ids) == 1, tag
        assert len(lm_tok(tag, add_special_tokens=False).input_ids) >= 6, tag  # the LM's own BPE
    solution = format_solution("Zoe has 16 - 3 = <<16-3=13>>13 pencils left.\n#### 13")
    ids = tok(solution, add_special_tokens=False).input_ids
    assert len(ids) < len(lm_tok(solution, add_special_tokens=False).input_ids) / 2
    assert tok.decode(ids, skip_special_tokens=True) == solution  # the rewards read the decoded text
    assert AutoConfig.from_pretrained(demo_assets / "reasoner").vocab_size == len(tok)


def test_classifier_reaches_accuracy_bar_on_held_out_reviews(demo_assets: Path) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = demo_assets / "classifier"
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    assert model.config.id2label == {0: "NEGATIVE", 1: "POSITIVE"}
    test = read_jsonl(demo_assets / "reviews" / "test.jsonl")
    with torch.no_grad():
        enc = tok([r["text"] for r in test], padding=True, truncation=True, return_tensors="pt")
        pred = model(**enc).logits.argmax(-1)
    accuracy = (pred == torch.tensor([r["label"] for r in test])).float().mean().item()
    assert accuracy >= 0.90


def test_asset_uris_name_the_shipped_assets_or_a_build_of_ones_own(demo_assets: Path, tmp_path: Path) -> None:
    from fitrl.config import UsageError

    assert demo.resolve("demo://lm") == demo.resolve("demo://lm", "") == demo.SHIPPED / "lm"
    assert demo.resolve("demo://reviews", demo_assets) == demo_assets / "reviews"
    with pytest.raises(UsageError, match="unknown demo asset"):
        demo.resolve("demo://nope")
    with pytest.raises(UsageError, match=r"holds no demo assets .*python -m fitrl.demo build"):
        demo.resolve("demo://lm", tmp_path)


def test_the_shipped_files_match_their_recorded_digests_and_are_safe_formats(demo_assets: Path) -> None:
    """`SHA256SUMS` lists every shipped file: an edit, a missing or an extra file is caught here. Only
    formats that load without running code ship (no pickle)."""
    assert demo_assets == demo.SHIPPED
    assert demo.verify(demo_assets) == []
    names = set(demo.file_digests(demo_assets))
    assert {f"{m}/model.safetensors" for m in demo.MODELS} <= names
    assert {f"{d}/{split}.jsonl" for d in demo.DATASETS for split in ["train", "test"]} <= names
    assert {Path(n).suffix for n in names} <= {".jinja", ".json", ".jsonl", ".safetensors"}, names


def test_verify_names_an_edited_a_missing_and_an_extra_file(tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "assets"
    shutil.copytree(demo.SHIPPED, copy)
    (copy / "reviews" / "test.jsonl").write_text("{}\n")
    (copy / "classifier" / "tokenizer_config.json").unlink()
    (copy / "notes.txt").write_text("mine")
    assert demo.verify(copy) == [
        "classifier/tokenizer_config.json: missing",
        "notes.txt: not in SHA256SUMS",
        "reviews/test.jsonl: changed",
    ]


def _quick_build(out: Path) -> subprocess.CompletedProcess:
    """`python -m fitrl.demo build OUT` in a child, its models trained for a few steps only."""
    code = (
        "from fitrl.demo import models; from fitrl.demo.__main__ import main; "
        f"models.PRETRAIN_STEPS, models.REASONER_STEPS, models.CLASSIFIER_EPOCHS = {QUICK_STEPS}; "
        f"main(['build', {str(out)!r}])"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)


# The quick build's steps (pretraining, the reasoner's format SFT, classifier epochs). What it reached, on
# an Intel Xeon's own AVX-512 kernels and with ATen forced to its portable kernels
# (`ATEN_CPU_CAPABILITY=default`), one thread: LM test perplexity 3.448 on both (other model bytes on
# each), classifier 93.8% on both. The bars are the shipped assets' own (`test_demo_learns`: < 4.0) and
# 85% for a classifier over two balanced labels.
QUICK_STEPS = (120, 10, 1)
QUICK_PERPLEXITY_BAR = 4.0
QUICK_ACCURACY_BAR = 0.85


@pytest.mark.slow
def test_the_build_from_the_seed_runs_and_its_models_learn(tmp_path: Path) -> None:
    """The recipe that made the shipped assets still runs, and what it trains learns, whatever its bytes:
    the texts (pure Python draws) are the shipped ones exactly; the models are checked by their own
    figures, not their bytes, which differ from one CPU to another."""
    out = tmp_path / "built"
    result = _quick_build(out)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "built " in result.stdout
    built, shipped = demo.file_digests(out), demo.file_digests(demo.SHIPPED)
    texts = {name: digest for name, digest in shipped.items() if name.endswith(".jsonl")}
    assert texts and texts.items() <= built.items()
    assert built.keys() == shipped.keys()
    assert demo.verify(out) == []
    figures = demo.manifest(out)
    assert figures["lm_test_perplexity"] < QUICK_PERPLEXITY_BAR, figures
    assert figures["classifier_test_accuracy"] > QUICK_ACCURACY_BAR, figures
    # and a second build into the same folder is refused, the first untouched
    again = _quick_build(out)
    assert again.returncode == 2 and "is not an empty folder" in again.stderr, again.stderr[-2000:]
    assert demo.verify(out) == []


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


def test_lexicon_judge_agrees_with_the_generator_on_every_review(demo_assets: Path) -> None:
    rows = read_jsonl(demo_assets / "reviews" / "train.jsonl") + read_jsonl(demo_assets / "reviews" / "test.jsonl")
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


def test_a_classifier_judge_gives_verdicts_and_refuses_an_unknown_label(demo_assets: Path) -> None:
    from fitrl.config import UsageError
    from fitrl.tasks.sentiment import SentimentJudge

    judge = SentimentJudge("demo://classifier", "POSITIVE", str(demo_assets), torch.device("cpu"))
    texts = ["The acting was superb. I loved the ending. Highly recommended.", "The plot was awful. Avoid it."]
    assert judge(texts).tolist() == [1.0, -1.0]
    assert SentimentJudge("demo://lexicon", "POSITIVE", str(demo_assets), torch.device("cpu"))(texts).tolist() == [
        1,
        -1,
    ]
    with pytest.raises(UsageError, match="no label 'GOOD'"):
        SentimentJudge("demo://classifier", "GOOD", str(demo_assets), torch.device("cpu"))
