"""Preference pairs, what the reward-model and DPO stages learn from: a prompt, a chosen and a rejected
continuation, and optionally a margin (how much better the chosen one is).

From a hub id, local files or `demo://preferences`. Every pair is checked before a model loads: the
columns exist, no text is empty, chosen and rejected differ, and the pair fits `max_length` tokens.
A bad row is one line naming the file's row and the fix.

Pairs in trl's conversational format (`prompt`, `chosen`, `rejected` as lists of messages, or chosen
and rejected as whole chats that share their prompt turns) are rendered with the tokenizer's chat
template (or the plain one), as trl renders them: the prompt up to the assistant's cue, each answer the
rest of its rendered chat. Both stages then read the same texts, and the rm stage's evaluation and PPO's
reward adapter score them as trained.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fitrl.chat import check_chat, is_chat, render_prompt_chat, use_chat_template
from fitrl.config import UsageError, check, config_dict, config_of, first_line, help_field
from fitrl.data import check_columns, load_dataset_any

TEXT_KEYS = ("prompt", "chosen", "rejected")


@dataclass
class PreferenceArguments:
    """Where the preference pairs come from and how they are cut."""

    dataset: str = help_field(
        "Anthropic/hh-rlhf",
        "Hub id, a local .jsonl/.csv/.parquet file or directory of preference pairs, or demo://preferences.",
    )
    dataset_split: str = help_field("train", "Split to train on.")
    eval_split: str = help_field("test", "Held-out split the stage evaluates on.")
    prompt_column: str | None = help_field(
        None, "Column of the prompt both texts continue (empty: chosen and rejected hold the whole texts)."
    )
    chosen_column: str = help_field("chosen", "Column of the preferred continuation.")
    rejected_column: str = help_field("rejected", "Column of the dispreferred continuation.")
    margin_column: str | None = help_field(
        None, "Column of a margin per pair (how much better chosen is); the reward loss then asks that much more."
    )
    max_samples: int | None = help_field(None, "Train on at most this many pairs (all when empty).")
    max_eval_samples: int | None = help_field(256, "Evaluate on at most this many held-out pairs (all when empty).")
    max_length: int = help_field(512, "Longest prompt + continuation in tokens; longer pairs are dropped and counted.")
    pad_to_max_length: bool = help_field(
        False,
        "Pad every batch to max_length: each step then needs the memory the planner plans (the worst case), "
        "so a run that would run out does so at its first step; off, batches are as long as their longest pair.",
    )

    def validate(self) -> None:
        check(self.max_length >= 8, "max_length", "an integer >= 8")
        check(self.max_samples is None or self.max_samples >= 1, "max_samples", "empty or >= 1")
        check(self.max_eval_samples is None or self.max_eval_samples >= 1, "max_eval_samples", "empty or >= 1")

    @property
    def columns(self) -> dict[str, str]:
        """fitrl's name of each column -> the dataset's."""
        named = {"prompt": self.prompt_column, "chosen": self.chosen_column, "rejected": self.rejected_column}
        named["margin"] = self.margin_column
        return {ours: theirs for ours, theirs in named.items() if theirs}


def pad_multiple(args: PreferenceArguments) -> int | None:
    """trl's `pad_to_multiple_of` for these settings: max_length itself pads every batch to it."""
    return args.max_length if args.pad_to_max_length else None


def _bad_row(source: str, index: int, problem: str, fix: str) -> UsageError:
    return UsageError(f"dataset {source} row {index + 1}: {problem}; {fix}")


def check_pairs(rows: list[dict[str, Any]], source: str) -> None:
    """Refuse the first pair a reward model or DPO cannot learn from, naming its row (pairs of text; chats
    are checked by `check_chat_pairs` and rendered first)."""
    for i, row in enumerate(rows):
        for key in [k for k in TEXT_KEYS if k in row]:
            value = row[key]
            if not (isinstance(value, str) and value.strip()):
                what = "empty" if value is None or isinstance(value, str) else f"not text ({type(value).__name__})"
                raise _bad_row(source, i, f"'{key}' is {what}", "remove the row or fill it in")
        if row["chosen"].strip() == row["rejected"].strip():
            raise _bad_row(source, i, "chosen and rejected are the same text", "a pair must differ; remove the row")
        if "margin" in row and not isinstance(row["margin"], (int, float)):
            raise _bad_row(source, i, f"margin {row['margin']!r} is not a number", "give a number or no margin_column")


