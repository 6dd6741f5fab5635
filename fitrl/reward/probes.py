"""The reward pre-flight (probes): before the first update, degenerate completions scored beside the reference
policy's own completions to the same prompts.

A reward a policy can satisfy without doing the task is found here in seconds rather than after a run
has exploited it. Each probe kind is built from the reference's completions (`probe_completions`):

- `empty`, `whitespace`: no answer at all;
- `echo`: the prompt repeated as the answer;
- `repeat`: the completion's first word repeated to the length of the longest completion;
- `cut_mid_word`, `cut_mid_sentence`: the completion cut inside its last word, or halfway through its
  last sentence;
- `ramble`: other prompts' completions strung together, twice the longest completion's length;
- `negated`: the completion's first `was`/`is`/`are`/`were` negated (for a reward model trained on
  preferences: can it read a negation?);
- `format_only`, `bare_number` (a task that asks for `<reasoning>` and `<answer>`): the completion's own
  answer in the format with no reasoning, or alone.

For each kind, the share of its probes that the reward scores above the median reference completion
(`Findings.shares`). The `reward_probes` guard fires (a warning; `strict_guards` stops the run) when
a kind's share is over `max_share`: the reward pays for that degenerate answer more often than not.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fitrl.guards import Health

GUARD = "reward_probes"
DETAILS_KEY = "reward_probes"  # where run_info.json holds what it found (`Findings.to_json`)
# The demo's PPO reward model, 16 prompts, seeds 0-2 on an AVX-512 CPU's kernels and seed 0 under AVX2:
# every kind's share at most 0.67 (a negated completion; a blank one 0.50-0.62): it prefers no opinion to
# a negative one. A reward paying for a degenerate answer scores it above the median nearly always (1.0).
MAX_SHARE = 0.8
_COPULA = re.compile(r"\b(was|is|are|were)\b")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_ANSWER = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.DOTALL)

Scorer = Callable[[list[int], list[str]], list[float]]  # (the prompts' indices, completions) -> scores


def _cut_mid_word(text: str) -> str:
    body = text.rstrip()
    last = body.split(" ")[-1]
    return body[: len(body) - len(last) + max(1, len(last) // 2)] if len(last) >= 2 else body[:-1]


def _cut_mid_sentence(text: str) -> str:
    sentences = _SENTENCE_END.split(text.strip())
    words = sentences[-1].split()
    kept = " ".join(words[: max(1, len(words) // 2)])
    lead = " " if text.startswith(" ") else ""
    return lead + " ".join([*sentences[:-1], kept])


def _negated(text: str) -> str | None:
    return _COPULA.sub(r"\1 not", text, count=1) if _COPULA.search(text) else None


def _answer(text: str) -> str:
    found = _ANSWER.search(text)
    return found.group(1) if found else (text.split() or ["0"])[-1]


def probe_completions(
    queries: Sequence[str], references: Sequence[str], negations: bool, answer_format: bool
) -> dict[str, list[tuple[int, str]]]:
    """Each probe kind's completions, each with the index of the prompt it answers."""
    n = len(references)
    longest = max([len(r.split()) for r in references] + [8])
    every = range(n)
    probes = {
        "empty": [(i, "") for i in every],
        "whitespace": [(i, " \n ") for i in every],
        "echo": [(i, " " + queries[i].strip()) for i in every],
        "repeat": [(i, " " + " ".join([(references[i].split() or ["the"])[0]] * longest)) for i in every],
        "cut_mid_word": [(i, _cut_mid_word(r)) for i, r in enumerate(references) if r.strip()],
        "cut_mid_sentence": [(i, _cut_mid_sentence(r)) for i, r in enumerate(references) if len(r.split()) >= 2],
        "ramble": [
            (i, " " + " ".join(" ".join(references[(i + k) % n] for k in range(1, n)).split()[: 2 * longest]))
            for i in every
        ],
    }
    if negations:
        probes["negated"] = [(i, t) for i, r in enumerate(references) if (t := _negated(r)) is not None]
    if answer_format:
        answers = [_answer(r) for r in references]
        probes["format_only"] = [
            (i, f"<reasoning>\n</reasoning>\n<answer>\n{a}\n</answer>") for i, a in enumerate(answers)
        ]
        probes["bare_number"] = [(i, a) for i, a in enumerate(answers)]
    return {kind: items for kind, items in probes.items() if items}


@dataclass
class Findings:
    """What the pre-flight saw: the median reference score, and per probe kind its count, mean score and
    the share of its probes above that median."""

    references: int
    median_reference: float
    shares: dict[str, float]
    means: dict[str, float]
    counts: dict[str, int]

    def to_json(self) -> dict[str, Any]:
        return {
            "references": self.references,
            "median_reference": round(self.median_reference, 4),
            "kinds": {
                k: {
                    "share_above_median": round(self.shares[k], 4),
                    "mean": round(self.means[k], 4),
                    "n": self.counts[k],
                }
                for k in self.shares
            },
        }

    def worst(self) -> tuple[str, float]:
        kind = max(self.shares, key=lambda k: self.shares[k])
        return kind, self.shares[kind]


def run_probes(score: Scorer, queries: Sequence[str], references: Sequence[str], negations: bool,
               answer_format: bool) -> Findings:  # fmt: skip
    """Score the reference completions and every probe (`probe_completions`) with `score`."""
    ref = score(list(range(len(references))), list(references))
    median = statistics.median(ref)
    shares, means, counts = {}, {}, {}
    for kind, items in probe_completions(queries, references, negations, answer_format).items():
        values = score([i for i, _ in items], [t for _, t in items])
        shares[kind] = sum(v > median for v in values) / len(values)
        means[kind] = statistics.fmean(values)
        counts[kind] = len(values)
    return Findings(len(references), median, shares, means, counts)


def check_probes(findings: Findings, health: Health, max_share: float = MAX_SHARE) -> None:
    """The `reward_probes` verdict: fired (before step 1) when a kind outscores the median reference more
    often than `max_share`, naming every such kind."""
    over = {k: s for k, s in findings.shares.items() if s > max_share}
    if over:
        named = ", ".join(f"{k} {s:.0%}" for k, s in sorted(over.items(), key=lambda kv: -kv[1]))
        health.failed(
            GUARD,
            f"degenerate completions outscore the median reference completion ({findings.median_reference:.3g}) "
            f"more often than {max_share:.0%}: {named}; the reward pays for them (see run_info.json reward_probes)",
            0,
        )
        return
    kind, share = findings.worst()
    health.passed(
        GUARD,
        f"no probe kind outscores the median reference more often than {max_share:.0%} (most: {kind} {share:.0%})",
    )


def figures(details: dict[str, Any]) -> list[str]:
    """The report's line for what a stage's pre-flight recorded in `run_info.json`'s details (none: [])."""
    found = details.get(DETAILS_KEY)
    if not found:
        return []
    shares = ", ".join(f"{k} {v['share_above_median']:.0%}" for k, v in found["kinds"].items())
    return [f"reward pre-flight, share above the median reference completion: {shares}"]
