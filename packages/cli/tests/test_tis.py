"""Truncated importance sampling (``--algo.is_correction``) through the real loss path:
``policy_step_args(PolicyLossSettings)`` bound to rlhf-learner's ``ppo_actor_step``, on a tiny bigram
policy behind a plain in-process training engine (no DeepSpeed): losses and gradients against ones
written out by hand here."""

from __future__ import annotations

import math

import pytest
import torch
import yaml
from rlhf_cli.config import PPOConfig
from rlhf_cli.data.batches import Sample
from rlhf_cli.ppo.settings import UpdateSettings
from rlhf_cli.ppo.updates import update
from rlhf_cli.runtime.learners.losses import policy_step_args
from rlhf_cli.runtime.learners.specs import PolicyLossSettings
from rlhf_learner import PolicyBatch, ppo_actor_step
from rlhf_testkit.engines import BigramEngine

VOCAB = 6


def bigram(**kw) -> BigramEngine:
    """The test kit's bigram training engine over this module's vocabulary."""
    return BigramEngine(VOCAB, **kw)


def settings(
    mode: str = "none", *, low: float = 0.0, high: float = 2.0, eps: float = 0.2
) -> PolicyLossSettings:
    return PolicyLossSettings(
        clip_eps_low=eps,
        clip_eps_high=None,
        dual_clip=None,
        ratio_type="token",
        entropy_coef=0.0,
        loss_agg="token-mean",
        horizon=8,
        kl_estimator="k3",
        kl_loss_coef=0.0,
        is_correction=mode,
        is_low=low,
        is_high=high,
    )


def run(s: PolicyLossSettings, batches: list[PolicyBatch], *, seed: int = 0):
    """``(StepResult, gradient)`` of one step on a fresh engine."""
    engine = bigram(gas=len(batches), seed=seed)
    res = ppo_actor_step(engine, batches, **policy_step_args(s))
    assert engine.steps == len(batches)
    return res, engine.table.grad.clone()


def by_hand(batches, *, weight, eps: float = 0.2, seed: int = 0):
    """Token-mean clipped surrogate ``max(-A r, -A clip(r, 1 - eps, 1 + eps)) * w`` over every action
    token of the window, element by element, ``w = weight(old, rollout)``; its value and gradient."""
    engine = bigram(seed=seed)
    terms, tokens = [], 0
    for mb in batches:
        logp = engine.logp(mb.input_ids)
        for b in range(mb.input_ids.shape[0]):
            for t in range(mb.input_ids.shape[1]):
                if not mb.action_mask[b, t]:
                    continue
                old, a = float(mb.old_logp[b, t]), float(mb.advantages[b, t])
                rollout = float(mb.rollout_logp[b, t]) if mb.rollout_logp is not None else old
                r = torch.exp(logp[b, t] - old)
                surrogate = torch.maximum(-a * r, -a * r.clamp(1 - eps, 1 + eps))
                terms.append(surrogate * weight(old, rollout))
                tokens += 1
    loss = torch.stack(terms).sum() / tokens
    loss.backward()
    return float(loss.detach()), engine.table.grad.clone()


def tis(low: float, high: float):
    return lambda old, rollout: min(max(math.exp(old - rollout), low), high)


