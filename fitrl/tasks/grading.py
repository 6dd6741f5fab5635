"""GRPO's rewards on GSM8K, as pure functions of the completion text.

The model is asked to answer as

    <reasoning>
    ...
    </reasoning>
    <answer>
    42
    </answer>

and three rewards score a completion (the recipe of the Llama-1B GRPO blog):

- `strict_format_reward`: 0.5 when the completion is exactly those two blocks, each tag on its own line;
- `soft_format_reward`: 0.5 when a reasoning block is followed by an answer block, however laid out;
- `accuracy_reward`: 2.0 when the number inside `<answer>` equals the gold number.

The answer block is read as a careful grader reads it (`read_answer`): one number, exactly
(`fractions.Fraction`), written with separators, currency, units, in words or with a scale word, or
stated inside prose, markup or an equation; a bound or an estimate (`at least 18`) is no answer.
Text is parsed with regular expressions: nothing a model writes is ever evaluated as code.

Each reward takes the keyword arguments trl's `GRPOTrainer` passes (`completions` as strings or as
chat messages, plus the dataset's columns, here `gold`) and returns one float per completion; the
GSM8K evaluation calls the same functions.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

STRICT_FORMAT_REWARD = 0.5
SOFT_FORMAT_REWARD = 0.5
ACCURACY_REWARD = 2.0

# The whole completion: two blocks, every tag alone on its line, no stray tags inside. Whitespace a
# tokenizer commonly adds (a leading newline, a blank line between the blocks, trailing blank lines)
# does not cost the format.
_BODY = r"(?:(?!</?(?:reasoning|answer)>).)+?"
_STRICT = re.compile(rf"\A\s*<reasoning>\n{_BODY}\n</reasoning>\n\s*<answer>\n{_BODY}\n</answer>\s*\Z", re.DOTALL)
_SOFT = re.compile(r"<reasoning>.*?</reasoning>\s*<answer>.*?</answer>", re.DOTALL)
_OPEN, _CLOSE = re.compile(r"<answer>", re.IGNORECASE), re.compile(r"</answer>", re.IGNORECASE)
_TAG = re.compile(r"</?(?:answer|reasoning)>", re.IGNORECASE)

# One number, as people write it: a sign, thousands separators, a decimal part, or a simple fraction.
_NUMBER = re.compile(
    r"""
    (?P<sign>[-+\u2212])?                          # '-', '+' or the typographic minus
    (?:
        (?P<whole>\d+)\s+(?P<mnum>\d+)/(?P<mden>\d+) # 1 1/2
      | (?P<num>\d+)\s*/\s*(?P<den>\d+)            # 3/4
      | (?P<int>\d{1,3}(?:,\d{3})+|\d+)            # 1,000 or 1000
        (?:\.(?P<frac>\d*))?                       # .5 or a bare trailing '.'
      | \.(?P<onlyfrac>\d+)                        # .5
    )
    """,
    re.VERBOSE,
)
_CURRENCY = "$€£¥"
_SCALES = {"hundred": 100, "thousand": 1000, "million": 10**6, "billion": 10**9}
_SCALE = re.compile(r"\s*(hundred|thousand|million|billion)\b", re.IGNORECASE)
_HALF = re.compile(r"\s*and\s+(?:a|one)\s+half\b", re.IGNORECASE)
# After the number, at most a unit: words ("apples", "dollars per hour"), a percent or degree sign,
# "/day", a unit in parentheses; then the end of the sentence.
_UNIT = re.compile(
    r"\s*(?:%|°\s*[A-Za-z]?|/\s*[A-Za-z]+|\(\s*[A-Za-z][A-Za-z .'/-]*\)|[A-Za-z][A-Za-z .'/-]*)?\s*[.!]?"
)
# Words that make the stated number something else than the answer: a bound, an estimate, a choice.
_QUALIFIER = re.compile(
    r"\b(?:or\s+more|or\s+less|or\s+fewer|at\s+least|at\s+most|more\s+than|less\s+than|fewer\s+than|up\s+to|"
    r"about|around|approximately|roughly|nearly|almost|between|or)\b",
    re.IGNORECASE,
)
_WORD_UNITS = {
    w: i
    for i, w in enumerate(
        "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
        "sixteen seventeen eighteen nineteen".split()
    )
}
_WORD_TENS = {w: 10 * i for i, w in enumerate("twenty thirty forty fifty sixty seventy eighty ninety".split(), 2)}
_NUMBER_WORD = re.compile(
    r"\b(?:"
    + "|".join([*_WORD_UNITS, *_WORD_TENS, *_SCALES, "and"])
    + r")(?:[\s-]+(?:"
    + "|".join([*_WORD_UNITS, *_WORD_TENS, *_SCALES, "and"])
    + r"))*\b",
    re.IGNORECASE,
)
_DIGIT_NUMBER = re.compile(r"[-\u2212]?[$€£¥]?\d[\d,]*(?:\.\d+)?(?:\s*/\s*\d+)?")


def completion_text(completion: str | Sequence[dict[str, Any]]) -> str:
    """The text of a completion, whether trl passes it as a string or as chat messages."""
    if isinstance(completion, str):
        return completion
    return "".join(str(message.get("content", "")) for message in completion)


def _words_to_number(text: str) -> Fraction | None:
    """'eighteen', 'twenty-five', 'one hundred and five', 'one million' as a number; None otherwise."""
    tokens = [t for t in re.split(r"[\s-]+", text.lower().strip()) if t and t != "and"]
    if not tokens:
        return None
    total, current = 0, None
    for token in tokens:
        if token in _WORD_UNITS or token in _WORD_TENS:
            current = (current or 0) + _WORD_UNITS.get(token, _WORD_TENS.get(token, 0))
        elif token == "hundred":
            current = (current or 1) * 100
        elif token in _SCALES:
            total, current = total + (current or 1) * _SCALES[token], None
        else:
            return None
    return Fraction(total + (current or 0))


def parse_number(text: str | None) -> Fraction | None:
    """The number `text` states, exactly, or None when it is not one number (possibly with a unit).

    Digits as people write them (`1,000`, `$18`, `18.`, `-3`, `0.5`, `3/4`, `1 1/2`, `50%`), scaled by
    a word (`18 thousand`, `2.5 million`, `18 and a half`), or in words (`eighteen`, `one million`);
    a unit may follow (`18 apples`, `$18/day`, `-10°F`, `18 (dollars)`). A bound or an estimate
    (`18 or more`, `at least 18`, `about 18`) is not an answer of 18, and nothing is evaluated.
    """
    if text is None:
        return None
    s = text.strip()
    if not s or _QUALIFIER.search(s):
        return None
    s = s.lstrip(_CURRENCY).strip()
    if len(s) > 1 and s[0] in "-+\u2212" and s[1] in _CURRENCY:  # -$5
        s = s[0] + s[2:]
    m = _NUMBER.match(s)
    if m is None:
        return _words_with_unit(s)
    value = _value(m)
    if value is None:
        return None
    rest = s[m.end() :]
    scale = _SCALE.match(rest)
    if scale:
        value, rest = value * _SCALES[scale[1].lower()], rest[scale.end() :]
    half = _HALF.match(rest)
    if half:
        value, rest = value + Fraction(1, 2) * (1 if value >= 0 else -1), rest[half.end() :]
    if _UNIT.fullmatch(rest) is None or any(c.isdigit() for c in rest):
        return None
    return value


def _value(m: re.Match) -> Fraction | None:
    sign = -1 if m["sign"] in ("-", "\u2212") else 1
    if m["whole"] is not None:
        if int(m["mden"]) == 0:
            return None
        return sign * (int(m["whole"]) + Fraction(int(m["mnum"]), int(m["mden"])))
    if m["num"] is not None:
        if int(m["den"]) == 0:
            return None
        return sign * Fraction(int(m["num"]), int(m["den"]))
    if m["onlyfrac"] is not None:
        return sign * Fraction(f"0.{m['onlyfrac']}")
    digits = m["int"].replace(",", "") + ("." + m["frac"] if m["frac"] else "")
    return sign * Fraction(digits)


def _words_with_unit(s: str) -> Fraction | None:
    """A number in words at the start of `s`, then at most a unit."""
    m = _NUMBER_WORD.match(s)
    if m is None:
        return None
    rest = s[m.end() :]
    if _UNIT.fullmatch(rest) is None or any(c.isdigit() for c in rest):
        return None
    return _words_to_number(m.group(0))


def _normalize(text: str) -> str:
    """An answer as plain text: markup, LaTeX wrappers and typographic minus signs removed."""
    boxed = re.findall(r"\\boxed\{([^{}]*)\}", text)
    if boxed:
        text = boxed[-1]
    text = re.sub(r"\\text\{([^{}]*)\}", r"\1", text)
    text = re.sub(r"\\[(),\[\]!;]|\\dfrac|\\frac", " ", text)
    text = re.sub(r"(\*\*|__|`)", "", text)
    text = text.replace("\u2013", "-").replace("\u2014", "-").replace("\u2212", "-")
    text = text.strip().strip("$").strip() if text.strip().startswith("$\\") else text.strip()
    return re.sub(r"^-\s+(?=[\d$])", "-", text)


def read_answer(text: str | None) -> Fraction | None:
    """The number a careful grader reads in an answer block, or None when it states no one number.

    In order: the whole block as one number; its first line (a number, then an explanation); the
    result of an equation (`x = 18`, `12 + 6 = 18`); what follows "the answer is" / "answer:"; the one
    number a sentence states. A bound or an estimate anywhere (`at least 18`) reads as no answer.
    """
    if text is None:
        return None
    s = _normalize(text)
    if not s or _QUALIFIER.search(s):
        return None
    lines = [line.strip() for line in s.splitlines() if line.strip()]
    candidates = [s, lines[0]] if len(lines) > 1 else [s]
    if "=" in s:
        candidates.append(s.rsplit("=", 1)[1])
    said = re.findall(r"answer\s*(?:is|:|=)\s*:?\s*([^\n]+)", s, re.IGNORECASE)
    if said:
        candidates.append(said[-1])
    for candidate in candidates:
        value = parse_number(candidate)
        if value is not None:
            return value
    numbers = _DIGIT_NUMBER.findall(s)
    if len(numbers) == 1 and not _NUMBER_WORD.search(s.replace(numbers[0], " ")):
        tail = s[s.index(numbers[0]) :]
        tail = re.split(r"(?<=[^\d,.])[.!?;](?:\s|$)", tail, maxsplit=1)[0]
        value = parse_number(tail)
        if value is None:
            value = parse_number(numbers[0])
        return value
    return None


def extract_answer(completion: str) -> str | None:
    """The text of the last non-empty `<answer>` block, or None when there is none.

    A block that the generation cut off (no closing tag) runs to the end; a doubled opening tag and
    tags in another case (`<Answer>`) read as one block.
    """
    for part in reversed(_OPEN.split(completion)[1:]):  # the text after each opening tag, last first
        body = _TAG.sub("", _CLOSE.split(part, maxsplit=1)[0]).strip()
        if body:
            return body
    return None


def parse_gold(text: str | None) -> Fraction | None:
    """A gold answer's number: as `parse_number`, but written in digits, as GSM8K's always are."""
    if text is None or not any(c.isdigit() for c in text):
        return None
    return parse_number(text)


def extract_gold(answer: str) -> str | None:
    """GSM8K's gold answer: the text after the last `####`, or None when the answer has no `####`."""
    if "####" not in answer:
        return None
    return answer.rsplit("####", 1)[1].strip()


