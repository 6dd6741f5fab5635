"""The demo's own texts, made from a seed: movie reviews with a sentiment label, and arithmetic
word problems in GSM8K's format (worked steps with calculator annotations, then `#### <number>`).

Pure Python, no torch: the reviews are the SFT corpus and the PPO prompts, the problems GRPO's data.
"""

from __future__ import annotations

import random
import re
from typing import Any

N_REVIEWS = 2400
N_PROBLEMS = 2000

_TITLE_A = "Silent Broken Golden Last Hidden Crimson Endless Paper Midnight Distant Iron Quiet Frozen Wild".split()
_TITLE_B = "Harbor Garden Letters Horizon Kingdom Road Winter Mirror Promise River Engine Summer Orchard".split()
_FIRST = "Anna Marco Priya Tom Lena Omar Grace Felix Nadia Owen Sofia Ravi Clara Jonas Maya Ivan".split()
_LAST = "Keller Duarte Nakamura Brooks Varga Okafor Lindqvist Moreau Patel Rossi Haddad Novak".split()
_GENRES = ["drama", "thriller", "comedy", "romance", "western", "war film", "mystery", "science fiction film"]
_ROLES = [
    "a retired detective",
    "a young teacher",
    "a lonely pilot",
    "an estranged sister",
    "a small-town mayor",
    "a jazz pianist",
    "a runaway soldier",
    "an ambitious chef",
    "a grieving father",
    "a stubborn farmer",
]
_PLOTS = [
    "returns home after twenty years",
    "tries to save a failing business",
    "uncovers an old family secret",
    "crosses the country by train",
    "falls for a rival",
    "hunts for a missing friend",
    "prepares for one last competition",
    "hides from a dangerous past",
]
_PLACES = [
    "a fishing village",
    "post-war Berlin",
    "a desert town",
    "a crowded hospital",
    "a mountain hotel",
    "a Paris suburb",
    "a lighthouse",
    "a failing circus",
]
_ASPECTS = [
    "the acting",
    "the script",
    "the soundtrack",
    "the cinematography",
    "the pacing",
    "the ending",
    "the dialogue",
    "the lead performance",
    "the direction",
    "the plot",
    "the editing",
    "the cast",
]
_POS_ADJ = [
    "wonderful",
    "superb",
    "moving",
    "brilliant",
    "gripping",
    "charming",
    "clever",
    "delightful",
    "stunning",
    "heartfelt",
    "excellent",
    "beautiful",
    "funny",
    "powerful",
    "memorable",
]
_NEG_ADJ = [
    "dull",
    "clumsy",
    "tedious",
    "awful",
    "lifeless",
    "predictable",
    "messy",
    "boring",
    "forgettable",
    "painful",
    "weak",
    "terrible",
    "flat",
    "confusing",
    "annoying",
]
_INTENSIFIERS = ["", "", "truly ", "really ", "simply ", "quite ", "absolutely "]
_POS_VERDICTS = [
    "I would happily watch it again.",
    "Highly recommended.",
    "A real gem.",
    "One of the best films of the year.",
    "I loved every minute of it.",
    "Go and see it.",
    "It stayed with me for days.",
    "A joy from start to finish.",
]
_NEG_VERDICTS = [
    "I want my two hours back.",
    "Skip this one.",
    "A complete waste of time.",
    "One of the worst films of the year.",
    "I nearly walked out.",
    "Avoid it.",
    "I forgot it the moment it ended.",
    "A chore from start to finish.",
]


def _neutral(rng: random.Random, title: str) -> str:
    director = f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"
    actor = f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"
    options = [
        f"{title} is a {rng.choice(_GENRES)} directed by {director}.",
        f"{actor} plays {rng.choice(_ROLES)} who {rng.choice(_PLOTS)}.",
        f"The story follows {rng.choice(_ROLES)} in {rng.choice(_PLACES)}.",
        f"It runs about {rng.randrange(85, 170, 5)} minutes.",
        f"I saw {title} on a {rng.choice(['Sunday', 'rainy evening', 'long flight', 'Friday night'])}.",
    ]
    return rng.choice(options)


