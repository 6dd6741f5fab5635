"""The recipe that made the shipped demo assets: `build(out_dir, seed)`, or `python -m fitrl.demo build DIR`.

The texts are made in `corpus`, the models trained in `models`, on this machine's own kernels and
threads: another CPU builds other bytes from the same seed (and models that learn alike), which is
why the demo ships the files this made rather than building them at first use.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from fitrl.config import UsageError
from fitrl.demo import MANIFEST, SUMS, file_digests
from fitrl.demo.corpus import FLIPPED_SHARE, N_PAIRS, make_pairs, make_problems, make_reviews
from fitrl.outputs import write_jsonl

VERSION = 7
DEFAULT_SEED = 1234
N_TEST_REVIEWS = 400
N_TEST_PROBLEMS = 300
N_TEST_PAIRS = 250


def build(out_dir: str | Path, seed: int = DEFAULT_SEED) -> Path:
    """Build a fresh set of demo assets into `out_dir` (new or empty) and return it.

    Everything is written into `<out_dir>.partial` first and renamed at the end: a failed or interrupted
    build leaves nothing behind that looks complete.
    """
    out = Path(out_dir).expanduser().absolute()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"{out} exists and is not an empty folder; give a new folder for the demo assets")
    staging = out.with_name(out.name + ".partial")
    if staging.exists():
        raise UsageError(f"{staging} exists (an earlier build that stopped?); remove it or give another folder")
    try:
        build_into(staging, seed)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if out.exists():
        out.rmdir()
    staging.rename(out)
    return out


def build_into(staging: Path, seed: int) -> None:
    """Build every asset into `staging`, then its `manifest.json` and `SHA256SUMS`."""
    from fitrl.demo import models

    reviews = make_reviews(seed)
    train, test = reviews[N_TEST_REVIEWS:], reviews[:N_TEST_REVIEWS]
    problems = make_problems(seed)
    train_problems, test_problems = problems[N_TEST_PROBLEMS:], problems[:N_TEST_PROBLEMS]
    write_jsonl(staging / "reviews" / "train.jsonl", train)
    write_jsonl(staging / "reviews" / "test.jsonl", test)
    write_jsonl(staging / "arithmetic" / "train.jsonl", train_problems)
    write_jsonl(staging / "arithmetic" / "test.jsonl", test_problems)
    # Each split has exactly its stated share of swapped labels: the held-out ceiling is 1 - FLIPPED_SHARE.
    write_jsonl(staging / "preferences" / "train.jsonl", make_pairs(seed, N_PAIRS - N_TEST_PAIRS))
    write_jsonl(staging / "preferences" / "test.jsonl", make_pairs(seed + 1, N_TEST_PAIRS))

    def text(row: dict[str, Any]) -> str:
        return row["text"] if "text" in row else row["question"] + "\n" + row["answer"]

    tok = models.train_lm_tokenizer([text(r) for r in reviews + problems], staging / "lm")
    # Pretrain on half the training reviews and problems: SFT then adapts it to the other half, and
    # the test splits stay unseen (held-out perplexity, PPO's evaluation prompts, GRPO's accuracy).
    half = [text(r) for r in train[: len(train) // 2] + train_problems[: len(train_problems) // 2]]
    perplexity = models.build_lm(tok, half, [text(r) for r in test], staging / "lm", seed)
    # The format SFT uses every training problem: the test split stays unseen for evaluation.
    models.build_reasoner(staging / "lm", train_problems, staging / "reasoner", seed)
    accuracy = models.build_classifier(train, test, staging / "classifier", seed)
    info = {
        "version": VERSION,
        "seed": seed,
        "lm_test_perplexity": round(perplexity, 3),
        "classifier_test_accuracy": round(accuracy, 4),
        "n_reviews": len(reviews),
        "n_problems": len(problems),
        "n_pairs": N_PAIRS,
        "pairs_flipped_share": FLIPPED_SHARE,
    }
    (staging / MANIFEST).write_text(json.dumps(info, indent=2) + "\n")
    write_sums(staging)


def write_sums(root: Path) -> None:
    """`SHA256SUMS` for every file under `root`, in `sha256sum`'s own format."""
    lines = [f"{digest}  {name}\n" for name, digest in file_digests(root).items()]
    (root / SUMS).write_text("".join(lines))
