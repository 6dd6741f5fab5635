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

One blind spot is paired rather than shared: where a completion is cut. Each reference completion that
ends mid-sentence after a sentence end (as a run whose responses stop at a drawn length writes them) is
scored beside itself ended at that sentence end (`Cut`). A reward that reads what a text says moves
little between the two; one trained only on whole texts can move as much as between two different
completions, and a run feeding it cut responses is then rewarded for where the cut fell. The guard
fires on the `cut_mid_sentence` swing when most completions end mid-sentence and the median move is
over `MAX_CUT_SWING` of the median difference between two reference completions.
"""

from __future__ import annotations

import math
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
# The cut swing, measured with the demo's PPO prompts cut at a length (seeds 0-2; seed 2 also under AVX2,
# the same): its reward model (trained on whole texts) 0.63-0.84, the sentiment classifier (a reader of
# what a text says) 0.02-0.13. The bar sits between the two ranges.
MAX_CUT_SWING = 0.4
CUT_KIND = "cut_mid_sentence"
_COPULA = re.compile(r"\b(was|is|are|were)\b")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_LAST_END = re.compile(r"^(.*[.!?])\s+[^.!?]*\w[^.!?]*$", re.DOTALL)  # words after the last sentence end
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


def finished(text: str) -> str | None:
    """The text ended at its last sentence end, when words follow it (a text cut mid-sentence), else None."""
    found = _LAST_END.match(text.rstrip())
    return None if found is None else found.group(1)


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
class Cut:
    """Where a completion is cut, read by the reward: `n` of `of` reference completions end mid-sentence
    after a sentence end; `shift` the median |score(as written) - score(ended at that sentence end)|;
    `spread` the median |difference| between two reference completions' scores; `swing` their ratio."""

    n: int
    of: int
    shift: float
    spread: float

    @property
    def swing(self) -> float:
        if self.spread > 0:
            return self.shift / self.spread
        return 0.0 if self.shift == 0 else float("inf")

    @property
    def exercised(self) -> bool:
        """Most completions end mid-sentence, at least 3 of them: the run feeds the reward cut text."""
        return self.n >= 3 and 2 * self.n > self.of

    def to_json(self) -> dict[str, Any]:
        swing = None if math.isinf(self.swing) else round(self.swing, 4)  # JSON has no infinity
        return {"n": self.n, "of": self.of, "shift": round(self.shift, 4), "spread": round(self.spread, 4),
                "swing": swing}  # fmt: skip


def _median_gap(values: Sequence[float]) -> float:
    gaps = [abs(a - b) for i, a in enumerate(values) for b in values[i + 1 :]]
    return statistics.median(gaps) if gaps else 0.0