def _opinion(rng: random.Random, positive: bool, negations: bool = True) -> str:
    """One sentence whose sentiment is `positive`; some say it through a negation, so words alone mislead
    (none when not `negations`: those become plain adjectives)."""
    aspect = rng.choice(_ASPECTS)
    aspect = aspect[0].upper() + aspect[1:]
    kind = rng.random()
    if kind < 0.6 or (kind < 0.8 and not negations):
        adj = rng.choice(_POS_ADJ if positive else _NEG_ADJ)
        return f"{aspect} was {rng.choice(_INTENSIFIERS)}{adj}."
    if kind < 0.8:  # "not <opposite>"
        adj = rng.choice(_NEG_ADJ if positive else _POS_ADJ)
        return f"{aspect} was {rng.choice(['not', 'never', 'not at all'])} {adj}."
    if positive:
        return f"I {rng.choice(['loved', 'enjoyed', 'admired', 'adored'])} {aspect.lower()}."
    return f"I {rng.choice(['hated', 'disliked', 'could not stand', 'was bored by'])} {aspect.lower()}."


def make_review(rng: random.Random, positive: bool) -> str:
    title = f"The {rng.choice(_TITLE_A)} {rng.choice(_TITLE_B)}"
    parts = [_neutral(rng, title)]
    if rng.random() < 0.5:
        parts.append(_neutral(rng, title))
    n_major = rng.randint(2, 3)
    n_minor = 1 if rng.random() < 0.35 else 0
    opinions = [_opinion(rng, positive) for _ in range(n_major)] + [_opinion(rng, not positive)] * n_minor
    rng.shuffle(opinions)
    parts += opinions
    if rng.random() < 0.7:
        parts.append(rng.choice(_POS_VERDICTS if positive else _NEG_VERDICTS))
    return " ".join(parts)


def make_reviews(seed: int, n: int = N_REVIEWS) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [{"text": make_review(rng, bool(i % 2)), "label": i % 2} for i in range(n)]


# The arithmetic word problems.

_NAMES = ["Mia", "Leo", "Ava", "Sam", "Zoe", "Ben", "Ivy", "Max", "Ella", "Noah", "Lily", "Omar"]
_ITEMS = ["apples", "pencils", "stickers", "marbles", "books", "cookies", "stamps", "shells"]


EASY_SHARE = 0.5  # of the problems: one step on small numbers, so a tiny model solves some from the start
EASY_MAX = 5


def make_problem(rng: random.Random) -> dict[str, str]:
    """One word problem: half of them easy (one addition or subtraction on numbers up to EASY_MAX, as
    the first grades do), the rest GSM8K-like (bigger numbers, multiplication, two steps)."""
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    if rng.random() < EASY_SHARE:
        kind = rng.choice(["add", "sub"])
        a, b = rng.randint(1, EASY_MAX), rng.randint(1, EASY_MAX)
        if kind == "sub":
            a = a + b  # the result stays in 1..EASY_MAX
    else:
        kind = rng.choice(["add", "sub", "mul", "add_sub"])
        a, b = rng.randint(2, 20), rng.randint(2, 12)
        if kind == "sub":
            a = a + b
        elif kind == "mul":
            a = rng.randint(2, 9)
    if kind == "add":
        q = f"{name} has {a} {item}. {name} gets {b} more. How many {item} does {name} have now?"
        steps, result = [f"{name} has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} {item}."], a + b
    elif kind == "sub":
        q = f"{name} has {a} {item} and gives away {b}. How many {item} are left?"
        steps, result = [f"{name} has {a} - {b} = <<{a}-{b}={a - b}>>{a - b} {item} left."], a - b
    elif kind == "mul":
        q = f"{name} buys {a} boxes with {b} {item} in each box. How many {item} does {name} buy?"
        steps, result = [f"{name} buys {a} * {b} = <<{a}*{b}={a * b}>>{a * b} {item}."], a * b
    else:
        c = rng.randint(1, a + b - 1)
        q = f"{name} has {a} {item}, finds {b} more and then loses {c}. How many {item} does {name} have?"
        s = a + b
        steps = [
            f"After finding some, {name} has {a} + {b} = <<{a}+{b}={s}>>{s} {item}.",
            f"After losing some, {name} has {s} - {c} = <<{s}-{c}={s - c}>>{s - c} {item}.",
        ]
        result = s - c
    return {"question": q, "answer": "\n".join(steps) + f"\n#### {result}"}


