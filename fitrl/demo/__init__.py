"""The embedded demo: everything the `demo` profile needs, shipped inside fitrl (`fitrl/demo/assets/`).

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
`demo://arithmetic`, `demo://preferences`; `resolve` is the one place that turns such a URI into a path.

The shipped files were made by `python -m fitrl.demo build DIR` (`fitrl.demo.build`, from
`DEFAULT_SEED`) and are committed as they came out, with their SHA-256 digests in `SHA256SUMS`: a
build from the seed on another CPU gives other bytes (floating-point training is not bit-identical
across CPU vendors and instruction sets), so the demo ships its bytes rather than rebuilding them.
`demo_assets` points the stages at another build instead.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fitrl.config import UsageError, help_field
from fitrl.demo.corpus import FLIPPED_SHARE, N_PROBLEMS, N_REVIEWS

SHIPPED = Path(__file__).resolve().parent / "assets"
SCHEME = "demo://"
MODELS = ("lm", "reasoner", "classifier")
DATASETS = ("reviews", "arithmetic", "preferences")
MANIFEST = "manifest.json"  # the build's own figures (perplexity, accuracy, sizes)
SUMS = "SHA256SUMS"  # `sha256sum` lines for every other file: `sha256sum -c SHA256SUMS` checks them too

__all__ = [
    "FLIPPED_SHARE",
    "N_PROBLEMS",
    "N_REVIEWS",
    "SHIPPED",
    "DemoArguments",
    "assets_root",
    "file_digests",
    "is_demo_uri",
    "manifest",
    "resolve",
    "verify",
]


@dataclass
class DemoArguments:
    """Where the embedded demo's assets are read from: one setting, shared by every stage."""

    demo_assets: str = help_field(
        "",
        "Where the demo assets (demo://...) are read from: empty for the ones shipped inside fitrl, or a "
        "folder that `python -m fitrl.demo build DIR` wrote.",
    )


def is_demo_uri(name: str) -> bool:
    return name.startswith(SCHEME)


def assets_root(demo_assets: str | Path = "") -> Path:
    """The folder every demo asset lives in: `demo_assets`, or the shipped one when it is empty."""
    return Path(demo_assets).expanduser() if str(demo_assets) else SHIPPED


def manifest(demo_assets: str | Path = "") -> dict[str, Any]:
    """The build's own figures (`manifest.json`); a folder without one is no set of demo assets."""
    root = assets_root(demo_assets)
    path = root / MANIFEST
    if not path.is_file():
        raise UsageError(
            f"{root} holds no demo assets (no {MANIFEST}); build a set with `python -m fitrl.demo build {root}`, "
            "or leave demo_assets empty for the shipped ones"
        )
    return json.loads(path.read_text())


def resolve(uri: str, demo_assets: str | Path = "") -> Path:
    """`demo://lm` -> the asset's directory in the shipped assets (or those `demo_assets` names)."""
    name = uri.removeprefix(SCHEME).strip("/")
    if name not in MODELS + DATASETS:
        known = ", ".join(SCHEME + a for a in MODELS + DATASETS)
        raise UsageError(f"unknown demo asset {uri}; known: {known}")
    manifest(demo_assets)  # one line naming the folder where it is no build
    return assets_root(demo_assets) / name


def file_digests(root: str | Path) -> dict[str, str]:
    """SHA-256 of every file under `root` but the digest list itself, by its path relative to `root`."""
    root = Path(root)
    return {
        path.relative_to(root).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
        if path.is_file() and path.name != SUMS
    }


def verify(root: str | Path = SHIPPED) -> list[str]:
    """What differs between the files under `root` and its `SHA256SUMS`: one line each, none when they agree."""
    root = Path(root)
    recorded = {}
    for line in (root / SUMS).read_text().splitlines():
        digest, name = line.split(maxsplit=1)
        recorded[name.lstrip("*")] = digest
    found = file_digests(root)
    problems = [f"{name}: missing" for name in sorted(recorded.keys() - found.keys())]
    problems += [f"{name}: not in {SUMS}" for name in sorted(found.keys() - recorded.keys())]
    problems += [f"{name}: changed" for name in sorted(recorded.keys() & found.keys()) if recorded[name] != found[name]]
    return problems
