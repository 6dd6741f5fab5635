"""The sentiment task of the PPO stage: review prompts and the classifier reward.

Shared by `fitrl.scripts.ppo` (training) and `fitrl.scripts.eval` (evaluation).
"""

from __future__ import annotations

import dataclasses
import random
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from fitrl.adapter_reward import AdapterReward, SeparateAdapterReward, separate_base
from fitrl.chat import CHAT_TEMPLATE_HELP, check_chat, is_chat, render_prompt_chat, use_chat_template
from fitrl.config import UsageError, check, first_line, help_field
from fitrl.data import load_column
from fitrl.modeling import load_classifier, loading_errors, resolve_model_path
from fitrl.reward import Reward, TextReward
from fitrl.reward_funcs import Checked, resolve, trl_keywords
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


@dataclass
class RewardArguments:
    """The reward: a text classifier's opinion of query + response."""

    reward_model: str = help_field(
        "lvwerra/distilbert-imdb", "Sequence classifier (hub id, local dir, demo://classifier) scoring the text."
    )
    positive_label: str = help_field("POSITIVE", "The classifier's label whose score is the reward.")
    reward_kind: Literal["logit", "probability", "margin"] = help_field(
        "logit", "Score: the positive logit (the blog), its softmax probability, or its margin over the best other."
    )
    reward_batch_size: int = help_field(16, "Texts per classifier forward pass.")
    reward_dtype: Literal["float32", "bfloat16", "float16"] = help_field(
        "float32", "The reward model's dtype: bfloat16 / float16 halve its memory (the planner counts it)."
    )
    reward_quantization: Literal["none", "8bit", "4bit"] = help_field(
        "none",
        "Load the reward model's linear layers in 8-bit or 4-bit (bitsandbytes), its classification head in "
        "reward_dtype: a 7B reward model beside a policy on one card.",
    )
    reward_adapter: str | None = help_field(
        None,
        "An rm stage's output (its LoRA adapter and score head) to score with instead of reward_model. Trained "
        "on model_name_or_path, it runs on the policy's own backbone (no second model); trained on another "
        "model, it is loaded on its own copy of that model (the planner counts it).",
    )
    reward_adapter_shared: bool = help_field(
        True,
        "false: load reward_adapter on its own copy of its base even when that is the policy's (costs that base's "
        "memory again: for comparison).",
    )
    reward_function: str | None = help_field(
        None,
        "A Python function to score with instead of a model: a registry name (accuracy, ...), module:function or "
        "path/to/file.py:function, called as trl calls a reward function: fn(prompts=queries, "
        "completions=responses, **columns of reward_columns), one number per response (positive: above 0; "
        "fitrl.reward_funcs). A GRPO reward function works unchanged.",
    )

    reward_columns: list[str] = help_field(
        [],
        "Columns of the prompt dataset handed to reward_function beside each prompt, by name, as trl hands a "
        "dataset's columns to a reward function (e.g. [answer] for the accuracy reward).",
    )

    def validate(self) -> None:
        check(self.reward_batch_size >= 1, "reward_batch_size", ">= 1")
        if self.reward_function and self.reward_adapter:
            raise UsageError("give reward_function or reward_adapter, not both: each replaces reward_model")