def batch(*, seed: int, rollout_shift, rows: int = 3, length: int = 6, prompt: int = 2) -> PolicyBatch:
    """Rows of a fixed random policy's sequences; ``old_logp`` near the engine's current log-probs
    (so some ratios clip), ``rollout_logp = old_logp - rollout_shift(b, t)`` on action tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, length), generator=g)
    mask = torch.zeros(rows, length, dtype=torch.bool)
    mask[:, prompt:] = True
    mask[0, -1] = False  # a row shorter than the others
    with torch.no_grad():
        current = bigram().logp(ids)
    old = (current + 0.3 * (torch.rand(rows, length, generator=g, dtype=torch.float64) - 0.5)) * mask
    shift = torch.tensor(
        [[rollout_shift(b, t) for t in range(length)] for b in range(rows)], dtype=torch.float64
    )
    rollout = (old - shift) * mask
    adv = torch.randn(rows, length, generator=g, dtype=torch.float64) * mask
    return PolicyBatch(input_ids=ids, action_mask=mask, old_logp=old, advantages=adv, rollout_logp=rollout)


def without_rollout(mb: PolicyBatch) -> PolicyBatch:
    return PolicyBatch(
        input_ids=mb.input_ids, action_mask=mb.action_mask, old_logp=mb.old_logp, advantages=mb.advantages
    )


def test_no_correction_has_no_weights_fn_and_matches_the_surrogate_by_hand():
    args = policy_step_args(settings("none"))
    assert args["is_weights_fn"] is None
    mbs = [without_rollout(batch(seed=s, rollout_shift=lambda b, t: 0.0)) for s in (1, 2)]
    res, grad = run(settings("none"), mbs)
    loss, want = by_hand(mbs, weight=lambda o, r: 1.0)
    assert res.loss == pytest.approx(loss, rel=1e-9)
    assert torch.allclose(grad, want, rtol=1e-9, atol=1e-12)


def test_tis_leaves_the_step_unchanged_when_rollout_and_old_logp_agree():
    mbs = [batch(seed=s, rollout_shift=lambda b, t: 0.0) for s in (1, 2)]
    res_tis, grad_tis = run(settings("tis"), mbs)
    res_none, grad_none = run(settings("none"), [without_rollout(mb) for mb in mbs])
    assert res_tis.loss == pytest.approx(res_none.loss, rel=1e-12)
    assert torch.allclose(grad_tis, grad_none, rtol=1e-12, atol=0)


def test_tis_weights_the_step_when_rollout_logp_differs():
    # ratios old/rollout between exp(-0.4) and exp(0.4): inside [0, 2], untruncated
    def shift(b, t):
        return 0.4 * math.sin(3 * b + t)

    mbs = [batch(seed=s, rollout_shift=shift) for s in (3, 4)]
    res, grad = run(settings("tis"), mbs)
    _, grad_none = run(settings("none"), [without_rollout(mb) for mb in mbs])
    assert not torch.allclose(grad, grad_none, rtol=1e-3)
    loss, want = by_hand(mbs, weight=tis(0.0, 2.0))
    assert res.loss == pytest.approx(loss, rel=1e-9)
    assert torch.allclose(grad, want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize(("low", "high"), [(0.0, 2.0), (0.5, 1.5), (0.25, 3.0)])
def test_tis_truncates_the_weight_to_low_and_high(low, high):
    # some tokens far above high (rho = e^3), some far below low (rho = e^-3), the rest in between
    def shift(b, t):
        return (3.0, -3.0, 0.1, -0.1)[(b + t) % 4]

    mbs = [batch(seed=5, rollout_shift=shift)]
    res, grad = run(settings("tis", low=low, high=high), mbs)
    loss, want = by_hand(mbs, weight=tis(low, high))
    assert res.loss == pytest.approx(loss, rel=1e-9)
    assert torch.allclose(grad, want, rtol=1e-9, atol=1e-12)
    untruncated, _ = by_hand(mbs, weight=lambda o, r: math.exp(o - r))
    assert abs(untruncated - loss) > 1e-3  # truncation matters in this case


@pytest.mark.parametrize("high", [2.0, 3.0])
def test_tis_caps_one_tokens_weight_at_high(high):
    """One action token, ratio 1 to the old policy, advantage 1, the engine's log-prob 5 below the
    learner's: the loss is ``-A * 1 * high`` and the gradient ``high`` times the uncorrected one."""
    ids = torch.tensor([[1, 4, 2]])
    mask = torch.tensor([[False, False, True]])
    with torch.no_grad():
        old = bigram().logp(ids) * mask
    adv = mask.to(torch.float64)
    mb = PolicyBatch(
        input_ids=ids, action_mask=mask, old_logp=old, advantages=adv, rollout_logp=old - 5.0 * mask
    )
    res, grad = run(settings("tis", high=high), [mb])
    res_none, grad_none = run(settings("none"), [without_rollout(mb)])
    assert res.loss == pytest.approx(-high, rel=1e-9)
    assert res_none.loss == pytest.approx(-1.0, rel=1e-9)
    assert torch.allclose(grad, high * grad_none, rtol=1e-9, atol=1e-12)
    assert grad_none.abs().sum() > 0


