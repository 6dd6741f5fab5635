"""GSM8K rewards and number parsing on a table of real-looking completions, and the evaluate metric."""

from __future__ import annotations

from fractions import Fraction

import pytest

from fitrl.tasks.grading import (
    ACCURACY_REWARD,
    SOFT_FORMAT_REWARD,
    STRICT_FORMAT_REWARD,
    accuracy_reward,
    extract_answer,
    extract_gold,
    parse_number,
    soft_format_reward,
    strict_format_reward,
)


def fmt(reasoning: str, answer: str) -> str:
    return f"<reasoning>\n{reasoning}\n</reasoning>\n<answer>\n{answer}\n</answer>"


# (completion, gold, strict, soft, accurate)
TABLE = [
    # the exact format, right answer
    (fmt("Janet has 16 - 3 - 4 = 9 eggs.\nShe sells them for 9 * 2 = 18.", "18"), "18", True, True, True),
    # whitespace a tokenizer adds is still the exact format: a trailing newline or blank line, a leading
    # newline, a blank line between the blocks
    (fmt("9 * 2 = 18", "18") + "\n", "18", True, True, True),
    (fmt("9 * 2 = 18", "18") + "\n\n", "18", True, True, True),
    ("\n" + fmt("9 * 2 = 18", "18"), "18", True, True, True),
    (fmt("9 * 2 = 18", "18").replace("</reasoning>\n", "</reasoning>\n\n"), "18", True, True, True),
    # right format, wrong number
    (fmt("9 * 2 = 16", "16"), "18", True, True, False),
    # units and currency are read the way a grader reads them
    (fmt("9 * 2 = 18 dollars", "$18"), "18", True, True, True),
    (fmt("...", "18 dollars"), "18", True, True, True),
    (fmt("...", "$1,000"), "1000", True, True, True),
    (fmt("...", "1,000"), "1,000", True, True, True),
    (fmt("...", "18."), "18", True, True, True),
    (fmt("...", "18.0"), "18", True, True, True),
    (fmt("...", "18.50"), "18.5", True, True, True),
    (fmt("...", "-3"), "-3", True, True, True),
    (fmt("...", "0.5"), "0.5", True, True, True),
    (fmt("...", ".5"), "0.5", True, True, True),
    (fmt("...", "3"), "-3", True, True, False),
    (fmt("...", "1,00"), "100", True, True, False),  # a misplaced separator is not 100
    # not a number: no credit, and nothing is evaluated
    (fmt("...", "eighteen"), "18", True, True, True),  # a grader reads numbers in words
    (fmt("...", "9 * 2"), "18", True, True, False),
    (fmt("...", "__import__('os').getcwd()"), "18", True, True, False),
    (fmt("...", "18 or 19"), "18", True, True, False),
    (fmt("...", ""), "18", False, True, False),  # an empty answer block is not the format either
    # tags on the same line: soft format only
    ("<reasoning>9 * 2 = 18</reasoning><answer>18</answer>", "18", False, True, True),
    ("<reasoning>\n9 * 2 = 18\n</reasoning>\n\n<answer> 18 </answer>", "18", False, True, True),
    # extra text before or after the blocks: soft only
    ("Sure! " + fmt("9 * 2 = 18", "18"), "18", False, True, True),
    (fmt("9 * 2 = 18", "18") + "\nHope this helps.", "18", False, True, True),
    # a stray answer block inside the reasoning breaks the strict format; the last answer counts
    ("<reasoning>\n<answer>\n5\n</answer>\n</reasoning>\n<answer>\n18\n</answer>", "18", False, True, True),
    (fmt("...", "7") + "\n<answer>\n18\n</answer>", "18", False, True, True),
    # malformed: unclosed blocks, answer without reasoning, plain text
    # an answer block the generation cut off still states its answer
    ("<reasoning>\n9 * 2 = 18\n<answer>\n18", "18", False, False, True),
    ("<answer>\n18\n</answer>", "18", False, False, True),
    ("The answer is 18.", "18", False, False, False),
    ("", "18", False, False, False),
    # answer before reasoning
    ("<answer>\n18\n</answer>\n<reasoning>\n9 * 2\n</reasoning>", "18", False, False, True),
]


@pytest.mark.parametrize(("completion", "gold", "strict", "soft", "accurate"), TABLE)
def test_reward_table(completion: str, gold: str, strict: bool, soft: bool, accurate: bool) -> None:
    assert strict_format_reward([completion]) == [STRICT_FORMAT_REWARD if strict else 0.0]
    assert soft_format_reward([completion]) == [SOFT_FORMAT_REWARD if soft else 0.0]
    assert accuracy_reward([completion], gold=[gold]) == [ACCURACY_REWARD if accurate else 0.0]


def test_rewards_take_chat_messages_as_trl_passes_them() -> None:
    messages = [[{"role": "assistant", "content": fmt("9 * 2 = 18", "18")}], [{"role": "assistant", "content": "18"}]]
    assert strict_format_reward(messages) == [0.5, 0.0]
    assert soft_format_reward(messages) == [0.5, 0.0]
    assert accuracy_reward(messages, gold=["18", "18"], prompts=None, trainer_state=None) == [2.0, 0.0]


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1,000", Fraction(1000)),
        ("$18", Fraction(18)),
        ("18.", Fraction(18)),
        ("18.0", Fraction(18)),
        ("-3", Fraction(-3)),
        ("\u22123", Fraction(-3)),
        ("-$5", Fraction(-5)),
        ("0.5", Fraction(1, 2)),
        ("3/4", Fraction(3, 4)),
        ("1,234,567.25", Fraction(123456725, 100)),
        ("  42 apples  ", Fraction(42)),
        ("50%", Fraction(50)),
        ("18 apples.", Fraction(18)),
        ("0.1", Fraction(1, 10)),  # exact: no float rounding
    ],
)
def test_parse_number_reads_numbers_as_a_grader(text: str, value: Fraction) -> None:
    assert parse_number(text) == value


@pytest.mark.parametrize("text", ["", "x", "-", "$", "1e3", "12+6", "5/0", "18.5.3", "18 and 19", None, "2**100000"])
def test_parse_number_rejects_what_is_not_one_number(text: str | None) -> None:
    assert parse_number(text) is None


def test_extract_gold_and_answer() -> None:
    assert extract_gold("Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 72") == "72"
    assert extract_gold("no marker here") is None
    assert extract_answer("<answer> 1 </answer> then <answer>\n2\n</answer>") == "2"
    assert extract_answer("<answer>\n2") == "2"  # cut off by EOS or the length limit
    assert extract_answer("<reasoning>\nno answer\n</reasoning>") is None


def test_metric_accuracy_pass_at_k_and_format() -> None:
    from fitrl.tasks.gsm8k import load_accuracy_metric

    metric = load_accuracy_metric()
    good, wrong, sloppy = fmt("...", "18"), fmt("...", "17"), "<answer>18</answer>"
    greedy = metric.compute(predictions=[[good], [wrong], [sloppy], [good]], references=["18", "18", "18", "1,8"])
    # 'sloppy' is right (accuracy does not need the format); '1,8' is not the number 18
    assert greedy == {"accuracy": 0.5, "pass_at_k": 0.5, "format_compliance": 0.75, "k": 1}
    sampled = metric.compute(predictions=[[good, wrong], [wrong, wrong]], references=["18", "18"])
    assert sampled == {"accuracy": 0.25, "pass_at_k": 0.5, "format_compliance": 1.0, "k": 2}
    with pytest.raises(ValueError, match="same number"):
        metric.compute(predictions=[[good], [good, good]], references=["18", "18"])
