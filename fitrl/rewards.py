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

Numbers are compared as numbers, the way a grader reads them: `1,000` is 1000, `$18`, `18.`,
`18.0` and `18 apples` are 18, `-3` and `0.5` are what they say. Anything else in the answer block
is not a number and earns nothing. Text is parsed with regular expressions and `fractions.Fraction`:
nothing a model writes is ever evaluated as code.

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

# The whole completion: two blocks, every tag alone on its line, nothing before or after, no stray tags inside.
_BODY = r"(?:(?!</?(?:reasoning|answer)>).)+?"
_STRICT = re.compile(rf"\A<reasoning>\n{_BODY}\n</reasoning>\n<answer>\n{_BODY}\n</answer>\n?\Z", re.DOTALL)
_SOFT = re.compile(r"<reasoning>.*?</reasoning>\s*<answer>.*?</answer>", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)

# One number, as people write it: a sign, thousands separators, a decimal part, or a simple fraction.
_NUMBER = re.compile(
    r"""
    (?P<sign>[-+\u2212])?                          # '-', '+' or the typographic minus
    (?:
        (?P<num>\d+)\s*/\s*(?P<den>\d+)            # 3/4
      | (?P<int>\d{1,3}(?:,\d{3})+|\d+)            # 1,000 or 1000
        (?:\.(?P<frac>\d*))?                       # .5 or a bare trailing '.'
      | \.(?P<onlyfrac>\d+)                        # .5
    )
    """,
    re.VERBOSE,
)
_CURRENCY = "$€£¥"
# After the number, at most a unit in words ("apples", "km", "dollars per hour") or a percent sign.
_UNIT = re.compile(r"\s*(?:%|[A-Za-z][A-Za-z .'/-]*)?")


def completion_text(completion: str | Sequence[dict[str, Any]]) -> str:
    """The text of a completion, whether trl passes it as a string or as chat messages."""
    if isinstance(completion, str):
        return completion
    return "".join(str(message.get("content", "")) for message in completion)


def parse_number(text: str | None) -> Fraction | None:
    """The number `text` states, exactly, or None when it is not one number (possibly with a unit)."""
    if text is None:
        return None
    s = text.strip()
    if s.endswith("."):  # "18." and "18 apples." end a sentence, not a decimal
        s = s[:-1].rstrip()
    s = s.lstrip(_CURRENCY).strip()
    if len(s) > 1 and s[0] in "-+\u2212" and s[1] in _CURRENCY:  # -$5
        s = s[0] + s[2:]
    m = _NUMBER.match(s)
    if m is None:
        return None
    rest = s[m.end() :]
    unit = _UNIT.fullmatch(rest)
    if unit is None or any(c.isdigit() for c in rest):
        return None
    sign = -1 if m["sign"] in ("-", "\u2212") else 1
    if m["num"] is not None:
        if int(m["den"]) == 0:
            return None
        return sign * Fraction(int(m["num"]), int(m["den"]))
    if m["onlyfrac"] is not None:
        return sign * Fraction(f"0.{m['onlyfrac']}")
    digits = m["int"].replace(",", "") + ("." + m["frac"] if m["frac"] else "")
    return sign * Fraction(digits)


def extract_answer(completion: str) -> str | None:
    """The text inside the last `<answer>...</answer>` block, or None when there is none."""
    blocks = _ANSWER.findall(completion)
    return blocks[-1].strip() if blocks else None


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
    """Whether the number in the completion's answer block equals the gold number."""
    predicted, expected = parse_number(extract_answer(completion)), parse_number(gold)
    return predicted is not None and expected is not None and predicted == expected


def strict_format_reward(completions: Sequence[Any], **kwargs: Any) -> list[float]:
    return [STRICT_FORMAT_REWARD if is_strict_format(completion_text(c)) else 0.0 for c in completions]


def soft_format_reward(completions: Sequence[Any], **kwargs: Any) -> list[float]:
    return [SOFT_FORMAT_REWARD if is_soft_format(completion_text(c)) else 0.0 for c in completions]


def accuracy_reward(completions: Sequence[Any], gold: Sequence[str], **kwargs: Any) -> list[float]:
    return [ACCURACY_REWARD if is_correct(completion_text(c), g) else 0.0 for c, g in zip(completions, gold)]


REWARD_FUNCTIONS = {
    "strict_format": strict_format_reward,
    "soft_format": soft_format_reward,
    "accuracy": accuracy_reward,
}
