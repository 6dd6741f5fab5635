"""The sentiment task of the PPO stage: review prompts, the classifier reward, batched generation.

Shared by `scripts/ppo_sentiment.py` (training) and `scripts/evaluate_sentiment.py` (evaluation).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch

from fitrl.config import UsageError, check, help_field
from fitrl.data import load_text_dataset
from fitrl.modeling import resolve_model_path


@dataclass
class PromptArguments:
    """Where prompts come from and how long queries and responses are (the blog's IMDB setup)."""

    dataset: str = help_field("stanfordnlp/imdb", "Hub id, local file/dir, or demo://reviews.")
    dataset_split: str = help_field("train", "Split the prompts come from.")
    text_column: str = help_field("text", "Column holding the review text.")
    min_review_chars: int = help_field(200, "Only reviews longer than this many characters become prompts.")
    max_prompts: int | None = help_field(None, "Use at most this many reviews as prompts (all when empty).")
    query_min_tokens: int = help_field(2, "A query is the first n tokens of a review, n drawn from [min, max].")
    query_max_tokens: int = help_field(8, "Upper end of the query length range.")
    response_min_tokens: int = help_field(4, "Each response gets a length drawn from [min, max] new tokens.")
    response_max_tokens: int = help_field(16, "Upper end of the response length range.")
    stop_at_eos: bool = help_field(
        False,
        "Let a response end at EOS. Off (the blog's setting): EOS is suppressed until the drawn length, so no "
        "response ends on a token the reward model never sees.",
    )

    def validate(self) -> None:
        check(1 <= self.query_min_tokens <= self.query_max_tokens, "query_min_tokens", "in [1, query_max_tokens]")
        check(1 <= self.response_min_tokens <= self.response_max_tokens, "response_min_tokens",
              "in [1, response_max_tokens]")  # fmt: skip
        check(self.max_prompts is None or self.max_prompts >= 1, "max_prompts", "empty or >= 1")


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

    def validate(self) -> None:
        check(self.reward_batch_size >= 1, "reward_batch_size", ">= 1")


def check_reward_label(reward_path: str, positive_label: str) -> None:
    """Stop before any model loads if the classifier has no such label."""
    from transformers import AutoConfig

    labels = list(AutoConfig.from_pretrained(reward_path).id2label.values())
    if positive_label not in labels:
        raise UsageError(f"reward model has no label '{positive_label}' (its labels: {labels}); set positive_label")


class SentimentReward:
    """Scores texts with a sequence classifier, which may use another tokenizer than the policy."""

    def __init__(self, args: RewardArguments, demo_cache_dir: str, device: torch.device):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        path = resolve_model_path(args.reward_model, demo_cache_dir, what="reward model")
        check_reward_label(path, args.positive_label)
        self.model = AutoModelForSequenceClassification.from_pretrained(path).to(device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.label = self.model.config.label2id[args.positive_label]
        self.kind, self.batch_size, self.device = args.reward_kind, args.reward_batch_size, device

    @torch.no_grad()
    def __call__(self, texts: list[str]) -> torch.Tensor:
        scores = []
        for i in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(texts[i : i + self.batch_size], padding=True, truncation=True, return_tensors="pt")
            logits = self.model(**enc.to(self.device)).logits.float()
            if self.kind == "logit":
                scores.append(logits[:, self.label])
            elif self.kind == "probability":
                scores.append(logits.softmax(-1)[:, self.label])
            else:
                others = torch.cat([logits[:, : self.label], logits[:, self.label + 1 :]], dim=1)
                scores.append(logits[:, self.label] - others.max(-1).values)
        return torch.cat(scores).cpu()


def build_queries(tokenizer: Any, args: PromptArguments, demo_cache_dir: str, seed: int) -> list[list[int]]:
    """Token ids of each query: the first n tokens of each long-enough review, n drawn per review."""
    ds = load_text_dataset(args.dataset, args.dataset_split, args.text_column, demo_cache_dir,
                           max_samples=None, min_chars=args.min_review_chars + 1)  # fmt: skip
    if args.max_prompts is not None:
        ds = ds.select(range(min(args.max_prompts, len(ds))))
    rng = random.Random(seed)
    queries = []
    for text in ds["text"]:
        n = rng.randint(args.query_min_tokens, args.query_max_tokens)
        queries.append(tokenizer(text, add_special_tokens=False).input_ids[:n])
    return queries


@contextmanager
def generation_mode(model: Any) -> Iterator[None]:
    """Generate with the KV cache on and gradient checkpointing off (they do not mix), then restore."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    checkpointing = getattr(base, "is_gradient_checkpointing", False)
    use_cache = base.config.use_cache
    was_training = model.training
    if checkpointing:
        base.gradient_checkpointing_disable()
    base.config.use_cache = True
    model.eval()
    try:
        yield
    finally:
        base.config.use_cache = use_cache
        if checkpointing:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train(was_training)


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, so a left-padded query sees the positions it would alone."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


@dataclass
class Rollout:
    """A batch of generated sequences: left-padded queries then right-padded responses."""

    input_ids: torch.Tensor  # (B, Q + R)
    attention_mask: torch.Tensor  # (B, Q + R): 0 on left padding and after each response's end
    response_mask: torch.Tensor  # (B, R): 1 on real response tokens
    query_len: int  # Q: where responses start


@torch.no_grad()
def generate(model: Any, tokenizer: Any, queries: list[list[int]], lengths: list[int], stop_at_eos: bool,
             device: torch.device) -> Rollout:  # fmt: skip
    """Sample one response per query (top_k=0, top_p=1: the policy's own distribution), batched."""
    q_len, r_len = max(len(q) for q in queries), max(lengths)
    pad = tokenizer.pad_token_id
    ids = torch.full((len(queries), q_len), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, q in enumerate(queries):
        ids[i, q_len - len(q) :], mask[i, q_len - len(q) :] = torch.tensor(q), 1
    ids, mask = ids.to(device), mask.to(device)
    with generation_mode(model):
        out = model.generate(
            input_ids=ids, attention_mask=mask, do_sample=True, top_k=0, top_p=1.0, max_new_tokens=r_len,
            # Without stop_at_eos, EOS cannot be sampled before the longest drawn length.
            min_new_tokens=0 if stop_at_eos else r_len, pad_token_id=pad, eos_token_id=tokenizer.eos_token_id,
        )  # fmt: skip
    responses = out[:, q_len:]
    if responses.shape[1] < r_len:  # every sequence hit EOS early
        fill = torch.full((len(queries), r_len - responses.shape[1]), pad, dtype=torch.long, device=device)
        responses = torch.cat([responses, fill], dim=1)
    lengths_t = torch.tensor(lengths, device=device)
    if stop_at_eos:  # a response ends at (and includes) its first EOS
        is_eos = responses == tokenizer.eos_token_id
        first_eos = torch.where(is_eos.any(1), is_eos.float().argmax(1) + 1, r_len)
        lengths_t = torch.minimum(lengths_t, first_eos)
    response_mask = (torch.arange(r_len, device=device)[None] < lengths_t[:, None]).long()
    responses = torch.where(response_mask.bool(), responses, torch.full_like(responses, pad))
    return Rollout(torch.cat([ids, responses], 1), torch.cat([mask, response_mask], 1), response_mask, q_len)


def decode(tokenizer: Any, rollout: Rollout) -> tuple[list[str], list[str]]:
    """Query and response texts (padding removed) for the reward model and the logs."""
    queries, responses = [], []
    for ids, m in zip(rollout.input_ids, rollout.attention_mask):
        q, r = ids[: rollout.query_len], ids[rollout.query_len :]
        queries.append(tokenizer.decode(q[m[: rollout.query_len].bool()], skip_special_tokens=True))
        responses.append(tokenizer.decode(r[m[rollout.query_len :].bool()], skip_special_tokens=True))
    return queries, responses


def response_logits(model: Any, rollout: Rollout, rows: slice | torch.Tensor | None = None, **kw: Any) -> Any:
    """Forward the full sequences; return the model output (logits etc.) for `rows` of the batch."""
    rows = slice(None) if rows is None else rows
    ids, mask = rollout.input_ids[rows], rollout.attention_mask[rows]
    return model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask), **kw)


def response_slice(tensor: torch.Tensor, rollout: Rollout) -> torch.Tensor:
    """Of per-position outputs (B, Q + R, ...), those that predict the response tokens: (B, R, ...)."""
    return tensor[:, rollout.query_len - 1 : -1]


def response_logprobs(model: Any, rollout: Rollout) -> torch.Tensor:
    """log p(response token) under `model` for every response position: (B, R)."""
    from fitrl.ppo import logprobs_from_logits

    logits = response_slice(response_logits(model, rollout).logits, rollout)
    return logprobs_from_logits(logits, rollout.input_ids[:, rollout.query_len :])
