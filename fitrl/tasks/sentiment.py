"""The sentiment task: review prompts (read, shaped and tokenized as PPO and its evaluation read them),
the corpus-word measure, and the judge that grades responses apart from the reward PPO trains against.

Shared by `fitrl.scripts.ppo` (training) and `fitrl.scripts.eval` (evaluation).
"""

from __future__ import annotations

import dataclasses
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from fitrl.chat import CHAT_TEMPLATE_HELP, check_chat, is_chat, render_prompt_chat, use_chat_template
from fitrl.config import UsageError, check, help_field
from fitrl.data import load_column
from fitrl.modeling import resolve_model_path
from fitrl.reward.classifier import ClassifierReward, check_reward_label
from fitrl.reward.settings import RewardArguments
from fitrl.rollout import sentence_end_ids


@dataclass
class PromptArguments:
    """Where prompts come from, how each becomes a query, and how long responses are."""

    dataset: str = help_field("stanfordnlp/imdb", "Hub id, local file/dir, or demo://reviews.")
    dataset_split: str = help_field("train", "Split the prompts come from.")
    text_column: str = help_field(
        "text",
        "Column holding each prompt: a text, or a chat (a list of role/content messages, e.g. 'messages') "
        "rendered with the chat template up to the assistant's turn.",
    )
    chat_template: str | None = help_field(None, CHAT_TEMPLATE_HELP)
    prompt_shaping: Literal["whole", "prefix"] = help_field(
        "whole",
        "'whole': each prompt as it is. 'prefix': only the first n tokens of each text, n drawn from "
        "[query_min_tokens, query_max_tokens] (the blog's IMDB task: continue a review's opening).",
    )
    max_prompt_tokens: int = help_field(
        256, "A whole prompt longer than this many tokens is dropped or cut (prompt_overflow); counted, reported."
    )
    prompt_overflow: Literal["drop", "left_truncate"] = help_field(
        "drop", "'left_truncate': keep a long prompt's last max_prompt_tokens tokens (its end: the assistant's cue)."
    )
    min_prompt_chars: int = help_field(
        0, "Prompts of this many characters or fewer are dropped (counted and reported); the IMDB profiles: 200."
    )
    max_prompts: int | None = help_field(None, "Use at most this many prompts (all when empty).")
    query_min_tokens: int = help_field(2, "prompt_shaping prefix: a query is a text's first n tokens, n >= this.")
    query_max_tokens: int = help_field(8, "prompt_shaping prefix: the upper end of n.")
    response_min_tokens: int = help_field(4, "Each response gets a length drawn from [min, max] new tokens.")
    response_max_tokens: int = help_field(16, "Upper end of the response length range.")
    response_end: Literal["length", "sentence"] = help_field(
        "length",
        "'sentence': cut each response after its last '.', '!' or '?' within its drawn length (one without keeps "
        "its length), so a reward model trained on whole texts scores whole sentences, not a text cut mid-word.",
    )
    stop_at_eos: bool | None = help_field(
        None,
        "Let a response end at EOS. Empty: for chats, whose turn ends there, yes; for texts, no (the blog's "
        "setting): EOS is suppressed until the drawn length, so no response ends on a token the reward model "
        "never sees.",
    )
    system_prompt: str | None = help_field(
        None,
        "Texts become chats: this system message, then the text as the user's turn, rendered with the chat "
        "template up to the assistant's turn (a chat model asked plain questions; the arithmetic PPO config).",
    )

    def validate(self) -> None:
        check(1 <= self.query_min_tokens <= self.query_max_tokens, "query_min_tokens", "in [1, query_max_tokens]")
        check(
            1 <= self.response_min_tokens <= self.response_max_tokens,
            "response_min_tokens",
            "in [1, response_max_tokens]",
        )
        check(self.max_prompts is None or self.max_prompts >= 1, "max_prompts", "empty or >= 1")
        check(self.max_prompt_tokens >= 1, "max_prompt_tokens", ">= 1")
        check(self.min_prompt_chars >= 0, "min_prompt_chars", ">= 0")
        if self.system_prompt is not None and self.prompt_shaping == "prefix":
            raise UsageError("system_prompt makes each text a chat, which prompt_shaping prefix cannot cut; "
                             "set prompt_shaping whole")  # fmt: skip

    def stops_at_eos(self, chat: bool) -> bool:
        """Whether a response ends at EOS, for prompts that are chats (`chat`) or texts."""
        return chat if self.stop_at_eos is None else self.stop_at_eos

    def sentence_ends(self, tokenizer: Any) -> torch.Tensor | None:
        """The tokens a response is cut after (`response_end: sentence`; `sample_responses`), else None."""
        return sentence_end_ids(tokenizer) if self.response_end == "sentence" else None

    @property
    def longest_query(self) -> int:
        """The most tokens a query can have."""
        return self.query_max_tokens if self.prompt_shaping == "prefix" else self.max_prompt_tokens