def is_strict_format(completion: str) -> bool:
    return _STRICT.match(completion) is not None


def is_soft_format(completion: str) -> bool:
    return _SOFT.search(completion) is not None


def is_correct(completion: str, gold: str) -> bool:
    """Whether the number a careful grader reads in the completion's answer block equals the gold number."""
    predicted, expected = read_answer(extract_answer(completion)), parse_gold(gold)
    return predicted is not None and expected is not None and predicted == expected


def strict_format_reward(completions: Sequence[Any], **kwargs: Any) -> list[float]:
    return [STRICT_FORMAT_REWARD if is_strict_format(completion_text(c)) else 0.0 for c in completions]


def soft_format_reward(completions: Sequence[Any], **kwargs: Any) -> list[float]:
    return [SOFT_FORMAT_REWARD if is_soft_format(completion_text(c)) else 0.0 for c in completions]


def accuracy_reward(
    completions: Sequence[Any], gold: Sequence[str] | None = None, answer: Sequence[str] | None = None, **kwargs: Any
) -> list[float]:
    """`gold`: each problem's gold number (GRPO's data has it); else `answer`, GSM8K's solution ending
    '#### <number>' or the number alone (PPO hands the dataset's own column, `reward_columns: [answer]`)."""
    if gold is None:
        if answer is None:
            raise TypeError("the accuracy reward needs a gold or an answer column (reward_columns: [answer])")
        gold = [extract_gold(a) or a for a in answer]
    return [ACCURACY_REWARD if is_correct(completion_text(c), g) else 0.0 for c, g in zip(completions, gold)]