def load_pairs(args: PreferenceArguments, split: str, demo_assets: str, max_samples: int | None) -> Any:
    """The pairs of `split` as a `datasets.Dataset` with fitrl's column names (prompt, chosen, rejected,
    margin as present), checked, at most `max_samples` of them."""
    ds = load_dataset_any(args.dataset, split, demo_assets)
    fix = "name the columns with prompt_column, chosen_column and rejected_column"
    check_columns(ds.column_names, list(args.columns.values()), args.dataset, fix)
    if len(ds) == 0:
        raise UsageError(f"dataset {args.dataset} split '{split}' has no pairs")
    if not args.prompt_column and "prompt" in ds.column_names and is_chat(ds[0][args.chosen_column]):
        raise UsageError(
            f"dataset {args.dataset} has a 'prompt' column beside chats, which prompt_column leaves out; "
            "set prompt_column: prompt"
        )
    ds = ds.select_columns(list(args.columns.values()))
    ds = ds.rename_columns({theirs: ours for ours, theirs in args.columns.items() if theirs != ours})
    if max_samples is not None:
        ds = ds.select(range(min(max_samples, len(ds))))
    rows = ds.to_list()
    if any(is_chat(row.get(key)) for row in rows for key in TEXT_KEYS):
        check_chat_pairs(rows, args.dataset)
    else:
        check_pairs(rows, args.dataset)
    return ds


def check_chat_pairs(rows: list[dict[str, Any]], source: str) -> None:
    """Conversational pairs: every value a chat, the prompt ending before the assistant's turn, the
    answers differing; without a prompt, chosen and rejected share every turn but their last."""
    for i, row in enumerate(rows):
        for key in [k for k in TEXT_KEYS if k in row]:
            if not is_chat(row[key]):
                raise _bad_row(source, i, f"'{key}' is not a chat while other rows are", "give every pair as chats")
            check_chat(row[key], key, i, prompt=key == "prompt")
        if "prompt" not in row and row["chosen"][:-1] != row["rejected"][:-1]:
            raise _bad_row(
                source, i, "chosen and rejected differ before their last turn", "give the shared turns as 'prompt'"
            )
        if row["chosen"] == row["rejected"]:
            raise _bad_row(source, i, "chosen and rejected are the same chat", "a pair must differ; remove the row")


def render_chat_pairs(ds: Any, tokenizer: Any, source: str) -> Any:
    """Conversational pairs as text pairs, rendered as trl renders them: the prompt (the shared turns)
    up to the assistant's cue, each answer the rest of its whole chat rendered."""

    def render(row: dict[str, Any], index: int) -> dict[str, Any]:
        prompt = row.get("prompt") or row["chosen"][:-1]
        cue = render_prompt_chat(tokenizer, prompt, "prompt", index) if prompt else ""
        out = {"prompt": cue}
        for key in ("chosen", "rejected"):
            turns = (row["prompt"] + row[key]) if row.get("prompt") else row[key]
            try:
                whole = tokenizer.apply_chat_template(turns, tokenize=False)
            except Exception as e:  # the template's own raise_exception, or a Jinja error
                raise _bad_row(source, index, f"'{key}' does not render with the chat template: {first_line(e)}",
                               "fix the chat or the template") from None  # fmt: skip
            if not whole.startswith(cue):
                raise _bad_row(source, index, f"the rendered '{key}' does not begin with its rendered prompt",
                               "use a chat template that renders a prompt as the start of its chat")  # fmt: skip
            out[key] = whole[len(cue) :]
        return out

    return ds.map(render, with_indices=True, remove_columns=[k for k in TEXT_KEYS if k in ds.column_names])


