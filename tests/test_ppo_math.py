"""PPO maths against values worked out by hand (the working is in each test's comments)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from fitrl.ppo import core as ppo

t = torch.tensor


def test_gae_by_hand() -> None:
    # gamma=1, lam=0.5, V=[1,2,3], r=[0,0,1]
    # t=2: delta = 1 + 0 - 3 = -2        A2 = -2
    # t=1: delta = 0 + 3 - 2 = 1         A1 = 1 + 0.5 * -2 = 0
    # t=0: delta = 0 + 2 - 1 = 1         A0 = 1 + 0.5 * 0 = 1;   returns = A + V = [2, 2, 1]
    adv, ret = ppo.gae(t([[1.0, 2, 3]]), t([[0.0, 0, 1]]), t([[1.0, 1, 1]]), gamma=1.0, lam=0.5)
    assert_close(adv, t([[1.0, 0, -2]]))
    assert_close(ret, t([[2.0, 2, 1]]))


def test_gae_ignores_padding_after_the_last_token() -> None:
    # Same sequence with a padded 4th position holding junk value 9 and reward 5: nothing changes.
    adv, ret = ppo.gae(t([[1.0, 2, 3, 9]]), t([[0.0, 0, 1, 5]]), t([[1.0, 1, 1, 0]]), gamma=1.0, lam=0.5)
    assert_close(adv, t([[1.0, 0, -2, 0]]))
    assert_close(ret, t([[2.0, 2, 1, 0]]))


def test_gae_with_discount() -> None:
    # gamma=0.5, lam=1, V=[0,0], r=[0,4]: A1 = 4, A0 = 0 + 0.5*0 - 0 + 0.5*1*4 = 2
    adv, _ = ppo.gae(t([[0.0, 0]]), t([[0.0, 4]]), t([[1.0, 1]]), gamma=0.5, lam=1.0)
    assert_close(adv, t([[2.0, 4]]))


def test_masked_whiten_by_hand() -> None:
    # unmasked [1,2,3]: mean 2, unbiased var (1+0+1)/2 = 1 -> [-1, 0, 1]; the masked 100 is ignored and zeroed
    out = ppo.masked_whiten(t([[1.0, 2, 3, 100]]), t([[1.0, 1, 1, 0]]))
    assert_close(out, t([[-1.0, 0, 1, 0]]), atol=1e-6, rtol=0)
    kept = ppo.masked_whiten(t([[1.0, 2, 3, 100]]), t([[1.0, 1, 1, 0]]), shift_mean=False)
    assert_close(kept, t([[1.0, 2, 3, 0]]), atol=1e-6, rtol=0)


def test_masked_mean_and_var() -> None:
    x, mask = t([[2.0, 4, 6], [8, 0, 0]]), t([[1.0, 1, 1], [1, 0, 0]])
    assert ppo.masked_mean(x, mask).item() == 5.0  # (2+4+6+8)/4
    assert_close(ppo.masked_mean(x, mask, dim=1), t([4.0, 8.0]))
    assert ppo.masked_var(x, mask, unbiased=False).item() == 5.0  # (9+1+1+9)/4
    with pytest.raises(ValueError):
        ppo.masked_var(t([1.0, 2.0]), t([1.0, 0.0]))


def test_kl_estimators_by_hand() -> None:
    lp, ref = t([[-1.0, -2.0]]), t([[-1.5, -1.0]])
    assert_close(ppo.kl_penalty(lp, ref, "kl"), t([[0.5, -1.0]]))
    assert_close(ppo.kl_penalty(lp, ref, "abs"), t([[0.5, 1.0]]))
    assert_close(ppo.kl_penalty(lp, ref, "mse"), t([[0.125, 0.5]]))
    # full: p = softmax([0,0]) = [.5,.5], q = softmax([ln 3, 0]) = [.75,.25]
    # KL = .5 ln(.5/.75) + .5 ln(.5/.25) = .5 ln(4/3)
    logits, ref_logits = t([[[0.0, 0.0]]]), t([[[math.log(3), 0.0]]])
    full = ppo.kl_penalty(lp[:, :1], ref[:, :1], "full", logits, ref_logits)
    assert_close(full, t([[0.5 * math.log(4 / 3)]]))
    with pytest.raises(ValueError):
        ppo.kl_penalty(lp, ref, "full")


def test_per_token_rewards_put_the_score_on_the_last_real_token() -> None:
    # kl_coef 0.5: non-score = -0.5 * [.1,.2,.3] ; score 2 lands on token 2 (token 3 is padding)
    rewards, non_score = ppo.per_token_rewards(t([2.0]), t([[0.1, 0.2, 0.3, 0.9]]), t([[1.0, 1, 1, 0]]), 0.5)
    assert_close(non_score, t([[-0.05, -0.1, -0.15, 0.0]]))
    assert_close(rewards, t([[-0.05, -0.1, 1.85, 0.0]]))


def test_policy_loss_clips_by_hand() -> None:
    # ratio = exp(ln 1.5) = 1.5, A = +1: unclipped -1.5, clipped -1.2 -> loss max = -1.2, clipped
    out = ppo.policy_loss(t([[math.log(1.5)]]), t([[0.0]]), t([[1.0]]), t([[1.0]]), cliprange=0.2)
    assert_close(out.loss, t(-1.2))
    assert out.clipfrac.item() == 1.0
    assert_close(out.approx_kl, t(0.5 * math.log(1.5) ** 2))
    assert_close(out.ratio_mean, t(1.5))
    # A = -1: unclipped 1.5, clipped 1.2 -> the pessimistic 1.5, not clipped
    out = ppo.policy_loss(t([[math.log(1.5)]]), t([[0.0]]), t([[-1.0]]), t([[1.0]]), cliprange=0.2)
    assert_close(out.loss, t(1.5))
    assert out.clipfrac.item() == 0.0


def test_value_loss_clips_by_hand() -> None:
    # v=2, v_old=1, R=3, e=0.2: clipped v = 1.2; (2-3)^2 = 1, (1.2-3)^2 = 3.24 -> 0.5 * 3.24 = 1.62
    loss, clipfrac = ppo.value_loss(t([[2.0]]), t([[1.0]]), t([[3.0]]), t([[1.0]]), 0.2)
    assert_close(loss, t(1.62))
    assert clipfrac.item() == 1.0
    # inside the clip range the plain squared error applies: 0.5 * (1.1 - 3)^2
    loss, clipfrac = ppo.value_loss(t([[1.1]]), t([[1.0]]), t([[3.0]]), t([[1.0]]), 0.2)
    assert_close(loss, t(0.5 * 1.9**2))
    assert clipfrac.item() == 0.0


def test_adaptive_kl_controller_by_hand() -> None:
    kl = ppo.AdaptiveKLController(init=0.2, target=6, horizon=10000)
    kl.update(current_kl=12, n_steps=256)  # error clipped to +0.2: 0.2 * (1 + 0.2 * 256 / 10000)
    assert kl.value == pytest.approx(0.2 * 1.00512)
    kl.update(current_kl=3, n_steps=256)  # error -0.5 clipped to -0.2
    assert kl.value == pytest.approx(0.2 * 1.00512 * 0.99488)
    kl.update(current_kl=6.6, n_steps=100)  # error 0.1 inside the clip: 1 + 0.1 * 100 / 10000
    assert kl.value == pytest.approx(0.2 * 1.00512 * 0.99488 * 1.001)
    fixed = ppo.FixedKLController(0.3)
    fixed.update(100, 256)
    assert fixed.value == 0.3


def test_entropy_and_logprobs() -> None:
    logits = t([[[0.0, 0.0, 0.0, 0.0]]])  # uniform over 4: entropy ln 4, log p = -ln 4
    assert_close(ppo.entropy_from_logits(logits), t([[math.log(4)]]))
    assert_close(ppo.logprobs_from_logits(logits, t([[2]])), t([[-math.log(4)]]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_without_a_full_log_softmax_match_it(dtype: torch.dtype) -> None:
    # logit(token) - logsumexp, a sequence at a time, against log_softmax + gather on the whole batch:
    # the same values and the same gradient, in fp32 and from half-precision logits.
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 5, 50, generator=gen) * 4).to(dtype).requires_grad_()
    tokens = torch.randint(0, 50, (3, 5), generator=gen)
    ours = ppo.logprobs_from_logits(logits, tokens)
    (grad,) = torch.autograd.grad(ours.sum(), logits)
    reference = torch.log_softmax(logits.float(), -1).gather(2, tokens[..., None]).squeeze(-1)
    (ref_grad,) = torch.autograd.grad(reference.sum(), logits)
    assert ours.dtype == torch.float32
    assert_close(ours, reference, atol=1e-5, rtol=1e-5)
    assert_close(grad, ref_grad)
    p = torch.softmax(logits.detach().float(), -1)
    assert_close(ppo.entropy_from_logits(logits.detach()), -(p * p.log()).sum(-1))


def test_explained_variance() -> None:
    returns, mask = t([[1.0, 2, 3, 4]]), torch.ones(1, 4)
    assert ppo.explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert ppo.explained_variance(torch.full((1, 4), 2.5), returns, mask) == pytest.approx(0.0)


def test_running_moments_match_the_batch_statistics() -> None:
    m = ppo.RunningMoments()
    m.update(t([1.0, 2.0, 3.0]))
    m.update(t([4.0, 5.0]))
    assert m.mean == pytest.approx(3.0)
    assert m.std == pytest.approx(math.sqrt(2.0))  # population variance of 1..5
    again = ppo.RunningMoments()
    again.load_state_dict(m.state_dict())
    assert again.mean == m.mean and again.std == m.std
