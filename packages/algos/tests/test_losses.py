import math

import pytest
import torch
from rlhf_algos import (
    AdaptiveKLController,
    FixedKLController,
    aggregate_loss,
    approx_kl,
    dpo_loss,
    kto_kl_baseline,
    kto_loss,
    pairwise_rm_loss,
    policy_loss,
    sft_loss,
    value_loss,
)


def ppo_reference(logp, old, adv, eps_low, eps_high, dual):
    r = math.exp(logp - old)
    loss = max(-adv * r, -adv * min(max(r, 1 - eps_low), 1 + eps_high))
    if dual is not None and adv < 0:
        loss = min(loss, -dual * adv)
    return loss


@pytest.mark.parametrize(
    ("eps_low", "eps_high", "dual"), [(0.2, None, None), (0.2, 0.28, None), (0.2, 0.2, 3.0)]
)
def test_policy_loss_matches_elementwise_reference(make_mask, gen, eps_low, eps_high, dual):
    logp, old = torch.randn(4, 7, generator=gen) * 0.5, torch.randn(4, 7, generator=gen) * 0.5
    adv = torch.randn(4, 7, generator=gen)
    mask = make_mask(4, 7, gen=gen, holes=True)
    out = policy_loss(logp, old, adv, mask, clip_eps_low=eps_low, clip_eps_high=eps_high, dual_clip=dual)
    hi = eps_low if eps_high is None else eps_high
    for b in range(4):
        for t in range(7):
            want = ppo_reference(float(logp[b, t]), float(old[b, t]), float(adv[b, t]), eps_low, hi, dual)
            assert out.loss[b, t].item() == pytest.approx(want if mask[b, t] else 0.0, rel=1e-5, abs=1e-6)


def test_policy_loss_gradcheck_and_entropy_bonus(gen):
    old = torch.randn(2, 5, dtype=torch.float64, generator=gen) * 0.1
    adv = torch.randn(2, 5, dtype=torch.float64, generator=gen)
    ent = torch.rand(2, 5, dtype=torch.float64, generator=gen)
    mask = torch.ones(2, 5, dtype=torch.bool)
    logp = (old + 0.05 * torch.randn(2, 5, dtype=torch.float64, generator=gen)).requires_grad_()

    def f(lp):
        out = policy_loss(lp, old, adv, mask, dual_clip=3.0, entropy=ent, entropy_coef=0.01)
        return aggregate_loss(out.loss, mask, "token-mean")

    assert torch.autograd.gradcheck(f, (logp,))
    base = policy_loss(logp, old, adv, mask).loss
    with_bonus = policy_loss(logp, old, adv, mask, entropy=ent, entropy_coef=0.01).loss
    torch.testing.assert_close(with_bonus, base - 0.01 * ent)


def test_gspo_sequence_ratio_value_and_gradient(gen):
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    old = torch.randn(2, 4, dtype=torch.float64, generator=gen)
    logp = (old + 0.01 * torch.randn(2, 4, dtype=torch.float64, generator=gen)).requires_grad_()
    adv = torch.ones(2, 4, dtype=torch.float64)
    out = policy_loss(logp, old, adv, mask, ratio_type="sequence", clip_eps_low=1.0)
    seq = [math.exp(float((logp - old).detach()[b][mask[b]].mean())) for b in range(2)]
    for b in range(2):
        torch.testing.assert_close(
            out.ratio[b][mask[b]], torch.full((int(mask[b].sum()),), seq[b], dtype=torch.float64)
        )
    out.loss.sum().backward()
    # d(-A * sg(s) * exp(lp - sg(lp))) / d lp_t = -A * s on every action token
    torch.testing.assert_close(logp.grad[0, :3], torch.full((3,), -seq[0], dtype=torch.float64))
    assert logp.grad[0, 3] == 0


def test_is_weights_scale_the_loss(gen):
    mask = torch.ones(1, 3, dtype=torch.bool)
    lp = torch.zeros(1, 3)
    w = torch.tensor([[0.5, 1.0, 0.0]])
    out = policy_loss(lp, lp, torch.ones(1, 3), mask, is_weights=w)
    torch.testing.assert_close(out.loss, -w)