def check_reward_label(reward_path: str, positive_label: str, reward_kind: str = "logit") -> None:
    """Stop before any model loads if the reward model is no trained classifier, has no such label, or is a
    scalar reward model (one output, `num_labels=1`) asked for a score only a classifier has."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(reward_path, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot load the reward model's config from {reward_path}: {first_line(e)}") from None
    architectures = config.architectures or []
    if architectures and not any(a.endswith("ForSequenceClassification") for a in architectures):
        raise UsageError(
            f"reward model {reward_path} is a {architectures[0]}, not a trained sequence classifier "
            "(its classification head would be newly initialized); give a ...ForSequenceClassification model"
        )
    if config.num_labels == 1:  # a scalar reward model: its one output is the reward, it has no labels
        if reward_kind != "logit":
            raise UsageError(
                f"reward model {reward_path} has one output (a scalar reward model), so reward_kind "
                f"'{reward_kind}' would be constant; set reward_kind logit (the output itself)"
            )
        return
    labels = list(config.id2label.values())
    if positive_label not in labels:
        raise UsageError(f"reward model has no label '{positive_label}' (its labels: {labels}); set positive_label")


def check_reward(
    args: RewardArguments, model_name: str, model_path: str, demo_assets: str, stage: str, producer: str
) -> str | None:
    """The reward of `stage`, checked before any model loads: a trained classifier with the positive label,
    an adapter of the `producer` stage whose base can be loaded (the policy's own, or another), or a
    function that imports. Returns the base that adapter is loaded on by itself (`separate_base`), else
    None."""
    if args.reward_function:
        FunctionReward(args)
        return None
    if not args.reward_adapter:
        reward_path = resolve_model_path(args.reward_model, demo_assets, what="reward model")
        check_reward_label(reward_path, args.positive_label, args.reward_kind)
        return None
    if not Path(args.reward_adapter).expanduser().is_dir():
        raise UsageError(f"reward_adapter {args.reward_adapter} does not exist; give the output_dir of an rm run")
    shared = args.reward_adapter_shared
    return separate_base(args.reward_adapter, model_name, model_path, demo_assets, shared, stage, producer)


class SentimentReward(TextReward):
    """Scores texts with a sequence classifier, which may use another tokenizer than the policy."""

    def __init__(self, args: RewardArguments, demo_assets: str, device: torch.device):
        from transformers import AutoTokenizer

        path = resolve_model_path(args.reward_model, demo_assets, what="reward model")
        check_reward_label(path, args.positive_label, args.reward_kind)
        model, loading = load_classifier(path, args.reward_dtype, args.reward_quantization)
        if loading["missing_keys"]:
            missing = sorted(loading["missing_keys"])
            raise UsageError(
                f"reward model {path} has no saved weights for {missing[0]} ({len(missing)} missing): its "
                "classification head would be random; give a trained ...ForSequenceClassification model"
            )
        # bitsandbytes places a quantized model as it loads it
        self.model = model if args.reward_quantization != "none" else model.to(device)
        with loading_errors("reward model", path):
            self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
        if self.tokenizer.pad_token is None:  # common in decoder reward models: batches need one
            if self.tokenizer.eos_token is None:
                raise UsageError(f"reward model {path}: its tokenizer has neither a pad nor an EOS token; add one")
            self.tokenizer.pad_token = self.tokenizer.eos_token
            print(f"note: reward model {path} has no pad token; padding with its EOS token", file=sys.stderr)
        if self.model.config.pad_token_id is None:  # a decoder classifier reads its head at the last non-pad token
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        # A scalar reward model (one output) is its own reward; a classifier's is its positive label's.
        self.scalar = self.model.config.num_labels == 1
        self.label = 0 if self.scalar else self.model.config.label2id[args.positive_label]
        self.kind, self.batch_size, self.device = args.reward_kind, args.reward_batch_size, device
        self.held = self.model

    @torch.no_grad()
    def classify(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(scores, called positive): the reward of each text, and whether the positive label wins (a scalar
        reward model: whether its output is above 0)."""
        scores, positive = [], []
        for i in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(texts[i : i + self.batch_size], padding=True, truncation=True, return_tensors="pt")
            logits = self.model(**enc.to(self.device)).logits.float()
            positive.append(logits[:, 0] > 0 if self.scalar else logits.argmax(-1) == self.label)
            if self.kind == "logit":
                scores.append(logits[:, self.label])
            elif self.kind == "probability":
                scores.append(logits.softmax(-1)[:, self.label])
            else:
                others = torch.cat([logits[:, : self.label], logits[:, self.label + 1 :]], dim=1)
                scores.append(logits[:, self.label] - others.max(-1).values)
        return torch.cat(scores).cpu(), torch.cat(positive).cpu()


class FunctionReward:
    """Scores responses with a Python function (`reward_function`) called as trl calls one:
    `fn(prompts=..., completions=..., **columns)`, each output checked (`fitrl.reward_funcs`). It reads the
    text itself (no tokenizer between it and the policy's text) and holds no tensors."""

    tokenizer = None

    def __init__(self, args: RewardArguments) -> None:
        self.function = Checked(args.reward_function, resolve(args.reward_function, "reward_function"))
        self.function.check(args.reward_columns, "reward_function")

    def score(
        self, queries: Sequence[str], responses: Sequence[str], columns: Mapping[str, Sequence[Any]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(scores, called positive: above 0); a None score (the function abstains) counts as 0."""
        ids = columns.get("completion_ids", [[] for _ in responses])
        data = {k: v for k, v in columns.items() if k != "completion_ids"}
        values = self.function(list(responses), **trl_keywords(list(queries), list(ids)), **data)
        scores = torch.tensor([0.0 if v is None else float(v) for v in values])
        return scores, scores > 0

    def tensors(self) -> list[torch.Tensor]:
        return []


def load_reward(
    args: RewardArguments,
    demo_assets: str,
    device: torch.device,
    reward_base: str | None = None,
    policy: Any = None,
    tokenizer: Any = None,
) -> Reward | None:
    """The reward `args` name, its kind decided here once: a function, a sequence classifier, an rm
    stage's adapter on its own copy of `reward_base` (`check_reward` says which base), or one on the
    policy's own backbone, which needs the `policy` (a peft model) and its `tokenizer`: None until given."""
    if args.reward_function:
        return FunctionReward(args)
    if not args.reward_adapter:
        return SentimentReward(args, demo_assets, device)
    if reward_base is not None:
        return SeparateAdapterReward(reward_base, args, device)
    if policy is None:
        return None
    return AdapterReward(policy, args.reward_adapter, tokenizer, args.reward_batch_size)


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
            self.classifier = SentimentReward(args, demo_assets, device)

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