def test_icepop_drops_tokens_outside_the_range():
    def shift(b, t):
        return (3.0, 0.2, -0.2)[(b + t) % 3]

    mbs = [batch(seed=6, rollout_shift=shift)]
    res, grad = run(settings("icepop", low=0.5, high=2.0), mbs)

    def icepop(old, rollout):
        rho = math.exp(old - rollout)
        return rho if 0.5 <= rho <= 2.0 else 0.0

    loss, want = by_hand(mbs, weight=icepop)
    assert res.loss == pytest.approx(loss, rel=1e-9)
    assert torch.allclose(grad, want, rtol=1e-9, atol=1e-12)


# ---------------------------------------------------------------------------------------------------
# from the configuration, through the update stage


class EngineActor:
    """A one-rank actor group whose ``train_policy`` runs the real ``ppo_actor_step`` on a bigram
    engine, as ``LearnerWorker.train_policy`` does."""

    def __init__(self) -> None:
        self.spec = None
        self.results = []

    def shards(self, items):
        return [list(items)]

    def forward(self, sequences, *, micro_batch_size, packing):
        raise AssertionError("not used")

    def train_policy(self, per_rank, *, settings):
        (mbs,) = per_rank
        engine = bigram(gas=len(mbs))
        res = ppo_actor_step(engine, mbs, **policy_step_args(settings))
        self.results.append((res, engine.table.grad.clone(), mbs))
        return res


def samples_for_update(seed: int) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    engine = bigram()
    out = []
    for i, n in enumerate((5, 7, 4, 6)):
        ids = torch.randint(0, VOCAB, (n,), generator=g)
        mask = torch.tensor([False, False] + [True] * (n - 2))
        with torch.no_grad():
            cur = engine.logp(ids[None])[0].float()
        old = (cur + 0.2 * (torch.rand(n, generator=g) - 0.5)) * mask
        rollout = (old - torch.tensor([(-1.5, 1.5, 0.2)[(i + t) % 3] for t in range(n)])) * mask
        s = Sample(
            token_ids=ids,
            action_mask=mask,
            rollout_logp=rollout.float(),
            score=0.0,
            reward=0.0,
            truncated=False,
            prompt_index=i // 2,
            weight_version=1,
        )
        s.old_logp, s.advantages = old.float(), torch.randn(n, generator=g) * mask
        out.append(s)
    return out


def cfg_of(*flags: str) -> PPOConfig:
    """The configuration of ``--a.b value`` pairs, validated by ``PPOConfig`` (as ``build_config`` does,
    without its slow flag parser; test_stages.py checks the two agree)."""
    tree: dict = {}
    for name, raw in zip(flags[::2], flags[1::2], strict=True):
        *parents, leaf = name.removeprefix("--").split(".")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = yaml.safe_load(raw)
    return PPOConfig.model_validate(tree)


def test_config_is_correction_reaches_the_loss_through_update():
    common = ["--train.warmup_sft_steps", "0", "--rollout.batch_size", "2", "--rollout.n_samples_per_prompt", "2", "--train.micro_batch_size", "2",
              "--train.packing", "false"]  # fmt: skip
    samples = samples_for_update(0)
    losses = {}
    for mode in ("none", "tis"):
        cfg = cfg_of(*common, "--algo.is_correction.mode", mode, "--algo.is_correction.high", "1.5")
        actor = EngineActor()
        upd = update(UpdateSettings.of(cfg), samples, actor=actor, critic=None, kl_coef=0.0)
        ((res, grad, mbs),) = actor.results
        assert upd.actor is res and len(mbs) == 2
        weight = tis(0.0, 1.5) if mode == "tis" else (lambda o, r: 1.0)
        loss, want = by_hand(mbs, weight=weight)
        assert res.loss == pytest.approx(loss, rel=1e-5)
        assert torch.allclose(grad, want, rtol=1e-5, atol=1e-8)
        losses[mode] = res.loss
    assert losses["tis"] != pytest.approx(losses["none"], rel=1e-3)
