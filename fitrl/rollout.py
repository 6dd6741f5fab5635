"""Sampling responses from a policy: the subtlest code of the RL stages, in one place.

Two contracts:

- `sample_responses` (PPO, sentiment evaluation): token-id queries in, a `Rollout` out: left-padded
  queries then right-padded responses of per-query drawn lengths, with the masks and position ids
  that make a padded row score exactly as it would alone;
- `complete_chats` (GSM8K evaluation, GRPO samples): chat prompts in, completion texts out, greedy or
  `k` samples per prompt.

Shapes: B = sequences, Q = query width (left-padded), R = response width (right-padded), V = vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from fitrl.ppo.core import entropy_from_logits, logprobs_from_logits
from fitrl.tasks.answer_format import render_prompt


@dataclass
class PolicyOutputs:
    """What the sampling pass already computed at each response position, so no second forward of the
    policy is needed: 0 after each response's end."""

    logprobs: torch.Tensor  # (B, R) log p of each sampled token under the policy that sampled it
    entropy: torch.Tensor  # (B, R) entropy of the distribution it was sampled from
    hidden: torch.Tensor  # (B, R, H) the body's last hidden state where each token was predicted


@dataclass
class Rollout:
    """A batch of generated sequences: left-padded queries then right-padded responses."""

    input_ids: torch.Tensor  # (B, Q + R)
    attention_mask: torch.Tensor  # (B, Q + R): 0 on left padding and after each response's end
    response_mask: torch.Tensor  # (B, R): 1 on real response tokens
    query_len: int  # Q: where responses start
    policy: PolicyOutputs | None = None  # kept from generation when asked (`sample_responses(keep_policy=True)`)

    @property
    def responses(self) -> torch.Tensor:
        """The response token ids, pad after each response's end: (B, R)."""
        return self.input_ids[:, self.query_len :]

    def response_ids(self) -> list[list[int]]:
        """Each response's token ids, padding removed (trl's `completion_ids`)."""
        return [ids[m.bool()].tolist() for ids, m in zip(self.responses, self.response_mask)]

    def split(self, size: int) -> list[Rollout]:
        """The same rollout as consecutive row chunks of at most `size` sequences (one layout)."""
        out = []
        for start in range(0, len(self.input_ids), size):
            rows = slice(start, start + size)
            policy = None
            if self.policy is not None:
                p = self.policy
                policy = PolicyOutputs(p.logprobs[rows], p.entropy[rows], p.hidden[rows])
            out.append(
                Rollout(
                    self.input_ids[rows], self.attention_mask[rows], self.response_mask[rows], self.query_len, policy
                )
            )
        return out


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, so a left-padded query sees the positions it would alone."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


@contextmanager
def generation_mode(model: Any) -> Iterator[None]:
    """Generate with the KV cache on and activation checkpointing off (they do not mix), then restore."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    checkpointing = getattr(base, "is_activation_checkpointing", False)
    use_cache = base.config.use_cache
    was_training = model.training
    if checkpointing:
        base.activation_checkpointing_disable()
    base.config.use_cache = True
    model.eval()
    try:
        yield
    finally:
        base.config.use_cache = use_cache
        if checkpointing:
            base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model.train(was_training)


def generation_batch(generation_batch_size: int | None, forward_batch_size: int, batch_size: int) -> int:
    """Prompts per PPO `generate` call: `generation_batch_size`, else the no-grad batch; at most a step's."""
    return min(generation_batch_size or forward_batch_size, batch_size)


