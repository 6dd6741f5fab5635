"""The PPO step in the package (`fitrl.ppo.step`): the experience batch, one micro-step's loss worked by
hand, and the update's early stopping, on models small enough to reason about."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

from fitrl.ppo.step import Experience, micro_step_loss, ppo_update
from fitrl.stages.ppo import PPOArguments

PAD = 9


def _part(queries: list[list[int]], responses: list[list[int]], fill: float) -> Experience:
    """An experience chunk whose queries are left-padded and responses right-padded to the chunk's widths."""
    q, r = max(map(len, queries)), max(map(len, responses))
    ids = torch.tensor([[PAD] * (q - len(a)) + a + b + [PAD] * (r - len(b)) for a, b in zip(queries, responses)])
    mask = torch.tensor(
        [[0] * (q - len(a)) + [1] * (len(a) + len(b)) + [0] * (r - len(b)) for a, b in zip(queries, responses)]
    )
    response_mask = torch.tensor([[1.0] * len(b) + [0.0] * (r - len(b)) for b in responses])
    per_token = {k: response_mask * (fill + i) for i, k in enumerate(["logprobs", "values", "kl", "entropy"])}
    return Experience(input_ids=ids, attention_mask=mask, response_mask=response_mask, query_len=q, **per_token)


def test_cat_pads_every_part_to_one_layout_and_select_takes_rows_of_every_field() -> None:
    a = _part([[1, 2, 3]], [[4]], fill=1.0)  # Q = 3, R = 1
    b = _part([[5], [6, 7]], [[8, 8, 8], [8]], fill=10.0)  # Q = 2, R = 3
    exp = Experience.cat([a, b], PAD)
    assert exp.query_len == 3 and exp.input_ids.shape == (3, 6)
    assert exp.input_ids.tolist() == [[1, 2, 3, 4, PAD, PAD], [PAD, PAD, 5, 8, 8, 8], [PAD, 6, 7, 8, PAD, PAD]]
    assert exp.attention_mask.tolist() == [[1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0]]
    assert exp.responses.tolist() == [[4, PAD, PAD], [8, 8, 8], [8, PAD, PAD]]
    assert exp.response_mask.tolist() == [[1, 0, 0], [1, 1, 1], [1, 0, 0]]
    assert exp.logprobs.tolist() == [[1, 0, 0], [10, 10, 10], [10, 0, 0]]  # right-padded with 0
    assert exp.entropy.tolist() == [[4, 0, 0], [13, 13, 13], [13, 0, 0]]
    assert exp.advantages is None and exp.returns is None  # not filled yet: stay empty

    exp.advantages, exp.returns = exp.logprobs * 2, exp.logprobs * 3
    picked = exp.select(torch.tensor([2, 0]))
    for f in Experience.tensor_fields():
        assert torch.equal(getattr(picked, f.name), getattr(exp, f.name)[[2, 0]]), f.name
    assert picked.query_len == 3


class FixedOutputs(nn.Module):
    """A 'model' whose logits (R + 1 positions, shared by every row) and values are its parameters."""

    def __init__(self, logits: list[list[float]], values: list[float]):
        super().__init__()
        self.logits = nn.Parameter(torch.tensor([logits]))
        self.value = nn.Parameter(torch.tensor([values]))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int = 0):
        rows = input_ids.shape[0]
        return self.logits.expand(rows, -1, -1)[:, -logits_to_keep:], self.value.expand(rows, -1)


def _one_query_batch(rows: int = 1) -> Experience:
    """Query [0], response [1, 0] whose second token is padding; p_old(1) = 1/2, A = 1, V_old = 0, R = 1."""
    ones = torch.ones(rows, 2)
    return Experience(
        input_ids=torch.tensor([[0, 1, 0]] * rows),
        attention_mask=torch.tensor([[1, 1, 0]] * rows),
        response_mask=torch.tensor([[1.0, 0.0]] * rows),
        logprobs=ones * math.log(0.5),
        values=ones * 0.0,
        kl=ones * 0.0,
        entropy=ones * 0.0,
        query_len=1,
        advantages=ones,
        returns=ones,
    )


def test_one_micro_step_against_a_hand_computed_loss() -> None:
    # The new policy gives the response token p = 3/4: ratio 1.5, clipped to 1.2 with A = 1, so the
    # policy loss is max(-1.5, -1.2) = -1.2. The value 2 against a return of 1: clipped to 0 + 0.2,
    # (0.2 - 1)^2 = 0.64 < (2 - 1)^2 = 1, so 0.5 * 1 = 0.5. Loss: -1.2 + 0.1 * 0.5 = -1.15.
    model = FixedOutputs([[0.0, math.log(3.0)], [5.0, -5.0], [0.0, 0.0]], [2.0, -7.0, 3.0])
    args = PPOArguments(cliprange=0.2, cliprange_value=0.2, vf_coef=0.1, ratio_threshold=10.0)
    loss, stats = micro_step_loss(model, _one_query_batch(), args)
    assert loss.item() == pytest.approx(-1.15, abs=1e-6)
    assert stats.pg_loss.item() == pytest.approx(-1.2, abs=1e-6)
    assert stats.vf_loss.item() == pytest.approx(0.5, abs=1e-6)
    assert stats.ratio.item() == pytest.approx(1.5, abs=1e-6)
    assert stats.approx_kl.item() == pytest.approx(0.5 * math.log(1.5) ** 2, abs=1e-6)
    assert (stats.clipfrac.item(), stats.vf_clipfrac.item(), stats.skipped.item()) == (1.0, 0.0, 0.0)
    loss.backward()
    assert model.logits.grad[0, 1:].abs().sum() == 0  # the padded response position teaches nothing

    # a ratio over the threshold: the batch is skipped, its loss 0
    skipped, stats = micro_step_loss(model, _one_query_batch(), dataclasses.replace(args, ratio_threshold=1.4))
    assert skipped.item() == 0.0 and stats.skipped.item() == 1.0


class CountingSGD(torch.optim.SGD):
    def __init__(self, params, lr: float):
        super().__init__(params, lr=lr)
        self.steps = 0

    def step(self, closure=None):
        self.steps += 1
        return super().step(closure)


@pytest.mark.parametrize(("early_stopping", "steps"), [(False, 8), (True, 2)])
def test_early_stopping_ends_the_epochs_once_the_policy_kl_passes_its_bar(early_stopping: bool, steps: int) -> None:
    """4 epochs of 2 micro-batches each; with early stopping and a tiny KL bar the first epoch, in which
    the second micro-batch already sees the policy the first one moved, is the last."""
    from accelerate import Accelerator

    model = FixedOutputs([[0.0, 0.0], [0.0, 0.0], [0.0, 0.0]], [0.0, 0.0, 0.0])
    optimizer = CountingSGD(model.parameters(), lr=1.0)
    args = PPOArguments(
        batch_size=4, mini_batch_size=2, ppo_epochs=4, early_stopping=early_stopping, target_policy_kl=1e-6
    )
    stats = ppo_update(model, optimizer, Accelerator(cpu=True), _one_query_batch(rows=4), args)
    assert optimizer.steps == steps
    assert stats.finite and stats.approx_kl > 0 and stats.skipped == 0