def test_policy_loss_rejects_bad_settings():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        policy_loss(x, x, x, x, dual_clip=0.5)
    with pytest.raises(ValueError, match="ratio_type"):
        policy_loss(x, x, x, x, ratio_type="seq")


def test_value_loss_clipping_by_hand():
    v, old, ret = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 0.0]]), torch.tensor([[3.0, 0.5]])
    mask = torch.ones(1, 2)
    plain = value_loss(v, old, ret, mask)
    torch.testing.assert_close(plain, torch.tensor([[2.0, 0.125]]))
    clipped = value_loss(v, old, ret, mask, clip_eps=0.2)  # clipped V = 0.2 -> (0.2 - 3)^2 / 2 = 3.92
    torch.testing.assert_close(clipped, torch.tensor([[3.92, 0.125]]))


@pytest.mark.parametrize(
    "mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
)
def test_aggregation_is_invariant_to_dp_and_microbatch_split(make_mask, gen, mode):
    mask = make_mask(8, 11, gen=gen, holes=True)
    mask[3] = False  # an empty row must not change the result
    weight = torch.randn(8, 11, dtype=torch.float64, generator=gen, requires_grad=True)
    targets = torch.randn(8, 11, dtype=torch.float64, generator=gen)
    tokens, seqs = float(mask.sum()), float(mask.any(-1).sum())
    kw = {"horizon": 11} if mode.endswith("norm") else {}

    def per_token(rows):
        return (weight[rows] - targets[rows]).square()

    whole = aggregate_loss(per_token(slice(None)), mask, mode, **kw)
    (g_whole,) = torch.autograd.grad(whole, weight)

    # 2 data-parallel ranks x 2 micro-batches each; ranks' gradients are averaged (all-reduce mean).
    total, grads = 0.0, torch.zeros_like(weight)
    for rank_rows in (range(0, 4), range(4, 8)):
        rank_loss = 0.0
        for mb in (list(rank_rows)[:2], list(rank_rows)[2:]):
            rank_loss = rank_loss + aggregate_loss(
                per_token(mb), mask[mb], mode, global_tokens=tokens, global_seqs=seqs, dp_size=2, **kw
            )
        (g,) = torch.autograd.grad(rank_loss, weight)
        grads += g / 2
        total += float(rank_loss.detach()) / 2
    assert total == pytest.approx(float(whole), rel=1e-10)
    torch.testing.assert_close(grads, g_whole)


def test_aggregation_modes_by_hand():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    assert aggregate_loss(loss, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert aggregate_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert aggregate_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert aggregate_loss(loss, mask, "seq-mean-token-sum-norm", horizon=5).item() == pytest.approx(
        10 / 2 / 5
    )
    with pytest.raises(ValueError, match="needs a positive horizon"):
        aggregate_loss(loss, mask, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="selects no token"):
        aggregate_loss(loss, torch.zeros(2, 3), "token-mean")
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        aggregate_loss(loss, mask, "mean")


def test_sft_loss_is_masked_nll():
    logp = torch.log(torch.tensor([[0.5, 0.25, 0.9]]))
    mask = torch.tensor([[0, 1, 1]])
    assert sft_loss(logp, mask).item() == pytest.approx(-(math.log(0.25) + math.log(0.9)) / 2)


def test_kl_estimators_closed_form_and_straight_through():
    logp = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-1.5, -1.0, -0.5], dtype=torch.float64)
    x = (logp - ref).detach()
    torch.testing.assert_close(approx_kl(logp, ref, "k1"), x)
    torch.testing.assert_close(approx_kl(logp, ref, "k2"), 0.5 * x**2)
    k3 = torch.exp(-x) - 1 + x
    torch.testing.assert_close(approx_kl(logp, ref, "k3"), k3)
    assert (k3 >= 0).all()
    (g_k2,) = torch.autograd.grad(approx_kl(logp, ref, "k2").sum(), logp)
    for est, value in (("k1+", x), ("k3+", k3)):
        out = approx_kl(logp, ref, est)
        torch.testing.assert_close(out.detach(), value)
        (g,) = torch.autograd.grad(out.sum(), logp)
        torch.testing.assert_close(g, g_k2)
    assert approx_kl(logp, ref, "k1", clamp=0.2).max().item() == pytest.approx(0.2)
    with pytest.raises(ValueError, match="unknown KL estimator"):
        approx_kl(logp, ref, "k4")