def left_pad(queries: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id lists as one left-padded batch: ids (B, Q) and attention mask (B, Q)."""
    width = max(len(q) for q in queries)
    ids = torch.full((len(queries), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, q in enumerate(queries):
        ids[i, width - len(q) :], mask[i, width - len(q) :] = torch.tensor(q), 1
    return ids, mask


@contextmanager
def last_hidden_states(model: Any) -> Iterator[list[torch.Tensor]]:
    """Collect the body's last hidden state (B, T, H) of every forward call of `model` while active.

    A hook on the body, not `output_hidden_states`, which would keep every layer's."""
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    captured: list[torch.Tensor] = []
    hook = lm.base_model.register_forward_hook(lambda _m, _i, out: captured.append(out.last_hidden_state))
    try:
        yield captured
    finally:
        hook.remove()


@torch.no_grad()
def sample_responses(
    model: Any,
    tokenizer: Any,
    queries: list[list[int]],
    lengths: list[int],
    stop_at_eos: bool,
    device: torch.device,
    keep_policy: bool = False,
    sentence_ends: torch.Tensor | None = None,
) -> Rollout:
    """Sample one response of `lengths[i]` tokens per query (top_k=0, top_p=1: the policy's own distribution).

    With `stop_at_eos` a response ends at (and includes) its first EOS; without it EOS cannot be
    sampled before the longest drawn length, and every response is cut to its drawn length.
    `sentence_ends` (`sentence_end_ids`): each response is cut after the last of these tokens within
    its length, where it has one; the tokens after it were sampled and are dropped, as after an EOS.
    `keep_policy`: also keep the log-prob, entropy and last hidden state of each sampled token
    (`PolicyOutputs`), read off the sampling pass itself: the logits before any processor (what
    the sampler drew from, EOS suppression aside) and the KV-cached forward's hidden states. It
    holds the (B, R, V) logits of the generation batch for a moment, as the forward it replaces
    holds those of a no-grad batch.
    """
    r_len, pad = max(lengths), tokenizer.pad_token_id
    ids, mask = left_pad(queries, pad)
    q_len = ids.shape[1]
    ids, mask = ids.to(device), mask.to(device)
    keep = last_hidden_states(model) if keep_policy else nullcontext([])
    with generation_mode(model), keep as hidden:
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            top_k=0,
            top_p=1.0,
            max_new_tokens=r_len,
            min_new_tokens=0 if stop_at_eos else r_len,
            pad_token_id=pad,
            eos_token_id=tokenizer.eos_token_id,
            output_logits=keep_policy,
            return_dict_in_generate=True,
        )
    # Drop the output's KV cache (51 MiB for the TRL benchmark's 128 prompts) before the policy outputs.
    sequences, step_logits = out.sequences, out.logits
    del out
    responses = sequences[:, q_len:]
    if responses.shape[1] < r_len:  # every sequence hit EOS early
        fill = torch.full((len(queries), r_len - responses.shape[1]), pad, dtype=torch.long, device=device)
        responses = torch.cat([responses, fill], dim=1)
    lengths_t = torch.tensor(lengths, device=device)
    positions = torch.arange(r_len, device=device)[None]
    if stop_at_eos:
        is_eos = responses == tokenizer.eos_token_id
        first_eos = torch.where(is_eos.any(1), is_eos.float().argmax(1) + 1, r_len)
        lengths_t = torch.minimum(lengths_t, first_eos)
    if sentence_ends is not None:
        is_end = torch.isin(responses, sentence_ends.to(device)) & (positions < lengths_t[:, None])
        last_end = r_len - 1 - is_end.flip(1).int().argmax(1)
        lengths_t = torch.where(is_end.any(1), last_end + 1, lengths_t)
    response_mask = (positions < lengths_t[:, None]).long()
    responses = torch.where(response_mask.bool(), responses, torch.full_like(responses, pad))
    policy = _policy_outputs(step_logits, hidden, responses, response_mask) if keep_policy else None
    return Rollout(torch.cat([ids, responses], 1), torch.cat([mask, response_mask], 1), response_mask, q_len, policy)


def sentence_end_ids(tokenizer: Any) -> torch.Tensor:
    """The ids of the tokens whose text ends a sentence ('.', '!' or '?', trailing spaces aside)."""
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    return torch.tensor([i for i, t in enumerate(texts) if t.rstrip().endswith((".", "!", "?"))], dtype=torch.long)