def pair_texts(row: dict[str, Any]) -> tuple[str, str]:
    """The two whole texts of a pair a reward model scores: prompt + chosen, prompt + rejected."""
    prompt = row.get("prompt", "")
    return prompt + row["chosen"], prompt + row["rejected"]


def drop_long_pairs(ds: Any, tokenizer: Any, max_length: int, source: str) -> tuple[Any, int]:
    """The pairs whose longer text fits `max_length` tokens, and how many were dropped; none left is an error."""

    def fits(row: dict[str, Any]) -> bool:
        return max(len(tokenizer(t).input_ids) for t in pair_texts(row)) < max_length  # room for an EOS

    kept = ds.filter(fits)
    if len(kept) == 0:
        raise UsageError(f"every pair of {source} is longer than max_length ({max_length} tokens); raise max_length")
    return kept, len(ds) - len(kept)


def train_and_eval_pairs(args: PreferenceArguments, tokenizer: Any, demo_assets: str) -> tuple[Any, Any, int, bool]:
    """The training and held-out pairs that fit `max_length`, how many training pairs did not (said once),
    and whether they were chats (rendered in the chat template)."""
    train = load_pairs(args, args.dataset_split, demo_assets, args.max_samples)
    held_out = load_pairs(args, args.eval_split, demo_assets, args.max_eval_samples)
    chat = is_chat(train[0]["chosen"]) or is_chat(held_out[0]["chosen"])
    if chat:
        if use_chat_template(tokenizer, None):
            print(f"note: the tokenizer has no chat template; {args.dataset}'s chats use fitrl's plain one")
        train, held_out = (render_chat_pairs(ds, tokenizer, args.dataset) for ds in (train, held_out))
    train, dropped = drop_long_pairs(train, tokenizer, args.max_length, args.dataset)
    held_out, _ = drop_long_pairs(held_out, tokenizer, args.max_length, args.dataset)
    if dropped:
        print(f"dropped {dropped} of {dropped + len(train)} training pairs longer than max_length ({args.max_length})")
    return train, held_out, dropped, chat


@dataclass
class PairInputs:
    """What a preference stage (rm, dpo) checks and reads before a model loads."""

    model_path: str
    tokenizer: Any
    train_pairs: Any
    eval_pairs: Any
    dropped: int  # training pairs longer than max_length
    resume: str | None  # the checkpoint to continue from
    checkpoints_existed: bool
    chat: bool  # conversational pairs, rendered in the chat template


def pair_inputs(configs: Sequence[Any], args: Any, checkpoint_prefix: str, what: str) -> PairInputs:
    """A preference stage's preflight: the output directory, the checkpoint to resume, the model's
    tokenizer and every pair, each a one-line usage error before anything heavy loads. `args` is the
    stage's trainer settings among `configs` (`fitrl.stages.base.TrainerSettings`)."""
    from fitrl.checkpoints import checkpoint_root, resume_checkpoint
    from fitrl.demo import DemoArguments
    from fitrl.modeling import ModelArguments, load_tokenizer, resolve_model_path
    from fitrl.outputs import check_output_dir

    model_args, data_args = config_of(configs, ModelArguments), config_of(configs, PreferenceArguments)
    demo_args = config_of(configs, DemoArguments)
    inputs = [model_args.model_name_or_path, data_args.dataset, args.resume_from_checkpoint]
    check_output_dir(args.output_dir, args.overwrite_output_dir, inputs, demo_args.demo_assets)
    resume = resume_checkpoint(
        args.resume_from_checkpoint, args.output_dir, checkpoint_prefix, what, config_dict(*configs)
    )
    existed = checkpoint_root(args.output_dir).exists()
    model_path = resolve_model_path(model_args.model_name_or_path, demo_args.demo_assets)
    tokenizer = load_tokenizer(model_path, model_args.trust_remote_code)
    train, held_out, dropped, chat = train_and_eval_pairs(data_args, tokenizer, demo_args.demo_assets)
    return PairInputs(model_path, tokenizer, train, held_out, dropped, str(resume) if resume else None, existed, chat)