def make_problems(seed: int, n: int = N_PROBLEMS) -> list[dict[str, str]]:
    rng = random.Random(seed + 1)
    return [make_problem(rng) for _ in range(n)]


# The generator's own reading of a text: the demo's second sentiment judge.

_POLARITY = {**{a: 1 for a in _POS_ADJ}, **{a: -1 for a in _NEG_ADJ}}
_VERBS = {
    **{v: 1 for v in ("loved", "enjoyed", "admired", "adored")},
    **{v: -1 for v in ("hated", "disliked")},
}
_PHRASES = [("could not stand", -1), ("was bored by", -1)]
_PHRASES += [(v.lower().rstrip("."), 1) for v in _POS_VERDICTS] + [(v.lower().rstrip("."), -1) for v in _NEG_VERDICTS]
_NEGATIONS = ("not", "never")


def opinion_polarity(text: str) -> int:
    """Positive minus negative opinions in `text`, read the way the corpus writes them.

    A rule reader, not a learned model: an opinion adjective counts with its sign, flipped when one of
    the three words before it is "not" or "never" ("was not at all dull" is praise); "I loved" /
    "I hated" and the verdict sentences count too. Words it does not know count nothing, so text that
    only pushes a classifier's buttons scores 0 here.
    """
    lowered = text.lower()
    score = sum(sign * lowered.count(phrase) for phrase, sign in _PHRASES)
    for sentence in re.split(r"[.!?]", lowered):  # a negation reaches no further than its sentence
        words = re.findall(r"[a-z]+", sentence)
        for i, word in enumerate(words):
            sign = _POLARITY.get(word, 0) or _VERBS.get(word, 0) * (i > 0 and words[i - 1] == "i")
            if sign and word in _POLARITY and any(w in _NEGATIONS for w in words[max(0, i - 3) : i]):
                sign = -sign
            score += sign
    return score


# Preference pairs: what a reward model and DPO learn from.

N_PAIRS = 1600
# The share of pairs whose labels are swapped, standing for annotators who disagree with the rule: no
# reward model can agree with more than 1 - FLIPPED_SHARE of the (equally noisy) held-out labels.
FLIPPED_SHARE = 0.1


def make_pair(rng: random.Random) -> dict[str, str]:
    """One prompt, the opening words of a review, and two continuations of it that finish its first
    sentence the same way and then go on differently: with one or two positive opinions, or with
    negative ones or (half the time) a second neutral sentence. The generator's rule
    (`opinion_polarity`) ranks positive above neutral above negative: the positive one is `chosen`.

    The opinions are plain ("was dull", "I loved"), never negated: the annotators of the demo never
    judged a "not dull", so a reward model learns no more of negation than the LM already knows (a
    tiny one learns it slowly: with the reviews' 20% of negated opinions, four epochs reached 92-97% of
    the rule's verdicts; plain, one epoch reaches 100%). The second judge reads negations; where PPO
    leans on that blind spot, the judge says so.
    """
    title = f"The {rng.choice(_TITLE_A)} {rng.choice(_TITLE_B)}"
    words = _neutral(rng, title).split()
    cut = rng.randint(2, min(6, len(words) - 1))
    prompt, rest = " ".join(words[:cut]), " ".join(words[cut:])
    n = rng.randint(1, 2)
    positive = " ".join([rest] + [_opinion(rng, True, negations=False) for _ in range(n)])
    if rng.random() < 0.5:
        other = " ".join([rest] + [_opinion(rng, False, negations=False) for _ in range(n)])
    else:
        other = f"{rest} {_neutral(rng, title)}"
    if opinion_polarity(positive) <= opinion_polarity(other):  # never: the rule reads what it wrote
        raise AssertionError((positive, other))
    return {"prompt": prompt, "chosen": " " + positive, "rejected": " " + other}


def make_pairs(seed: int, n: int, flipped_share: float = FLIPPED_SHARE) -> list[dict[str, str]]:
    """`n` pairs, exactly round(`flipped_share` x n) of them, drawn at random, with their labels swapped."""
    rng = random.Random(seed + 2)
    pairs = [make_pair(rng) for _ in range(n)]
    for i in rng.sample(range(n), round(flipped_share * n)):
        pairs[i] = {**pairs[i], "chosen": pairs[i]["rejected"], "rejected": pairs[i]["chosen"]}
    return pairs