def _policy_outputs(
    step_logits: tuple[torch.Tensor, ...], hidden: list[torch.Tensor], responses: torch.Tensor, mask: torch.Tensor
) -> PolicyOutputs:
    # One forward per generated token: the prefill's last position predicts the first response token,
    # each later call the next one. Generation may stop early (every row at EOS): the rest is padding.
    # A step at a time, each (B, V) logits as one row: no (B, steps, V) copy of them all.
    steps = len(step_logits)
    h = torch.cat([x[:, -1:] for x in hidden[:steps]], 1)  # (B, steps, H)
    pad = responses.shape[1] - steps
    fields = [
        torch.stack([logprobs_from_logits(x[None], responses[None, :, t])[0] for t, x in enumerate(step_logits)], 1),
        torch.stack([entropy_from_logits(x[None])[0] for x in step_logits], 1),
    ]
    logprobs, entropy = (torch.nn.functional.pad(f, (0, pad)) * mask for f in fields)
    h = torch.nn.functional.pad(h, (0, 0, 0, pad)) * mask[..., None]
    return PolicyOutputs(logprobs, entropy, h)


def decode(tokenizer: Any, rollout: Rollout) -> tuple[list[str], list[str]]:
    """Query and response texts (padding removed) for the reward model and the logs."""
    queries, responses = [], []
    for ids, m in zip(rollout.input_ids, rollout.attention_mask):
        q, r = ids[: rollout.query_len], ids[rollout.query_len :]
        queries.append(tokenizer.decode(q[m[: rollout.query_len].bool()], skip_special_tokens=True))
        responses.append(tokenizer.decode(r[m[rollout.query_len :].bool()], skip_special_tokens=True))
    return queries, responses


def rendered_queries(tokenizer: Any, rollout: Rollout) -> list[str]:
    """The queries as the policy's tokens spell them, special tokens kept (a chat in its template, as the rm
    stage renders conversational pairs), padding removed; a leading BOS is left to the scorer's tokenizer,
    which adds its own."""
    bos = tokenizer.bos_token
    adds_bos = bos is not None and tokenizer("x").input_ids[:1] == [tokenizer.bos_token_id]
    out = []
    for ids, m in zip(rollout.input_ids, rollout.attention_mask):
        text = tokenizer.decode(ids[: rollout.query_len][m[: rollout.query_len].bool()], skip_special_tokens=False)
        out.append(text[len(bos) :] if adds_bos and text.startswith(bos) else text)
    return out


def forward(model: Any, rollout: Rollout, **kw: Any) -> Any:
    """The model's output on the full sequences, with the positions that skip left padding."""
    mask = rollout.attention_mask
    return model(input_ids=rollout.input_ids, attention_mask=mask, position_ids=position_ids(mask), **kw)


def response_slice(tensor: torch.Tensor, rollout: Rollout) -> torch.Tensor:
    """Of per-position outputs (B, Q + R, ...), those that predict the response tokens: (B, R, ...)."""
    return tensor[:, rollout.query_len - 1 : -1]


def response_window(batch: Any) -> int:
    """`logits_to_keep` for a batch of left-padded queries and right-padded responses: R + 1 positions.

    The last R + 1 positions hold the R that predict the response tokens and the final one (which
    predicts past the end): `logits[:, :-1]` of those is `response_slice` of the full logits.
    """
    return batch.responses.shape[1] + 1


def response_logprobs(model: Any, rollout: Rollout) -> torch.Tensor:
    """log p(response token) under `model` for every response position: (B, R)."""
    logits = forward(model, rollout, logits_to_keep=response_window(rollout)).logits[:, :-1]
    return logprobs_from_logits(logits, rollout.responses)


def complete_chats(
    model: Any,
    tokenizer: Any,
    prompts: list[list[dict[str, str]]],
    max_new_tokens: int,
    num_samples: int = 1,
    temperature: float = 0.0,
    batch_size: int = 16,
    progress: Any = None,
) -> list[list[str]]:
    """`num_samples` completion texts per chat prompt, greedy when `temperature` is 0, in left-padded batches."""
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