@dataclass
class Findings:
    """What the pre-flight saw: the median reference score, and per probe kind its count, mean score and
    the share of its probes above that median."""

    references: int
    median_reference: float
    shares: dict[str, float]
    means: dict[str, float]
    counts: dict[str, int]
    cut: Cut | None = None  # measured for prose (not a format task's answers)

    def to_json(self) -> dict[str, Any]:
        return {
            **({"cut": self.cut.to_json()} if self.cut is not None else {}),
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
    """Score the reference completions and every probe (`probe_completions`) with `score`; for prose, the
    references cut mid-sentence beside themselves ended at their last sentence end (`Cut`). One call of
    `score` for them all: a reward model scores them in as few batches as they fill."""
    groups = {"": list(enumerate(references)), **probe_completions(queries, references, negations, answer_format)}
    pairs = [] if answer_format else [(i, e) for i, r in enumerate(references) if (e := finished(r)) is not None]
    flat = [item for items in [*groups.values(), pairs] for item in items]
    values = iter(score([i for i, _ in flat], [t for _, t in flat]))
    scored = {kind: [next(values) for _ in items] for kind, items in groups.items()}
    ended = [next(values) for _ in pairs]
    ref = scored.pop("")
    median = statistics.median(ref)
    shares = {kind: sum(v > median for v in got) / len(got) for kind, got in scored.items()}
    means = {kind: statistics.fmean(got) for kind, got in scored.items()}
    counts = {kind: len(got) for kind, got in scored.items()}
    cut = None
    if not answer_format:
        shifts = [abs(ref[i] - v) for (i, _), v in zip(pairs, ended)]
        cut = Cut(len(pairs), len(references), statistics.median(shifts) if shifts else 0.0, _median_gap(ref))
    return Findings(len(references), median, shares, means, counts, cut)


def _cut_saw(cut: Cut | None) -> str:
    if cut is None:
        return ""
    if not cut.exercised:
        return (f"; {CUT_KIND}: {cut.n} of {cut.of} completions end mid-sentence, so where a completion is cut "
                "does not steer the reward")  # fmt: skip
    return f"; {CUT_KIND} swing {cut.swing:.0%} ({cut.n} of {cut.of} completions end mid-sentence)"


def check_probes(
    findings: Findings, health: Health, max_share: float = MAX_SHARE, max_swing: float = MAX_CUT_SWING
) -> None:
    """The `reward_probes` verdict: fired (before step 1) when a kind outscores the median reference more
    often than `max_share`, naming every such kind, or when most completions end mid-sentence and where
    they are cut moves the reward more than `max_swing` of what separates two completions."""
    over = {k: s for k, s in findings.shares.items() if s > max_share}
    cut = findings.cut
    swung = cut is not None and cut.exercised and cut.swing > max_swing
    if not over and not swung:
        kind, share = findings.worst()
        health.passed(
            GUARD,
            f"no probe kind outscores the median reference more often than {max_share:.0%} (most: {kind} "
            f"{share:.0%}){_cut_saw(cut)}",
        )
        return
    parts = []
    if over:
        named = ", ".join(f"{k} {s:.0%}" for k, s in sorted(over.items(), key=lambda kv: -kv[1]))
        parts.append(
            f"degenerate completions outscore the median reference completion ({findings.median_reference:.3g}) "
            f"more often than {max_share:.0%}: {named}; the reward pays for them"
        )
    if swung:
        parts.append(
            f"{CUT_KIND}: {cut.n} of {cut.of} completions end mid-sentence, and ending them at their last sentence "
            f"end moves the reward by {cut.shift:.3g}, {cut.swing:.0%} of what separates two completions "
            f"({cut.spread:.3g}; bar {max_swing:.0%}): the run would be rewarded for where its responses are cut "
            "(end them at a sentence: response_end sentence)"
        )
    health.failed(GUARD, "; ".join(parts) + " (see run_info.json reward_probes)", 0)


def figures(details: dict[str, Any]) -> list[str]:
    """The report's line for what a stage's pre-flight recorded in `run_info.json`'s details (none: []):
    the kinds that outscore the median reference most, and the cut swing when the run cuts its text."""
    found = details.get(DETAILS_KEY)
    if not found:
        return []
    kinds = sorted(found["kinds"].items(), key=lambda kv: -kv[1]["share_above_median"])[:3]
    shares = ", ".join(f"{k} {v['share_above_median']:.0%}" for k, v in kinds)
    cut = found.get("cut")
    swing = ""
    if cut and cut["n"] and cut["swing"] is not None:
        swing = f"; {CUT_KIND} swing {cut['swing']:.0%} ({cut['n']} of {cut['of']} end mid-sentence)"
    return [f"reward pre-flight, most above the median reference completion: {shares}{swing}"]


def table(details: dict[str, Any]) -> list[str]:
    """The pre-flight as a markdown table, a row per probe kind (and the cut swing), or []."""
    found = details.get(DETAILS_KEY)
    if not found:
        return []
    lines = [
        f"Reward pre-flight ({found['references']} reference completions, median score "
        f"{found['median_reference']:.3g}):",
        "",
        "| probe | n | mean score | share above the median reference |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {k} | {v['n']} | {v['mean']:.3g} | {v['share_above_median']:.0%} |" for k, v in found["kinds"].items()
    ]
    cut = found.get("cut")
    if cut and cut["n"]:
        swing = "-" if cut["swing"] is None else f"{cut['swing']:.0%}"
        lines += [
            "",
            f"Where a completion is cut: {cut['n']} of {cut['of']} end mid-sentence; ending them at their last "
            f"sentence end moves the score by {cut['shift']:.3g} (median), {swing} of the median gap between two "
            f"completions ({cut['spread']:.3g}; the guard's bar: {MAX_CUT_SWING:.0%} when most are cut).",
        ]
    elif cut:
        lines += ["", f"Where a completion is cut: none of the {cut['of']} ends mid-sentence; not exercised."]
    return [*lines, ""]
