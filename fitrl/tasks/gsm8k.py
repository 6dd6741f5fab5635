"""The GSM8K task of the GRPO stage: problems with a numeric gold answer, their chat prompts, the metric.

Shared by `fitrl.scripts.grpo` (training) and `scripts/eval_gsm8k.py` (evaluation). The answer
format lives in `fitrl.tasks.answer_format`, the rewards that check it in `fitrl.tasks.grading`, and sampling
completions in `fitrl.rollout`.
"""

from __future__ import annotations

import dataclasses
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fitrl.config import UsageError, check, help_field
from fitrl.data import load_dataset_any, require_columns
from fitrl.tasks.answer_format import SYSTEM_PROMPT, format_solution, prompt_messages, render_prompt
from fitrl.tasks.grading import extract_answer, extract_gold, is_correct, parse_gold, read_answer

METRIC_PATH = Path(__file__).parent.parent / "metrics" / "gsm8k_accuracy"


@dataclass
class GSM8KDataArguments:
    """Which GSM8K problems, and how they become prompts."""

    dataset: str = help_field(
        "openai/gsm8k", "Hub id, a local .jsonl/.csv/.parquet with question/answer columns, or demo://arithmetic."
    )
    question_column: str = help_field("question", "Column holding the question.")
    answer_column: str = help_field(
        "answer", "Column holding the answer: a solution ending '#### <number>' (GSM8K's), or just the number."
    )
    dataset_config: str | None = help_field("main", "Hub dataset configuration ('main' for openai/gsm8k).")
    dataset_split: str = help_field("train", "Split to use.")
    max_samples: int | None = help_field(None, "Use at most this many problems (all when empty).")
    system_prompt: str = help_field(SYSTEM_PROMPT, "System message asking for <reasoning> then <answer> blocks.")
    max_prompt_length: int = help_field(256, "Prompts longer than this many tokens are dropped (counted in the log).")

    def validate(self) -> None:
        check(self.max_samples is None or self.max_samples >= 1, "max_samples", "empty or >= 1")
        check(self.max_prompt_length >= 8, "max_prompt_length", ">= 8")


def load_problems(args: GSM8KDataArguments, demo_assets: str) -> tuple[Any, list[dict[str, Any]]]:
    """Problems with `question`, `answer` and `gold` columns, and the rows skipped because their gold is not
    a number.

    The answer is GSM8K's (a solution whose last line is `#### <number>`) or the number alone. Missing
    columns, an empty question, or an answer that is neither is a `UsageError`; a gold after `####` that
    does not parse as a number is skipped and reported.
    """
    ds = load_dataset_any(args.dataset, args.dataset_split, demo_assets, args.dataset_config)
    columns = [args.question_column, args.answer_column]
    require_columns(ds, columns, args.dataset, "set question_column and answer_column to the data's columns")
    if columns != ["question", "answer"]:
        ds = ds.select_columns(columns)
        ds = ds.rename_columns({old: new for old, new in zip(columns, ["question", "answer"]) if old != new})
    if args.max_samples is not None:
        ds = ds.select(range(min(args.max_samples, len(ds))))
    skipped, keep, golds = [], [], []
    for i, row in enumerate(ds):
        answer, question = row["answer"], row["question"]
        if not isinstance(question, str) or not question.strip():
            raise UsageError(f"dataset {args.dataset} row {i} has an empty question; every row needs one")
        if isinstance(answer, (int, float)) and not isinstance(answer, bool):
            answer = str(answer)
        gold = extract_gold(answer) if isinstance(answer, str) else None
        if gold is None and isinstance(answer, str) and parse_gold(answer) is not None:
            gold = answer.strip()  # the number alone
        if gold is None:
            raise UsageError(
                f"dataset {args.dataset} row {i}: answer {str(answer)[:40]!r} is neither a number nor a solution "
                "ending '#### <number>'; give one of the two"
            )
        if parse_gold(gold) is None:
            skipped.append({"row": i, "gold": gold})
            continue
        keep.append(i)
        golds.append(gold)
    if not keep:
        raise UsageError(f"dataset {args.dataset}: no row has a numeric gold answer after '####'")
    ds = ds.select(keep).select_columns(["question", "answer"]).add_column("gold", golds)
    return ds, skipped


