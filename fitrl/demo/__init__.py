"""The embedded demo: everything the `demo` profile needs, built from a seed with no network.

`build(cache_dir)` makes, once, into `cache_dir/v<VERSION>-seed<seed>/`:

- `reviews/{train,test}.jsonl`: the project's own movie reviews (`text`, `label` 0=neg 1=pos);
- `arithmetic/{train,test}.jsonl`: word problems in GSM8K's format (`question`, `answer` ending
  in `#### <number>`);
- `preferences/{train,test}.jsonl`: preference pairs (`prompt`, `chosen`, `rejected`): a review's
  opening words and two continuations the corpus's own rule ranks, a stated share of labels swapped;
- `lm/`: a tiny GPT-NeoX (the gpt-neox-20b family) with a byte-level BPE tokenizer trained on those texts;
- `reasoner/`: that LM after an SFT on worked arithmetic in GRPO's `<reasoning>`/`<answer>`
  format, with a plain chat template and the format's tags as tokens: the GRPO demo's starting point;
- `classifier/`: a tiny DistilBERT sentiment classifier with its own WordPiece tokenizer, trained on
  the reviews: the demo's reward model (labels NEGATIVE / POSITIVE, like lvwerra/distilbert-imdb).

Stages name them `demo://lm`, `demo://reasoner`, `demo://classifier`, `demo://reviews`,
`demo://arithmetic`, `demo://preferences`; `resolve` is the one place that turns such a URI into a path. The texts are
made in `corpus`, the models trained in `models`.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fitrl.config import UsageError, help_field
from fitrl.demo.corpus import FLIPPED_SHARE, N_PAIRS, N_PROBLEMS, N_REVIEWS, make_pairs, make_problems, make_reviews
from fitrl.outputs import write_jsonl

VERSION = 7
DEFAULT_SEED = 1234
DEFAULT_CACHE_DIR = "~/.cache/fitrl/demo"
SCHEME = "demo://"
N_TEST_REVIEWS = 400
N_TEST_PROBLEMS = 300
N_TEST_PAIRS = 250
# The numeric path every build takes, whatever the CPU, so that the assets are the same bytes on any
# x86-64 machine with AVX2 (Intel since 2013, AMD since 2015): ATen's AVX2 kernels (an AVX-512 machine
# would dispatch to others, one without AVX2 can only take the slower portable ones), MKL's
# conditional-numerical-reproducibility COMPATIBLE branch, oneDNN capped at AVX2, and a fixed thread
# count. MKL's COMPATIBLE branch is its one that gives the same bits on Intel and AMD CPUs (SSE2,
# without the approximate reciprocal instructions, whose bits differ by vendor): its AVX2 branch holds
# on Intel CPUs only, and on an AMD one MKL takes its AUTO branch instead. Demo v6 pinned AVX2 and was
# the same bytes on two AMD boxes, other bytes on an Intel Xeon (whose GRPO gain fell under its bar).
# The price: MKL's slower kernels in the build only (the stages take the machine's own). The libraries
# read these once, as they start: a build runs in a child process.
BUILD_THREADS = 2
BUILD_ENV = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_CBWR": "COMPATIBLE",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "OMP_NUM_THREADS": str(BUILD_THREADS),
    "MKL_NUM_THREADS": str(BUILD_THREADS),
    # transformers writes `local_files_only` into a saved tokenizer's config as this says: without it,
    # the same build online and offline differed in one byte.
    "HF_HUB_OFFLINE": "1",
}
# `assets_digest` of the build of this VERSION with DEFAULT_SEED on that path: the tests check every new
# build against it. A change to the corpus, the models or their training changes it: bump VERSION and
# record the new digest.
ASSETS_DIGEST = "3e9bc7ff9652afb47a7acbbbec473223aaa7456f58511bb6a7019dc437d7f49c"
MODELS = ("lm", "reasoner", "classifier")
DATASETS = ("reviews", "arithmetic", "preferences")
MANIFEST = "manifest.json"

__all__ = [
    "ASSETS_DIGEST",
    "FLIPPED_SHARE",
    "N_PROBLEMS",
    "N_REVIEWS",
    "DemoArguments",
    "assets_digest",
    "build",
    "demo_dir",
    "is_demo_uri",
    "manifest",
    "resolve",
]


@dataclass
class DemoArguments:
    """Where the embedded demo lives: one setting, shared by every stage."""

    demo_cache_dir: str = help_field(
        DEFAULT_CACHE_DIR, "Where the embedded demo assets (demo://...) are built and cached."
    )


def is_demo_uri(name: str) -> bool:
    return name.startswith(SCHEME)


def demo_dir(cache_dir: str | Path, seed: int = DEFAULT_SEED) -> Path:
    return Path(cache_dir).expanduser() / f"v{VERSION}-seed{seed}"


def build(cache_dir: str | Path, seed: int = DEFAULT_SEED) -> Path:
    """Build the demo assets into `cache_dir` (or reuse them) and return their directory."""
    from filelock import FileLock

    root = demo_dir(cache_dir, seed)
    if (root / MANIFEST).is_file():
        return root
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"demo cache directory {root.parent} is not writable ({e.strerror})") from None
    # Several processes (accelerate launch) may ask at once: one builds, the others wait and reuse.
    with FileLock(str(root) + ".lock"):
        if (root / MANIFEST).is_file():
            return root
        staging = root.with_name(root.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        try:
            _build_in_child(staging, seed)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        shutil.rmtree(root, ignore_errors=True)
        staging.rename(root)
    return root


def _build_in_child(staging: Path, seed: int) -> None:
    """`python -m fitrl.demo STAGING SEED` under `BUILD_ENV`, its progress on this process's stderr."""
    import os
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "fitrl.demo", str(staging), str(seed)]
    result = subprocess.run(cmd, env={**os.environ, **BUILD_ENV})
    if result.returncode != 0:
        raise RuntimeError(f"building the demo assets failed (exit {result.returncode}); see the traceback above")


def assets_digest(root: str | Path) -> str:
    """One SHA-256 over every file of a build (its relative path and its bytes): equal builds, equal digests."""
    import hashlib

    root, total = Path(root), hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        total.update(str(path.relative_to(root)).encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return total.hexdigest()


def build_into(staging: Path, seed: int) -> None:
    """Build every asset into `staging` in this process (`python -m fitrl.demo` runs it under `BUILD_ENV`)."""
    import torch

    from fitrl.demo import models

    threads = torch.get_num_threads()
    torch.set_num_threads(BUILD_THREADS)  # bit-identical weights whatever the machine's core count
    try:
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
    finally:
        torch.set_num_threads(threads)
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


def manifest(cache_dir: str | Path, seed: int = DEFAULT_SEED) -> dict[str, Any]:
    return json.loads((build(cache_dir, seed) / MANIFEST).read_text())


def resolve(uri: str, cache_dir: str | Path, seed: int = DEFAULT_SEED) -> Path:
    """`demo://lm` -> the built asset's directory (building the demo on first use)."""
    name = uri.removeprefix(SCHEME).strip("/")
    if name not in MODELS + DATASETS:
        known = ", ".join(SCHEME + a for a in MODELS + DATASETS)
        raise UsageError(f"unknown demo asset {uri}; known: {known}")
    return build(cache_dir, seed) / name
