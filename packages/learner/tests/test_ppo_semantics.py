"""What a PPO actor step means, checked on a tiny bigram policy behind a plain in-process training
engine (no DeepSpeed): the on-policy default of ``old_logp``, gradient accumulation, the clip variants
(clip, clip-higher, dual clip, GSPO) and the rollout log-prob mismatch metrics.

Expected losses and gradients come from references written out here (piecewise definitions of the
clipped surrogates, element by element), not from the code under test.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from rlhf_algos import aggregate_loss, policy_loss
from rlhf_learner import NonFiniteLossError, PolicyBatch, ppo_actor_step
from rlhf_testkit.engines import BigramEngine

VOCAB = 7
TOKEN_MEAN = functools.partial(aggregate_loss, mode="token-mean")


def bigram(**kw) -> BigramEngine:
    """The test kit's bigram training engine over this module's vocabulary."""
    return BigramEngine(VOCAB, **kw)


def current_logp(ids: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """The (fresh) engine's log-probs of ``ids`` from a separate no-grad forward."""
    with torch.no_grad():
        return bigram(seed=seed).logp(ids)


def run(batches: list[PolicyBatch], loss_fn=policy_loss, *, seed: int = 0, **kw):
    """``(StepResult, gradient)`` of one ``ppo_actor_step`` on a fresh engine (token-mean)."""
    engine = bigram(gas=len(batches), seed=seed)
    res = ppo_actor_step(engine, batches, policy_loss_fn=loss_fn, aggregate_fn=TOKEN_MEAN, **kw)
    assert engine.steps == len(batches)
    return res, engine.table.grad.clone()


def unclipped(logp, old_logp, advantages, mask, **_):
    """The plain importance-weighted surrogate ``-A exp(logp - old)`` (no clipping at all)."""
    return -advantages * torch.exp(logp - old_logp) * mask.to(logp.dtype)


