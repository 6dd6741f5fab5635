"""The GSM8K task of the GRPO stage: problems, the reasoning/answer prompt, batched generation, the metric.

Shared by `scripts/grpo_gsm8k.py` (training), `scripts/evaluate_gsm8k.py` (evaluation) and the demo
builder (which teaches its tiny model the answer format). The rewards live in `fitrl.rewards`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fitrl.config import UsageError, check, help_field
from fitrl.data import load_dataset_any, require_columns
from fitrl.rewards import extract_gold, parse_number

SYSTEM_PROMPT = "Respond in the following format:\n<reasoning>\n...\n</reasoning>\n<answer>\n...\n</answer>"

# For tokenizers without a chat template (base models such as gpt-neox, the demo's tiny model): the
# system text, the question, then the answer cue. Instruct models (Llama-3.2-1B-Instruct) keep theirs.
PLAIN_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{{ message['content'] + '\\n\\n' }}"
    "{%- elif message['role'] == 'user' -%}{{ 'Question: ' + message['content'] + '\\n' }}"
    "{%- elif message['role'] == 'assistant' -%}{{ 'Answer:\\n' + message['content'] + eos_token }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'Answer:\\n' }}{%- endif -%}"
)

METRIC_PATH = Path(__file__).parent / "metrics" / "gsm8k_accuracy"
_CALCULATOR = re.compile(r"<<[^>]*>>")  # GSM8K's calculator annotations, e.g. <<14+11=25>>


@dataclass
class GSM8KDataArguments:
    """Which GSM8K problems, and how they become prompts."""

    dataset: str = help_field(
        "openai/gsm8k", "Hub id, a local .jsonl/.csv/.parquet with question/answer columns, or demo://arithmetic."
    )
    dataset_config: str | None = help_field("main", "Hub dataset configuration ('main' for openai/gsm8k).")
    dataset_split: str = help_field("train", "Split to use.")
    max_samples: int | None = help_field(None, "Use at most this many problems (all when empty).")
    system_prompt: str = help_field(SYSTEM_PROMPT, "System message asking for <reasoning> then <answer> blocks.")
    max_prompt_length: int = help_field(256, "Prompts longer than this many tokens are dropped (counted in the log).")

    def validate(self) -> None:
        check(self.max_samples is None or self.max_samples >= 1, "max_samples", "empty or >= 1")
        check(self.max_prompt_length >= 8, "max_prompt_length", ">= 8")


def format_solution(answer: str) -> str:
    """A GSM8K answer rewritten in the trained format: its worked steps, then the gold number."""
    steps, gold = answer.rsplit("####", 1)
    reasoning = _CALCULATOR.sub("", steps).strip()
    return f"<reasoning>\n{reasoning}\n</reasoning>\n<answer>\n{gold.strip()}\n</answer>"


def prompt_messages(question: str, system_prompt: str = SYSTEM_PROMPT) -> list[dict[str, str]]:
    return [{"role": "system", "content": system_prompt}, {"role": "user", "content": question}]


def ensure_chat_template(tokenizer: Any) -> bool:
    """Give a tokenizer without a chat template the plain one; True when it had to."""
    if getattr(tokenizer, "chat_template", None):
        return False
    tokenizer.chat_template = PLAIN_CHAT_TEMPLATE
    return True


def render_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def load_problems(args: GSM8KDataArguments, demo_cache_dir: str) -> tuple[Any, list[dict[str, Any]]]:
    """GSM8K problems with a `gold` column, and the rows skipped because their gold is not a number.

    A dataset without `question`/`answer` columns, or with an answer lacking `####`, is not GSM8K: that
    is a `UsageError`. A gold answer that does not parse as a number is skipped and reported.
    """
    ds = load_dataset_any(args.dataset, args.dataset_split, demo_cache_dir, args.dataset_config)
    require_columns(ds, ["question", "answer"], args.dataset)
    if args.max_samples is not None:
        ds = ds.select(range(min(args.max_samples, len(ds))))
    skipped, keep, golds = [], [], []
    for i, row in enumerate(ds):
        answer, question = row["answer"], row["question"]
        if not isinstance(question, str) or not question.strip():
            raise UsageError(f"dataset {args.dataset} row {i} has an empty question; every row needs one")
        gold = extract_gold(answer) if isinstance(answer, str) else None
        if gold is None:
            raise UsageError(
                f"dataset {args.dataset} row {i}: answer has no '#### <number>' line; GSM8K answers end with one"
            )
        if parse_number(gold) is None:
            skipped.append({"row": i, "gold": gold})
            continue
        keep.append(i)
        golds.append(gold)
    if not keep:
        raise UsageError(f"dataset {args.dataset}: no row has a numeric gold answer after '####'")
    ds = ds.select(keep).select_columns(["question", "answer"]).add_column("gold", golds)
    return ds, skipped


def add_prompts(ds: Any, tokenizer: Any, system_prompt: str, max_prompt_length: int) -> tuple[Any, int]:
    """Add the chat `prompt` column; drop the prompts longer than `max_prompt_length` tokens (returns how many)."""
    ds = ds.map(lambda r: {"prompt": prompt_messages(r["question"], system_prompt)})
    lengths = [len(tokenizer(render_prompt(tokenizer, p), add_special_tokens=False).input_ids) for p in ds["prompt"]]
    keep = [i for i, n in enumerate(lengths) if n <= max_prompt_length]
    dropped = len(ds) - len(keep)
    if not keep:
        raise UsageError(
            f"every prompt is longer than max_prompt_length={max_prompt_length} tokens "
            f"(shortest: {min(lengths)}); raise max_prompt_length"
        )
    return ds.select(keep), dropped


def generate(
    model: Any,
    tokenizer: Any,
    prompts: list[list[dict[str, str]]],
    max_new_tokens: int,
    num_samples: int = 1,
    temperature: float = 0.0,
    batch_size: int = 16,
    progress: Any = None,
) -> list[list[str]]:
    """`num_samples` completions per chat prompt, greedy when `temperature` is 0, in left-padded batches."""
    import torch

    device = next(model.parameters()).device
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    was_training = model.training
    model.eval()  # no dropout while sampling
    out: list[list[str]] = []
    try:
        for start in range(0, len(prompts), batch_size):
            texts = [render_prompt(tokenizer, p) for p in prompts[start : start + batch_size]]
            enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
            sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
            with torch.no_grad():
                ids = model.generate(
                    **enc,
                    max_new_tokens=max_new_tokens,
                    num_return_sequences=num_samples,
                    pad_token_id=tokenizer.pad_token_id,
                    **(sampling if temperature > 0 else {"do_sample": False}),
                )
            texts_out = tokenizer.batch_decode(ids[:, enc.input_ids.shape[1] :], skip_special_tokens=True)
            out += [texts_out[i : i + num_samples] for i in range(0, len(texts_out), num_samples)]
            if progress is not None:
                progress.update(len(texts))
    finally:
        tokenizer.padding_side = side
        model.train(was_training)
    return out


def load_accuracy_metric() -> Any:
    """fitrl's `evaluate` metric module for GSM8K accuracy, loaded from its local path (works offline)."""
    import evaluate

    return evaluate.load(str(METRIC_PATH))
