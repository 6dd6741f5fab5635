"""The accuracy reward against a careful human grader, on completions shaped like a 1B instruct model's.

Every row is a completion, the gold answer and the verdict a careful grader gives; the reward must
agree on every row. The rows cover correct answers written every way the grader accepts, wrong ones
that share digits with the gold, bounds and estimates that are no answer, and malformed output.
"""

from __future__ import annotations

import pytest

from fitrl.tasks.grading import is_correct

REASONING = "Janet's ducks lay 16 eggs. She eats 3 and bakes with 4, so 16 - 3 - 4 = 9 are left.\n9 * 2 = 18."


def block(answer: str) -> str:
    return f"<reasoning>\n{REASONING}\n</reasoning>\n<answer>\n{answer}\n</answer>"


# (answer block text, gold, a careful grader's verdict)
ANSWERS = [
    # plain and formatted numbers
    ("18", "18", True),
    ("18.", "18", True),
    ("18.0", "18", True),
    ("18.00", "18", True),
    ("+18", "18", True),
    ("$18", "18", True),
    ("$18.00", "18", True),
    ("1,000", "1000", True),
    ("$1,000", "1,000", True),
    ("1000", "1,000", True),
    ("0.5", "0.5", True),
    (".5", "0.5", True),
    ("1/2", "0.5", True),
    ("3/4", "0.75", True),
    ("50%", "50", True),
    ("-3", "-3", True),
    # the number inside prose or markup
    ("The answer is 18", "18", True),
    ("The answer is 18.", "18", True),
    ("The final answer is 18 dollars.", "18", True),
    ("Answer: 18", "18", True),
    ("answer: $18", "18", True),
    ("x = 18", "18", True),
    ("Total = 18", "18", True),
    ("**18**", "18", True),
    ("**$18**", "18", True),
    ("`18`", "18", True),
    ("\\boxed{18}", "18", True),
    ("$\\boxed{18}$", "18", True),
    ("\\(\\boxed{18}\\)", "18", True),
    ("Janet makes $18 every day.", "18", True),
    ("She has 18 eggs left to sell.", "18", True),
    ("12 + 6 = 18", "18", True),
    ("16 - 3 - 4 = 9, and 9 * 2 = 18", "18", True),
    ("18\nShe sells 9 eggs at $2 each.", "18", True),
    ("18\n\n(9 eggs times $2)", "18", True),
    # units the grader reads past
    ("18 dollars", "18", True),
    ("18 dollars!", "18", True),
    ("18 (dollars)", "18", True),
    ("$18/day", "18", True),
    ("$18 per day", "18", True),
    ("18 eggs", "18", True),
    ("18 km", "18", True),
    ("-10°F", "-10", True),
    ("-10 °C", "-10", True),
    ("25%", "25", True),
    ("18 apples.", "18", True),
    # minus signs
    ("\u22123", "-3", True),
    ("\u20133", "-3", True),
    ("- 3", "-3", True),
    ("-$5", "-5", True),
    # numbers in words, mixed numbers, scale words
    ("eighteen", "18", True),
    ("Eighteen dollars", "18", True),
    ("twenty-five", "25", True),
    ("one hundred and five", "105", True),
    ("one million", "1000000", True),
    ("1 1/2", "1.5", True),
    ("2 3/4", "2.75", True),
    ("18 thousand", "18000", True),
    ("$57.5 thousand", "57500", True),
    ("2.5 million", "2500000", True),
    ("18 and a half", "18.5", True),
    # words that change the value
    ("18 thousand", "18", False),
    ("18 and a half", "18", False),
    ("18 or more", "18", False),
    ("at least 18", "18", False),
    ("at most 18", "18", False),
    ("more than 18", "18", False),
    ("about 18", "18", False),
    ("approximately 18", "18", False),
    ("18 or 19", "18", False),
    ("between 17 and 19", "18", False),
    # wrong numbers that share digits with the gold
    ("180", "18", False),
    ("1.8", "18", False),
    ("18.5", "18", False),
    ("81", "18", False),
    ("118", "18", False),
    ("1,8", "18", False),
    ("$180", "18", False),
    ("eight", "18", False),
    ("-18", "18", False),
    ("17", "18", False),
    ("The answer is 16.", "18", False),
    ("x = 9", "18", False),
    ("9 * 2 = 16", "18", False),
    # not one number: no credit, and nothing is evaluated
    ("9 * 2", "18", False),
    ("12+6", "18", False),
    ("1e3", "1000", False),
    ("18 and 19", "18", False),
    ("She had 20 eggs and gave away 2.", "18", False),
    ("__import__('os').getcwd()", "18", False),
    ("I don't know", "18", False),
    ("", "18", False),
    ("5/0", "18", False),
]

# Whole completions: the answer block cut off, doubled, in another case, or missing.
COMPLETIONS = [
    (f"<reasoning>\n{REASONING}\n</reasoning>\n<answer>\n18", "18", True),  # stopped at EOS / the length limit
    (f"<reasoning>\n{REASONING}\n</reasoning>\n<answer>\n18\n", "18", True),
    (f"<reasoning>\n{REASONING}\n</reasoning>\n<answer>\n<answer>\n18\n</answer>", "18", True),  # doubled tag
    (f"<reasoning>\n{REASONING}\n</reasoning>\n<Answer>\n18\n</Answer>", "18", True),
    (f"<reasoning>\n{REASONING}\n</reasoning>\n<ANSWER>18</ANSWER>", "18", True),
    (f"<reasoning>\n{REASONING}\n</reasoning>\n<answer>18</answer>\n<answer>", "18", True),  # a stray open tag
    (f"<reasoning>\n{REASONING}\n</reasoning>\n<answer>\n17\n</answer>\n<answer>\n18\n</answer>", "18", True),
    (f"<reasoning>\n{REASONING}\n</reasoning>\n<answer>\n18\n</answer>\n<answer>\n17\n</answer>", "18", False),
    (f"<reasoning>\n{REASONING}\n</reasoning>\n<answer>\n18", "17", False),
    (f"<reasoning>\n{REASONING}\n</reasoning>", "18", False),  # no answer block
    (REASONING, "18", False),
    ("", "18", False),
]

TABLE = [(block(answer), gold, verdict) for answer, gold, verdict in ANSWERS] + COMPLETIONS


def test_the_table_is_large_and_balanced() -> None:
    assert len(TABLE) >= 100
    assert 0.4 < sum(verdict for *_, verdict in TABLE) / len(TABLE) < 0.7


@pytest.mark.parametrize(("completion", "gold", "verdict"), TABLE)
def test_the_reward_agrees_with_a_careful_grader(completion: str, gold: str, verdict: bool) -> None:
    assert is_correct(completion, gold) is verdict