def rows(*, seed: int, n: int = 3, length: int = 7, prompt: int = 2, short: bool = True):
    """Random token rows and their action mask (row 0 one token shorter when ``short``)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, length), generator=g)
    mask = torch.zeros(n, length, dtype=torch.bool)
    mask[:, prompt:] = True
    if short:
        mask[0, -1] = False
    return ids, mask, g


# ---------------------------------------------------------------------------------------------------
# references


def piecewise_surrogate(r: torch.Tensor, a: float, *, low: float, high: float, dual: float | None):
    """One token's negated clipped surrogate ``-min(r A, clip(r, 1-low, 1+high) A)`` (optionally capped
    at ``-dual A`` for ``A < 0``), written piecewise: where the clip (or cap) is active the term is a
    constant (no gradient), elsewhere ``-A r``."""
    rv = float(r.detach())
    if a > 0 and rv > 1 + high:
        return torch.tensor(-a * (1 + high), dtype=torch.float64), True
    if a < 0 and dual is not None and rv > dual:
        return torch.tensor(-a * dual, dtype=torch.float64), True
    if a < 0 and rv < 1 - low:
        return torch.tensor(-a * (1 - low), dtype=torch.float64), True
    return -a * r, False


def reference(
    batches,
    *,
    low: float = 0.2,
    high: float | None = None,
    dual: float | None = None,
    sequence: bool = False,
    seed: int = 0,
):
    """Token-mean of :func:`piecewise_surrogate` over every action token of the window: ``(loss,
    gradient, clipped fraction)``. ``sequence``: GSPO-token, the ratio of every token of row ``i`` has
    the value ``s_i = exp(mean_t (logp - old))`` (masked tokens) and the gradient ``s_i * d logp_t``."""
    high = low if high is None else high
    engine = bigram(seed=seed)
    terms, clipped = [], 0
    for mb in batches:
        logp = engine.logp(mb.input_ids)
        old = mb.old_logp if mb.old_logp is not None else logp.detach()
        for b in range(mb.input_ids.shape[0]):
            ts = [t for t in range(mb.input_ids.shape[1]) if mb.action_mask[b, t]]
            if sequence:
                s = math.exp(sum(float(logp[b, t].detach() - old[b, t]) for t in ts) / len(ts))
            for t in ts:
                if sequence:
                    r = s * torch.exp(logp[b, t] - logp[b, t].detach())
                else:
                    r = torch.exp(logp[b, t] - old[b, t])
                term, c = piecewise_surrogate(r, float(mb.advantages[b, t]), low=low, high=high, dual=dual)
                terms.append(term)
                clipped += c
    loss = torch.stack(terms).sum() / len(terms)
    loss.backward()
    return float(loss.detach()), engine.table.grad.clone(), clipped / len(terms)


def assert_same_update(a, b, *, rtol=1e-12, atol=1e-14):
    (res_a, grad_a), (res_b, grad_b) = a, b
    assert res_a.loss == pytest.approx(res_b.loss, rel=rtol, abs=atol)
    assert torch.allclose(grad_a, grad_b, rtol=rtol, atol=atol)


def assert_different_update(a, b):
    (res_a, grad_a), (res_b, grad_b) = a, b
    differs_loss = abs(res_a.loss - res_b.loss) > 1e-6
    differs_grad = not torch.allclose(grad_a, grad_b, rtol=1e-6, atol=1e-9)
    assert differs_loss or differs_grad


# ---------------------------------------------------------------------------------------------------
# a. exactly on-policy


def on_policy_batches(*, with_old: bool, rollout: bool = False):
    out = []
    for seed in (11, 12):
        ids, mask, g = rows(seed=seed)
        adv = torch.randn(ids.shape, generator=g, dtype=torch.float64) * mask
        old = current_logp(ids) * mask if with_old else None
        roll = (current_logp(ids) - 0.3 * torch.rand(ids.shape, generator=g, dtype=torch.float64)) * mask
        out.append(
            PolicyBatch(
                input_ids=ids,
                action_mask=mask,
                advantages=adv,
                old_logp=old,
                rollout_logp=roll if rollout else None,
            )
        )
    return out


@pytest.mark.parametrize(
    "loss_fn",
    [
        policy_loss,
        functools.partial(policy_loss, clip_eps_low=0.2, clip_eps_high=0.28, dual_clip=3.0),
        functools.partial(policy_loss, ratio_type="sequence", clip_eps_low=3e-4, clip_eps_high=4e-4),
    ],
    ids=["clip", "clip-higher-dual", "gspo"],
)
def test_missing_old_logp_is_exactly_on_policy(loss_fn):
    without = run(on_policy_batches(with_old=False), loss_fn)
    with_old = run(on_policy_batches(with_old=True), loss_fn)
    assert_same_update(without, with_old)
    # ... and that is the policy gradient -A d logp, token-mean (ratio 1: nothing clips)
    loss, grad, frac = reference(on_policy_batches(with_old=True))
    assert without[0].loss == pytest.approx(loss, rel=1e-12)
    assert torch.allclose(without[1], grad, rtol=1e-10, atol=1e-13)
    assert frac == 0 and without[0].metrics["clip_frac"] == 0.0
    assert grad.abs().sum() > 1e-3


# ---------------------------------------------------------------------------------------------------
# b. gradient accumulation


def off_policy_batch(seed: int, n: int, *, short: bool) -> PolicyBatch:
    """Rows whose old log-probs sit +-0.4 around the current ones (some ratios clip)."""
    ids, mask, g = rows(seed=seed, n=n, short=short)
    if short:
        mask[-1, 3:] = False  # the micro-batches hold different token counts
    old = (current_logp(ids) + 0.8 * (torch.rand(ids.shape, generator=g, dtype=torch.float64) - 0.5)) * mask
    adv = torch.randn(ids.shape, generator=g, dtype=torch.float64) * mask
    return PolicyBatch(input_ids=ids, action_mask=mask, old_logp=old, advantages=adv)


def concat(batches: list[PolicyBatch]) -> PolicyBatch:
    return PolicyBatch(
        input_ids=torch.cat([mb.input_ids for mb in batches]),
        action_mask=torch.cat([mb.action_mask for mb in batches]),
        old_logp=torch.cat([mb.old_logp for mb in batches]),
        advantages=torch.cat([mb.advantages for mb in batches]),
    )


def test_two_micro_batches_equal_one_holding_the_same_samples():
    parts = [off_policy_batch(21, 3, short=True), off_policy_batch(22, 1, short=False)]
    assert int(parts[0].action_mask.sum()) == 10 and int(parts[1].action_mask.sum()) == 5
    split = run(parts)
    whole = run([concat(parts)])
    assert_same_update(split, whole, rtol=1e-12, atol=1e-14)
    assert split[0].metrics["clip_frac"] == pytest.approx(whole[0].metrics["clip_frac"], rel=1e-12)
    assert split[0].metrics["policy_loss"] == pytest.approx(whole[0].metrics["policy_loss"], rel=1e-12)
    # the global token mean, not a mean of per-micro-batch means
    loss, grad, frac = reference(parts)
    assert split[0].loss == pytest.approx(loss, rel=1e-12)
    assert torch.allclose(split[1], grad, rtol=1e-10, atol=1e-13)
    assert split[0].metrics["clip_frac"] == pytest.approx(frac, rel=1e-12)
    assert 0 < frac < 1
    per_mb_mean = sum(reference([mb])[0] for mb in parts) / 2
    assert abs(per_mb_mean - loss) > 1e-3  # the two normalisations differ on this window


# ---------------------------------------------------------------------------------------------------
# c. clip variants


def offset_batch(offsets, advantages, *, seed: int = 31) -> PolicyBatch:
    """One row per entry of ``offsets``: ``old_logp = current - offset`` on the action tokens, so the
    token ratios are ``exp(offset)`` exactly; ``advantages`` per row (constant over the row)."""
    n, k = len(offsets), len(offsets[0])
    ids, mask, _ = rows(seed=seed, n=n, length=k + 1, prompt=1, short=False)
    off = torch.zeros(n, k + 1, dtype=torch.float64)
    off[:, 1:] = torch.tensor(offsets, dtype=torch.float64)
    adv = torch.tensor(advantages, dtype=torch.float64)[:, None].expand(n, k + 1).clone() * mask
    return PolicyBatch(
        input_ids=ids, action_mask=mask, old_logp=(current_logp(ids) - off) * mask, advantages=adv
    )


LN = math.log


def clip_variant_cases():
    """``(name, batch, variant kwargs, baseline kwargs or None for the unclipped surrogate, reference
    kwargs)``."""
    clip_batch = offset_batch([[LN(1.5), LN(1.1), LN(0.6)], [LN(0.6), LN(1.5), LN(0.95)]], [1.0, -0.7])
    higher_batch = offset_batch([[LN(1.25), LN(1.24), LN(1.1)], [LN(1.26), LN(0.9), LN(1.0)]], [0.8, 1.3])
    dual_batch = offset_batch([[LN(5.0), LN(1.0), LN(4.0)], [LN(1.1), LN(6.0), LN(0.9)]], [-1.0, -0.5])
    gspo_batch = offset_batch([[0.3, -0.2, 0.1], [-0.25, 0.05, 0.4]], [1.0, -1.0])
    return [
        ("clip", clip_batch, dict(clip_eps_low=0.2), None, dict(low=0.2)),
        (
            "clip-higher",
            higher_batch,
            dict(clip_eps_low=0.2, clip_eps_high=0.28),
            dict(clip_eps_low=0.2),
            dict(low=0.2, high=0.28),
        ),
        (
            "dual-clip",
            dual_batch,
            dict(clip_eps_low=0.2, dual_clip=3.0),
            dict(clip_eps_low=0.2),
            dict(low=0.2, dual=3.0),
        ),
        (
            "gspo",
            gspo_batch,
            dict(clip_eps_low=10.0, ratio_type="sequence"),
            dict(clip_eps_low=10.0, ratio_type="token"),
            dict(low=10.0, sequence=True),
        ),
        (
            "gspo-clipped",
            gspo_batch,
            dict(clip_eps_low=0.05, ratio_type="sequence"),
            dict(clip_eps_low=0.05, ratio_type="token"),
            dict(low=0.05, sequence=True),
        ),
    ]


@pytest.mark.parametrize(
    ("name", "mb", "variant", "baseline", "ref"), [pytest.param(*c, id=c[0]) for c in clip_variant_cases()]
)
def test_clip_variants_change_the_update_off_policy(name, mb, variant, baseline, ref):
    got = run([mb], functools.partial(policy_loss, **variant))
    base = run([mb], unclipped if baseline is None else functools.partial(policy_loss, **baseline))
    assert_different_update(got, base)
    loss, grad, frac = reference([mb], **ref)
    assert got[0].loss == pytest.approx(loss, rel=1e-10)
    assert torch.allclose(got[1], grad, rtol=1e-9, atol=1e-12)
    assert got[0].metrics["clip_frac"] == pytest.approx(frac, rel=1e-12, abs=1e-15)
    if name in ("clip", "dual-clip", "gspo-clipped"):
        assert got[0].metrics["clip_frac"] > 0
    if name == "clip-higher":
        # 1.24 / 1.25 / 1.26 clip under the symmetric 0.2, not under 0.28: fewer clipped tokens
        assert got[0].metrics["clip_frac"] == pytest.approx(0.0)
        assert base[0].metrics["clip_frac"] == pytest.approx(3 / 6)
    if name == "dual-clip":
        # ratios 5, 4 and 6 exceed 3 with A < 0: capped (counted), zero gradient through those tokens
        assert got[0].metrics["clip_frac"] == pytest.approx(3 / 6)
        assert base[0].metrics["clip_frac"] == pytest.approx(0.0)
        assert got[0].loss < base[0].loss


def test_clip_fraction_counts_the_tokens_outside_the_range():
    # ratios 1.5 (A > 0: clipped), 1.1 (inside), 0.6 (A > 0: below the range, not clipped for A > 0);
    # row 2 with A < 0: 0.6 clipped, 1.5 not (no dual clip), 0.95 inside  ->  2 of 6
    mb = offset_batch([[LN(1.5), LN(1.1), LN(0.6)], [LN(0.6), LN(1.5), LN(0.95)]], [1.0, -0.7])
    res, _ = run([mb])
    assert res.metrics["clip_frac"] == pytest.approx(2 / 6)
    # closed form of the loss: token mean of the six piecewise terms
    terms = [-1.0 * 1.2, -1.0 * 1.1, -1.0 * 0.6, 0.7 * 0.8, 0.7 * 1.5, 0.7 * 0.95]
    assert res.loss == pytest.approx(sum(terms) / 6, rel=1e-10)


@pytest.mark.parametrize(
    "variant",
    [
        dict(clip_eps_low=0.2),
        dict(clip_eps_low=0.2, clip_eps_high=0.28),
        dict(clip_eps_low=0.2, clip_eps_high=0.28, dual_clip=3.0),
    ],
    ids=["clip", "clip-higher", "clip-higher-dual"],
)
@pytest.mark.parametrize("old_given", [True, False], ids=["old-given", "old-none"])
def test_clipping_changes_nothing_at_ratio_one(variant, old_given):
    mbs = on_policy_batches(with_old=old_given)
    got = run(mbs, functools.partial(policy_loss, **variant))
    base = run(mbs, unclipped)
    assert_same_update(got, base, rtol=1e-12, atol=1e-14)
    assert got[0].metrics["clip_frac"] == 0.0
    assert got[1].abs().sum() > 1e-3


# ---------------------------------------------------------------------------------------------------
# d. rollout log-prob mismatch


@pytest.mark.parametrize("old_given", [True, False], ids=["old-given", "old-none"])
def test_logp_mismatch_metrics_are_the_masked_mean_and_max(old_given):
    mbs = []
    for seed, scale in ((41, 0.5), (42, 2.0)):
        ids, mask, g = rows(seed=seed)
        cur = current_logp(ids)
        old = (cur + 0.3 * (torch.rand(ids.shape, generator=g, dtype=torch.float64) - 0.5)) * mask
        base = old if old_given else cur
        gap = scale * torch.randn(ids.shape, generator=g, dtype=torch.float64)
        rollout = torch.where(mask, base - gap, base + 100.0)  # far off where nothing is trained
        adv = torch.randn(ids.shape, generator=g, dtype=torch.float64) * mask
        mbs.append(
            PolicyBatch(
                input_ids=ids,
                action_mask=mask,
                advantages=adv,
                old_logp=old if old_given else None,
                rollout_logp=rollout,
            )
        )
    res, _ = run(mbs)
    diffs = []
    for mb in mbs:
        old = mb.old_logp if old_given else current_logp(mb.input_ids)
        for b in range(mb.input_ids.shape[0]):
            for t in range(mb.input_ids.shape[1]):
                if mb.action_mask[b, t]:
                    diffs.append(abs(float(old[b, t]) - float(mb.rollout_logp[b, t])))
    assert res.metrics["logp_mismatch"] == pytest.approx(sum(diffs) / len(diffs), rel=1e-12)
    assert res.metrics["logp_mismatch_max"] == pytest.approx(max(diffs), rel=1e-12)
    assert max(diffs) < 50  # the masked-out +100 never counts


def test_no_logp_mismatch_metrics_without_rollout_logp():
    res, _ = run(on_policy_batches(with_old=False))
    assert "logp_mismatch" not in res.metrics and "logp_mismatch_max" not in res.metrics
    res, _ = run(on_policy_batches(with_old=False, rollout=True))
    assert res.metrics["logp_mismatch"] > 0 and res.metrics["logp_mismatch_max"] > 0


# ---------------------------------------------------------------------------------------------------
# a non-finite loss never reaches the weights


class SGDBigram(BigramEngine):
    """A bigram engine whose ``step`` applies plain SGD at the end of each accumulation window."""

    def step(self):
        super().step()
        if self.steps % self.gas == 0:
            with torch.no_grad():
                self.table -= 0.1 * self.table.grad
            self.table.grad = None


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_loss_stops_the_update_before_the_weights(bad):
    ids, mask, g = rows(seed=3, n=4)
    adv = torch.randn(ids.shape, generator=g, dtype=torch.float64)
    adv[2] = bad  # the second micro-batch's loss is not finite
    batches = [
        PolicyBatch(input_ids=ids[i : i + 2], action_mask=mask[i : i + 2], advantages=adv[i : i + 2])
        for i in (0, 2)
    ]
    engine = SGDBigram(VOCAB, gas=2)
    before = engine.table.detach().clone()
    with pytest.raises(NonFiniteLossError, match=r"micro-batch 2 of 2: loss (nan|inf) is not finite"):
        ppo_actor_step(engine, batches, policy_loss_fn=policy_loss, aggregate_fn=TOKEN_MEAN)
    assert engine.steps == 1  # the first micro-batch only: the window's optimizer step never ran
    assert torch.equal(engine.table.detach(), before)
    ok = SGDBigram(VOCAB, gas=2)  # the same window without the bad value does update the weights
    adv[2] = 1.0
    fine = [
        PolicyBatch(input_ids=ids[i : i + 2], action_mask=mask[i : i + 2], advantages=adv[i : i + 2])
        for i in (0, 2)
    ]
    ppo_actor_step(ok, fine, policy_loss_fn=policy_loss, aggregate_fn=TOKEN_MEAN)
    assert not torch.equal(ok.table.detach(), before)