LEXICON_JUDGE = "demo://lexicon"


def check_judge(judge_model: str, positive_label: str, demo_assets: str) -> None:
    """Before any model loads: a judge is the demo's lexicon or a trained classifier with that label."""
    if judge_model != LEXICON_JUDGE:
        check_reward_label(resolve_model_path(judge_model, demo_assets, "judge model"), positive_label)


class SentimentJudge:
    """A second opinion the policy never trained against: +1 (positive), -1 (negative) or 0 per text.

    `demo://lexicon` is the demo corpus generator's own rule reader (`fitrl.demo.corpus.opinion_polarity`),
    which reads sentiment from the words the corpus uses for opinions; anything else is a sequence
    classifier (hub id or local dir) whose `positive_label` wins or not. Reward hacking shows as a
    reward that rises while the judge does not follow.
    """

    def __init__(self, judge_model: str, positive_label: str, demo_assets: str, device: torch.device):
        self.name = judge_model
        self.classifier = None
        if judge_model != LEXICON_JUDGE:
            args = RewardArguments(reward_model=judge_model, positive_label=positive_label, reward_batch_size=16)
            self.classifier = ClassifierReward(args, demo_assets, device)

    def __call__(self, texts: list[str]) -> torch.Tensor:
        if self.classifier is None:
            from fitrl.demo.corpus import opinion_polarity

            return torch.tensor([opinion_polarity(t) for t in texts]).sign().float()
        return self.classifier.classify(texts)[1].float() * 2 - 1


def prompt_texts(args: PromptArguments, split: str, demo_assets: str) -> list[str]:
    """The text of every prompt row of `split`: a chat's messages joined, blank rows left out."""
    values, chat = read_prompts(dataclasses.replace(args, dataset_split=split), demo_assets)
    texts = ["\n".join(m["content"] for m in v) if chat else v for v in values if v]
    return [t for t in texts if isinstance(t, str) and t.strip()]


def corpus_vocabulary(texts: list[str]) -> set[str]:
    return {w for t in texts for w in words(t)}


def words(text: str) -> list[str]:
    """The lower-cased alphabetic words of `text` (numbers and punctuation are no words)."""
    return re.findall(r"[a-z]+", text.lower())


def corpus_word_share(queries: list[str], responses: list[str], vocabulary: set[str]) -> float:
    """Share of the words the responses wrote that are words of the corpus: near 1 for text of the
    corpus's kind, low for word salad; 1.0 when the responses hold no words.

    Each response is read after its query, because prompts are cut at a token and responses go on
    mid-word ("The Endl" + "ess Road" is "Endless Road", not "ess"): a word counts when it ends inside
    the response. A last word that runs into the length limit ("in a lightho") is left out, unless it is
    the response's only word.
    """
    found = []
    for query, response in zip(queries, responses, strict=True):
        text = (query + response).lower()
        spans = [m for m in re.finditer(r"[a-z]+", text) if m.end() > len(query)]
        if len(spans) > 1 and spans[-1].end() == len(text):
            spans.pop()
        found += [m.group() for m in spans]
    return sum(w in vocabulary for w in found) / len(found) if found else 1.0