def test_kl_controllers():
    assert FixedKLController(value=0.1).update(5.0, 10) == 0.1
    c = AdaptiveKLController(value=0.1, target=6.0, horizon=10000)
    assert c.update(12.0, 100) == pytest.approx(0.1 * (1 + 0.2 * 100 / 10000))  # error clipped to 0.2
    assert c.update(3.0, 100) == pytest.approx(0.1 * (1 + 0.002) * (1 - 0.002))
    with pytest.raises(ValueError):
        AdaptiveKLController(value=0.1, target=0.0, horizon=1)


def test_dpo_ipo_cdpo_by_hand():
    c, r, rc, rr = (torch.tensor([v]) for v in (-1.0, -2.0, -1.5, -1.5))
    # h = 0.5 - (-0.5) = 1
    out = dpo_loss(c, r, rc, rr, beta=0.1)
    assert out.loss.item() == pytest.approx(math.log1p(math.exp(-0.1)))
    assert out.chosen_rewards.item() == pytest.approx(0.05) and out.rejected_rewards.item() == pytest.approx(
        -0.05
    )
    assert dpo_loss(c, r, rc, rr, beta=0.1, variant="ipo").loss.item() == pytest.approx((1 - 5) ** 2)
    cdpo = dpo_loss(c, r, rc, rr, beta=0.1, variant="cdpo", label_smoothing=0.1).loss.item()
    assert cdpo == pytest.approx(0.9 * math.log1p(math.exp(-0.1)) + 0.1 * math.log1p(math.exp(0.1)))
    with pytest.raises(ValueError, match="label_smoothing is only used"):
        dpo_loss(c, r, rc, rr, beta=0.1, label_smoothing=0.1)


def test_dpo_gradcheck(gen):
    args = [torch.randn(3, dtype=torch.float64, generator=gen, requires_grad=True) for _ in range(2)]
    refs = [torch.randn(3, dtype=torch.float64, generator=gen) for _ in range(2)]
    assert torch.autograd.gradcheck(lambda a, b: dpo_loss(a, b, *refs, beta=0.3).loss.sum(), args)


def test_kto_by_hand():
    policy, ref = torch.tensor([-1.0, -1.0]), torch.tensor([-2.0, -2.0])
    z0 = kto_kl_baseline(torch.tensor([-3.0, -1.0]), torch.tensor([-2.5, -2.5]))  # mean(-0.5, 1.5) = 0.5
    assert z0.item() == pytest.approx(0.5)
    loss = kto_loss(
        policy, ref, torch.tensor([True, False]), z0, beta=0.1, desirable_weight=1.0, undesirable_weight=2.0
    )
    sig = lambda v: 1 / (1 + math.exp(-v))  # noqa: E731
    assert loss[0].item() == pytest.approx(1 - sig(0.1 * (1.0 - 0.5)))
    assert loss[1].item() == pytest.approx(2 * (1 - sig(0.1 * (0.5 - 1.0))))
    assert kto_kl_baseline(torch.tensor([-3.0]), torch.tensor([-1.0])).item() == 0.0  # clamped at 0


def test_pairwise_rm_loss_by_hand():
    out = pairwise_rm_loss(
        torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.0]), margin=torch.tensor([0.0, 1.0])
    )
    torch.testing.assert_close(out, torch.tensor([math.log1p(math.exp(-1.0)), math.log1p(math.exp(1.0))]))


def test_value_and_kto_gradcheck(gen):
    v = torch.randn(2, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    old, ret = (
        torch.randn(2, 4, dtype=torch.float64, generator=gen),
        torch.randn(2, 4, dtype=torch.float64, generator=gen),
    )
    mask = torch.ones(2, 4)
    assert torch.autograd.gradcheck(lambda x: value_loss(x, old, ret, mask, clip_eps=0.5).sum(), (v,))
    lp = torch.randn(4, dtype=torch.float64, generator=gen, requires_grad=True)
    ref = torch.randn(4, dtype=torch.float64, generator=gen)
    desirable = torch.tensor([True, False, True, False])
    assert torch.autograd.gradcheck(lambda x: kto_loss(x, ref, desirable, 0.1, beta=0.5).sum(), (lp,))
