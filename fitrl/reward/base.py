"""The one reward type every scorer is: texts in, scores out, and what it holds in memory.

PPO trains against a `Reward` and knows nothing else of it. The kinds: a sequence classifier
(`fitrl.reward.classifier.ClassifierReward`), a Python function (`fitrl.reward.functions.FunctionReward`),
an rm stage's adapter on the policy's own backbone (`fitrl.reward.adapter.AdapterReward`) or on its own
copy of its base (`SeparateAdapterReward`); `fitrl.reward.factory.load_reward` picks one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch


class Reward(Protocol):
    """A scorer of responses to queries.

    `tokenizer`: the tokenizer it reads the text with, for the check that the text survives it (None:
    it reads the text itself). `columns`: the prompts' dataset columns for this batch (`gold` ...) and
    `completion_ids` (each response's token ids), one value per text, for scorers that grade with them.
    """

    tokenizer: Any
    # True: it reads each query as the policy's tokens spell it, special tokens kept (a chat in its
    # template, as the rm stage trained on rendered chats); False: as text without special tokens.
    rendered: bool

    def score(
        self, queries: Sequence[str], responses: Sequence[str], columns: Mapping[str, Sequence[Any]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One score per response (B,), and whether each is called positive (B,), on the CPU."""
        ...

    def tensors(self) -> list[torch.Tensor]:
        """The tensors it holds beside the policy's (none for a function): the memory measurement counts them."""
        ...


class TextReward:
    """The common part of the scorers: a model reads the whole text (query + response), and `classify`
    is the one method each writes; `held` is the module it keeps beside the policy (None: nothing)."""

    tokenizer: Any = None
    held: torch.nn.Module | None = None
    rendered = False

    def classify(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(scores, called positive) of each text, on the CPU."""
        raise NotImplementedError

    def score(
        self, queries: Sequence[str], responses: Sequence[str], columns: Mapping[str, Sequence[Any]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.classify([q + r for q, r in zip(queries, responses)])

    def tensors(self) -> list[torch.Tensor]:
        return [] if self.held is None else [*self.held.parameters(), *self.held.buffers()]