@dataclass
class Queries:
    """The prompts as token ids, and what became of the rows that are not among them."""

    ids: list[list[int]]
    rows: int  # rows read
    short: int  # dropped: no text, or min_prompt_chars characters or fewer
    long: int  # dropped: over max_prompt_tokens
    cut: int  # left-truncated to max_prompt_tokens
    chat: bool  # rendered from chats
    plain_template: bool  # with the plain template, the tokenizer having none
    columns: dict[str, list[Any]] = dataclasses.field(default_factory=dict)  # reward_columns, one per query

    def __len__(self) -> int:
        return len(self.ids)

    def add(self, ids: list[int], columns: dict[str, list[Any]], row: int) -> None:
        """A query, and the values of `columns` at its dataset `row`."""
        self.ids.append(ids)
        for name, column in columns.items():
            self.columns.setdefault(name, []).append(column[row])

    def summary(self, args: PromptArguments) -> str:
        kind = "chats" if self.chat else "texts"
        parts = [f"{len(self.ids)} prompts from {self.rows} {kind} of {args.dataset}"]
        if self.short:
            size = "empty" if args.min_prompt_chars == 0 else f"{args.min_prompt_chars} characters or fewer"
            parts.append(f"{self.short} dropped: {size}")
        if self.long:
            parts.append(f"{self.long} dropped: over {args.max_prompt_tokens} tokens")
        if self.cut:
            parts.append(f"{self.cut} cut to their last {args.max_prompt_tokens} tokens")
        if self.plain_template:
            parts.append("the tokenizer has no chat template: the plain Question/Answer one renders them")
        return "; ".join(parts)


def read_prompts(args: PromptArguments, demo_assets: str, rows: int | None = None) -> tuple[list[Any], bool]:
    """The prompt column's values (the first `rows`), and whether they are chats, each checked."""
    values = load_column(args.dataset, args.dataset_split, args.text_column, demo_assets)[:rows]
    if args.system_prompt is not None:  # a text becomes a chat; a row without one stays empty (too short)
        system = {"role": "system", "content": args.system_prompt}
        values = [[system, {"role": "user", "content": v}] if isinstance(v, str) else None for v in values]
    chat = any(is_chat(v) for v in values)
    if chat and args.prompt_shaping == "prefix":
        raise UsageError(
            f"column '{args.text_column}' holds chats, which prompt_shaping prefix cannot cut; set prompt_shaping whole"
        )
    for row, value in enumerate(values if chat else []):
        if value is not None:  # a row without one counts as too short
            check_chat(value, args.text_column, row, prompt=True)
    return values, chat


def build_queries(
    tokenizer: Any, args: PromptArguments, demo_assets: str, seed: int, columns: Sequence[str] = ()
) -> Queries:
    """Token ids of each query: a whole prompt (a chat rendered up to the assistant's turn), or the first n
    tokens of a text with n drawn per text (`prompt_shaping: prefix`); and each kept row's `columns`."""
    values, chat = read_prompts(args, demo_assets)
    plain_template = chat and use_chat_template(tokenizer, args.chat_template)
    rng = random.Random(seed)
    queries = Queries([], len(values), 0, 0, 0, chat, plain_template)
    wanted = {c: load_column(args.dataset, args.dataset_split, c, demo_assets) for c in columns}
    for row, value in enumerate(values):
        if args.max_prompts is not None and len(queries.ids) == args.max_prompts:
            break
        if chat:
            content = "".join(m["content"] for m in value or [])
        else:
            content = value if isinstance(value, str) else ""
        if len(content.strip()) <= args.min_prompt_chars:
            queries.short += 1
            continue
        if args.prompt_shaping == "prefix":
            n = rng.randint(args.query_min_tokens, args.query_max_tokens)
            queries.add(tokenizer(content, add_special_tokens=False).input_ids[:n], wanted, row)
            continue
        if chat:  # the template writes the special tokens itself
            ids = tokenizer(
                render_prompt_chat(tokenizer, value, args.text_column, row), add_special_tokens=False, verbose=False
            )
        else:
            ids = tokenizer(content, verbose=False)  # a long one is counted below, not warned about
        ids = ids.input_ids
        if len(ids) > args.max_prompt_tokens:
            if args.prompt_overflow == "drop":
                queries.long += 1
                continue
            ids, queries.cut = ids[-args.max_prompt_tokens :], queries.cut + 1
        queries.add(ids, wanted, row)
    if not queries.ids:
        raise UsageError(f"dataset {args.dataset} gives no prompts: {queries.summary(args)}; check its rows")
    return queries