def add_prompts(
    ds: Any, tokenizer: Any, system_prompt: str, max_prompt_length: int, examples: list[tuple[str, str]] = ()
) -> tuple[Any, int]:
    """Add the chat `prompt` column; drop the prompts longer than `max_prompt_length` tokens (returns how many)."""
    ds = ds.map(lambda r: {"prompt": prompt_messages(r["question"], system_prompt, list(examples))})
    lengths = [len(tokenizer(render_prompt(tokenizer, p), add_special_tokens=False).input_ids) for p in ds["prompt"]]
    keep = [i for i, n in enumerate(lengths) if n <= max_prompt_length]
    dropped = len(ds) - len(keep)
    if not keep:
        raise UsageError(
            f"every prompt is longer than max_prompt_length={max_prompt_length} tokens "
            f"(shortest: {min(lengths)}); raise max_prompt_length"
        )
    return ds.select(keep), dropped


def fewshot_examples(args: GSM8KDataArguments, k: int, seed: int, demo_assets: str) -> list[tuple[str, str]]:
    """`k` solved problems from the train split (drawn with `seed`), as (question, solution in the format)."""
    if k == 0:
        return []
    train, _ = load_problems(dataclasses.replace(args, dataset_split="train", max_samples=None), demo_assets)
    if len(train) < k:
        raise UsageError(f"num_fewshot={k} but the train split has {len(train)} problems; lower num_fewshot")
    if not all("####" in str(a) for a in train["answer"]):
        raise UsageError(
            f"num_fewshot={k} needs worked solutions ending '#### <number>' in the train split, not bare numbers; "
            "set num_fewshot 0"
        )
    rows = random.Random(seed).sample(range(len(train)), k)
    return [(train[i]["question"], format_solution(train[i]["answer"])) for i in rows]


# lm-evaluation-harness's two GSM8K extractions (its gsm8k task: "strict-match" and "flexible-extract"),
# so that a result sits beside published numbers computed the same way.
_HARNESS_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_HARNESS_FLEXIBLE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")


def _harness_clean(text: str) -> str:
    """The harness's `regexes_to_ignore`: commas, dollar signs, everything up to '#### ', a final period."""
    for pattern in [",", "\\$", "(?s).*#### ", "\\.$"]:
        text = re.sub(pattern, "", text)
    return text.strip().lower()


def harness_answers(completion: str) -> tuple[str | None, str | None]:
    """The (strict-match, flexible-extract) answers lm-evaluation-harness reads in a completion."""
    strict = _HARNESS_STRICT.search(completion)
    flexible = _HARNESS_FLEXIBLE.findall(completion)
    last = next((g for g in flexible[-1] if g), None) if flexible else None
    return (strict[1] if strict else None), last


def failure_kind(completion: str, gold: str) -> str | None:
    """Why a completion scores 0: 'no_answer_block', 'unparsable_answer' or 'wrong_number'; None if correct."""
    answer = extract_answer(completion)
    if answer is None:
        return "no_answer_block"
    if read_answer(answer) is None:
        return "unparsable_answer"
    return None if is_correct(completion, gold) else "wrong_number"


def grade(predictions: list[list[str]], golds: list[str]) -> dict[str, Any]:
    """Beside fitrl's accuracy: the harness's two accuracies and why the other completions failed."""
    strict = flexible = n = 0
    failures = dict.fromkeys(["no_answer_block", "unparsable_answer", "wrong_number"], 0)
    for completions, gold in zip(predictions, golds):
        for c in completions:
            s, f = harness_answers(c)
            strict += s is not None and _harness_clean(s) == _harness_clean(gold)
            flexible += f is not None and _harness_clean(f) == _harness_clean(gold)
            kind = failure_kind(c, gold)
            if kind is not None:
                failures[kind] += 1
            n += 1
    return {"harness_strict_match": strict / n, "harness_flexible_extract": flexible / n, "failures": failures}


def load_accuracy_metric() -> Any:
    """fitrl's `evaluate` metric module for GSM8K accuracy, loaded from its local path (works offline)."""
    import evaluate

    return evaluate.load(str(METRIC_PATH))
