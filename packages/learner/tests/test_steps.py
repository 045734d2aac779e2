"""Each update step lowers its loss on a fixed tiny batch, and its first reported loss equals the loss
function applied to a plain forward of the same batch; normalisation over accumulation windows.

The steps run on real DeepSpeed engines (a gloo group of one in the test process) and take their
loss math from rlhf-algos, as the CLI does.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F
from rlhf_algos import (
    aggregate_loss,
    approx_kl,
    dpo_loss,
    kto_kl_baseline,
    kto_loss,
    pairwise_rm_loss,
    policy_loss,
    sft_loss,
    value_loss,
    vllm_is_weights,
)
from rlhf_learner.models import Actor, load_causal_lm, load_critic, load_reference, load_reward_model
from rlhf_learner.steps import (
    DPOBatch,
    KTOBatch,
    ModelRows,
    PolicyBatch,
    RewardBatch,
    SFTBatch,
    ValueBatch,
    critic_step,
    dpo_step,
    kto_step,
    ppo_actor_step,
    reference_logp,
    reference_sequence_logp,
    reward_model_step,
    sft_step,
)
from rlhf_learner.strategy import Strategy, StrategyOptions

TOKEN_MEAN = functools.partial(aggregate_loss, mode="token-mean")


def _engine(model, *, stage=0, gas=1, lr=3e-3, **kw):
    s = Strategy(StrategyOptions(zero_stage=stage, grad_accum_steps=gas, lr=lr, **kw))
    return s.prepare(model)


def _rows(n_rows, length, seed, prompt=3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 400, (n_rows, length), generator=g)
    mask = torch.zeros(n_rows, length, dtype=torch.bool)
    mask[:, prompt:] = True
    return {
        "input_ids": ids,
        "attention_mask": torch.ones(n_rows, length, dtype=torch.long),
        "action_mask": mask,
    }


def _model_rows(mb):
    """The token rows of a dict micro-batch (what the reference functions read)."""
    return ModelRows(
        input_ids=mb["input_ids"],
        attention_mask=mb.get("attention_mask"),
        position_ids=mb.get("position_ids"),
    )


def _plain_logp(model, mb):
    """``[B, T]`` log-prob of each token and entropy of the distribution that predicted it, by hand
    from a plain Hugging Face forward (float64; column 0 has no prediction and holds 0)."""
    ids = mb["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mb["attention_mask"]).logits.double()
    logsm = torch.log_softmax(logits[:, :-1], dim=-1)
    logp = torch.zeros(ids.shape, dtype=torch.float64)
    entropy = torch.zeros(ids.shape, dtype=torch.float64)
    logp[:, 1:] = logsm.gather(-1, ids[:, 1:, None]).squeeze(-1)
    entropy[:, 1:] = -(logsm.exp() * logsm).sum(-1)
    return logp, entropy


def _plain_nll(model_dir, mbs):
    """Token-mean NLL over the loss masks of all micro-batches, from a freshly loaded model."""
    model = load_causal_lm(model_dir)
    total, tokens = 0.0, 0.0
    for mb in mbs:
        logp, _ = _plain_logp(model, mb)
        m = mb["loss_mask"].double()
        total, tokens = total - float((logp * m).sum()), tokens + float(m.sum())
    return total / tokens


def _plain_head(scalar_model, mb):
    """The scalar head on every hidden state, ``[B, T]`` (float64), by a plain forward."""
    with torch.no_grad():
        hidden = scalar_model.model.base_model(
            input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]
        ).last_hidden_state
        return scalar_model.model.score(hidden).squeeze(-1).double()


def _run(step, n=6):
    losses = [step().loss for _ in range(n)]
    return losses


def test_batches_check_their_shapes():
    ids = torch.zeros(4, 6, dtype=torch.long)
    ones = torch.ones(4, 6, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"PolicyBatch.advantages: shape \(4, 5\), input_ids has \(4, 6\)"):
        PolicyBatch(input_ids=ids, action_mask=ones, old_logp=torch.zeros(4, 6), advantages=torch.zeros(4, 5))
    with pytest.raises(ValueError, match=r"DPOBatch.ref_logp: shape \(2,\), expected \(4,\)"):
        DPOBatch(input_ids=ids, loss_mask=ones, ref_logp=torch.zeros(2))
    with pytest.raises(ValueError, match="3 rows, expected an even count"):
        RewardBatch(input_ids=ids[:3])
    with pytest.raises(ValueError, match=r"RewardBatch.margin: shape \(4,\), expected \(2,\)"):
        RewardBatch(input_ids=ids, margin=torch.zeros(4))
    with pytest.raises(ValueError, match=r"KTOBatch.desirable: shape \(4,\), expected \(2,\)"):
        KTOBatch(
            input_ids=ids, loss_mask=ones, ref_logp=torch.zeros(4), desirable=torch.ones(4, dtype=torch.bool)
        )
    with pytest.raises(ValueError, match="pad, do not pack"):
        DPOBatch(input_ids=ids, position_ids=ids, loss_mask=ones, ref_logp=torch.zeros(4))
    with pytest.raises(ValueError, match=r"SFTBatch.input_ids: expected a \[B, T\] tensor"):
        SFTBatch(input_ids=ids[0], loss_mask=ones[0])
    with pytest.raises(TypeError, match=r"SFTBatch.input_ids: expected a tensor, got list"):
        SFTBatch(input_ids=[[1, 2]], loss_mask=ones)
    with pytest.raises(TypeError, match=r"SFTBatch.loss_mask: expected a tensor, got list"):
        SFTBatch(input_ids=ids, loss_mask=[[True] * 6] * 4)
    with pytest.raises(TypeError, match="action_mask"):  # a field of another step
        SFTBatch(input_ids=ids, loss_mask=ones, action_mask=ones)
    batch = SFTBatch(input_ids=ids, attention_mask=ones.long(), loss_mask=ones)
    assert batch.model_inputs().keys() == {"attention_mask"}
    moved = batch.to("meta")
    assert {t.device.type for t in (moved.input_ids, moved.attention_mask, moved.loss_mask)} == {"meta"}
    assert batch.input_ids.device.type == "cpu" and isinstance(moved, SFTBatch)


def test_steps_name_a_micro_batch_of_the_wrong_type_or_a_missing_field(dist_single, tiny_model_dir):
    engine = _engine(Actor(load_causal_lm(tiny_model_dir)))
    mb = _rows(2, 6, 0)
    with pytest.raises(TypeError, match=r"micro_batches\[0\]: got dict, this step takes SFTBatch"):
        sft_step(
            engine, [{"input_ids": mb["input_ids"], "loss_mask": mb["action_mask"]}], sft_loss_fn=sft_loss
        )
    sft = SFTBatch(
        input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], loss_mask=mb["action_mask"]
    )
    with pytest.raises(TypeError, match="got SFTBatch, this step takes PolicyBatch"):
        ppo_actor_step(engine, [sft], policy_loss_fn=policy_loss, aggregate_fn=TOKEN_MEAN)
    zeros = torch.zeros(2, 6)
    policy = PolicyBatch(**mb, old_logp=zeros, advantages=zeros)
    kl = functools.partial(approx_kl, estimator="k3")
    with pytest.raises(ValueError, match=r"micro_batches\[0\].ref_logp: needed by kl_loss_fn"):
        ppo_actor_step(engine, [policy], policy_loss_fn=policy_loss, aggregate_fn=TOKEN_MEAN, kl_loss_fn=kl)
    with pytest.raises(ValueError, match=r"micro_batches\[0\].rollout_logp: needed by is_weights_fn"):
        ppo_actor_step(
            engine,
            [policy],
            policy_loss_fn=policy_loss,
            aggregate_fn=TOKEN_MEAN,
            is_weights_fn=vllm_is_weights,
        )


def test_ppo_actor_step_lowers_policy_loss(dist_single, tiny_model_dir):
    engine = _engine(Actor(load_causal_lm(tiny_model_dir)), stage=2, gas=2)
    ref = load_reference(tiny_model_dir)
    mbs = [_rows(2, 10, seed) for seed in (0, 1)]
    mbs[1]["action_mask"][1, 8:] = False  # micro-batches of unequal token counts (14 + 12)
    g = torch.Generator().manual_seed(5)
    for mb in mbs:
        mb["old_logp"] = reference_logp(engine, _model_rows(mb))
        mb["ref_logp"] = reference_logp(ref, _model_rows(mb))
        mb["rollout_logp"] = mb["old_logp"] + 0.01 * torch.randn(mb["old_logp"].shape, generator=g)
        mb["advantages"] = torch.randn(mb["old_logp"].shape, generator=g)
    pl = functools.partial(policy_loss, clip_eps_low=0.2, clip_eps_high=0.28)
    kl_fn = functools.partial(approx_kl, estimator="k3")
    is_fn = functools.partial(vllm_is_weights, mode="tis", high=2.0)

    def step(engine, mbs):
        return ppo_actor_step(
            engine,
            [PolicyBatch(**mb) for mb in mbs],
            policy_loss_fn=pl,
            aggregate_fn=TOKEN_MEAN,
            kl_loss_fn=kl_fn,
            kl_coef=0.01,
            entropy_coef=0.001,
            is_weights_fn=is_fn,
        )

    def by_hand(model, mbs):
        """The step's loss and metrics from the same loss functions on a plain forward of ``model``,
        summed over the micro-batches and divided by all masked tokens of the step."""
        total, pol, ent, tokens = 0.0, 0.0, 0.0, 0.0
        for mb in mbs:
            logp, entropy = _plain_logp(model, mb)
            mask, d = mb["action_mask"], torch.float64
            res = pl(
                logp,
                mb["old_logp"].to(d),
                mb["advantages"].to(d),
                mask,
                is_weights=is_fn(mb["old_logp"], mb["rollout_logp"], mask).to(d),
                entropy=entropy,
                entropy_coef=0.001,
            )
            kl = kl_fn(logp, mb["ref_logp"].to(d)) * mask
            total += float((res.loss + 0.01 * kl).sum())
            pol += float(res.loss.sum())
            ent += float((entropy * mask).sum())
            tokens += float(mask.sum())
        assert tokens == 26
        return total / tokens, pol / tokens, ent / tokens

    loss, pol, ent = by_hand(load_causal_lm(tiny_model_dir), mbs)  # the initial weights
    results = [step(engine, mbs) for _ in range(5)]
    first = results[0]
    assert first.loss == pytest.approx(loss, abs=1e-5)
    assert first.metrics["policy_loss"] == pytest.approx(pol, abs=1e-5)
    assert first.metrics["entropy"] == pytest.approx(ent, rel=1e-5)
    assert first.metrics["clip_frac"] == 0.0  # logp == old_logp: every ratio is 1
    assert first.metrics["kl"] == pytest.approx(0.0, abs=1e-6)  # same weights as the reference
    assert results[-1].loss < first.loss - 0.05
    assert results[-1].metrics["kl"] > 0
    assert first.metrics["entropy"] > 0 and first.grad_norm > 0

    # Clip fraction on a constructed case: old_logp = the current log-probs + a known shift, so the
    # ratio is exp(-shift) per token. With eps 0.2 / 0.28 a token is clipped iff ratio < 0.8 and A < 0,
    # or ratio > 1.28 and A > 0; exp(0.5) = 1.65, exp(-0.5) = 0.61, exp(-0.1) = 0.90 (inside).
    shifts = [0.5, -0.5, 0.0, 0.1, -0.5, 0.5]
    clipped, tokens = 0, 0
    shifted = []
    for k, mb in enumerate(mbs):
        cur = reference_logp(engine, _model_rows(mb))
        shift = torch.tensor(shifts)[torch.arange(cur.numel()) % len(shifts)].view(cur.shape)
        adv = torch.where(torch.arange(cur.numel()).view(cur.shape) % 4 < 2 - k, 1.0, -1.0)
        shifted.append({**mb, "old_logp": cur + shift, "advantages": adv})
        for b in range(cur.shape[0]):
            for t in range(cur.shape[1]):
                if not mb["action_mask"][b, t]:
                    continue
                ratio = math.exp(-float(shift[b, t]))
                a = float(adv[b, t])
                clipped += (ratio < 0.8 and a < 0) or (ratio > 1.28 and a > 0)
                tokens += 1
    assert 0 < clipped < tokens
    loss, pol, _ = by_hand(engine.module.model, shifted)  # the current weights, now away from the reference
    r = step(engine, shifted)
    assert r.metrics["clip_frac"] == pytest.approx(clipped / tokens, abs=1e-12)
    assert r.loss == pytest.approx(loss, abs=1e-5) and r.metrics["policy_loss"] == pytest.approx(
        pol, abs=1e-5
    )
    assert r.metrics["kl"] > 1e-4

    with pytest.raises(ValueError, match="grad_accum_steps"):
        ppo_actor_step(engine, [PolicyBatch(**mbs[0])], policy_loss_fn=policy_loss, aggregate_fn=TOKEN_MEAN)
    typed = [PolicyBatch(**mb) for mb in mbs]
    with pytest.raises(ValueError, match="kl_coef"):
        ppo_actor_step(engine, typed, policy_loss_fn=policy_loss, aggregate_fn=TOKEN_MEAN, kl_coef=0.1)


def test_aux_loss_coef_on_a_dense_model_names_the_option(dist_single, tiny_model_dir):
    engine = _engine(Actor(load_causal_lm(tiny_model_dir)))
    mb = _rows(1, 6, 0)
    mb["old_logp"] = reference_logp(engine, _model_rows(mb))
    mb["advantages"] = torch.ones(1, 6)
    with pytest.raises(ValueError, match="aux_loss_coef"):
        ppo_actor_step(
            engine,
            [PolicyBatch(**mb)],
            policy_loss_fn=policy_loss,
            aggregate_fn=TOKEN_MEAN,
            aux_loss_coef=0.01,
        )


def test_critic_step_lowers_value_loss(dist_single, tiny_model_dir):
    engine = _engine(load_critic(tiny_model_dir))
    mb = _rows(3, 8, 2)
    mb["action_mask"][2, 6:] = False
    g = torch.Generator().manual_seed(2)
    mb["returns"] = torch.randn(3, 8, generator=g)
    # V(x_<t) at column t: the head read at t - 1, by a plain forward of the initial weights
    values = torch.zeros(3, 8, dtype=torch.float64)
    values[:, 1:] = _plain_head(engine.module, mb)[:, :-1]
    # old values off by a known amount: with clip_eps=10 the loss must not depend on them
    mb["old_values"] = (values + 0.5 * torch.randn(3, 8, generator=g)).float()
    vl = functools.partial(value_loss, clip_eps=10.0)
    results = [
        critic_step(engine, [ValueBatch(**mb)], value_loss_fn=vl, aggregate_fn=TOKEN_MEAN) for _ in range(6)
    ]
    m = mb["action_mask"]
    expected = 0.5 * ((values - mb["returns"].double()) ** 2)[m].mean()
    assert results[0].loss == pytest.approx(float(expected), rel=1e-5)
    assert results[0].metrics["value_loss"] == pytest.approx(float(expected), rel=1e-5)
    assert results[0].metrics["values"] == pytest.approx(float(values[m].mean()), abs=1e-5)
    assert results[-1].loss < 0.7 * results[0].loss


def test_sft_step_lowers_nll(dist_single, tiny_model_dir):
    engine = _engine(Actor(load_causal_lm(tiny_model_dir)))
    mb = _rows(2, 12, 3)
    mb["loss_mask"] = mb.pop("action_mask")
    mb["loss_mask"][0, 9:] = False
    results = [sft_step(engine, [SFTBatch(**mb)], sft_loss_fn=sft_loss) for _ in range(6)]
    nll = _plain_nll(tiny_model_dir, [mb])  # token mean over the 6 + 9 target tokens
    assert results[0].loss == pytest.approx(nll, rel=1e-5)
    assert results[0].metrics["nll"] == pytest.approx(nll, rel=1e-5)
    assert results[-1].loss < results[0].loss - 0.5


def test_reward_model_step_separates_chosen_from_rejected(dist_single, tiny_model_dir, tmp_path):
    engine = _engine(load_reward_model(tiny_model_dir))
    chosen, rejected = _rows(3, 8, 4), _rows(3, 8, 5)
    mb = {k: torch.cat([chosen[k], rejected[k]]) for k in ("input_ids", "attention_mask")}
    # scores by hand: the head at each row's last token (no padding here), initial weights
    score = _plain_head(engine.module, mb)[:, -1]
    diff = score[:3] - score[3:]  # chosen - rejected, pair by pair
    results = [
        reward_model_step(engine, [RewardBatch(**mb)], pair_loss_fn=pairwise_rm_loss) for _ in range(6)
    ]
    assert results[0].loss == pytest.approx(float(-F.logsigmoid(diff).mean()), rel=1e-5)
    assert results[0].metrics["margin"] == pytest.approx(float(diff.mean()), abs=1e-5)
    assert results[0].metrics["accuracy"] == pytest.approx(float((diff > 0).double().mean()))
    assert results[-1].loss < results[0].loss - 0.2
    assert results[-1].metrics["accuracy"] == 1.0

    # Export with normalisation stats; the folder reloads as a reward model and as a critic's start.
    engine.module.set_normalization(mean=0.25, std=3.0)
    folder = Strategy(StrategyOptions()).export_hf(engine.module, tmp_path / "rm")
    with torch.no_grad():
        expect = engine.module(mb["input_ids"], attention_mask=mb["attention_mask"])
        again = load_reward_model(folder)
        torch.testing.assert_close(again(mb["input_ids"], attention_mask=mb["attention_mask"]), expect)
        critic = load_critic(folder)
        torch.testing.assert_close(critic.model.score.weight, engine.module.model.score.weight)
    assert again.config.reward_mean == 0.25 and again.config.normalize_reward


def _pairs(seed):
    chosen, rejected = _rows(2, 10, seed, prompt=4), _rows(2, 10, seed + 100, prompt=4)
    rejected["input_ids"][:, :4] = chosen["input_ids"][:, :4]  # same prompt
    mb = {k: torch.cat([chosen[k], rejected[k]]) for k in ("input_ids", "attention_mask")}
    mb["loss_mask"] = torch.cat([chosen["action_mask"], rejected["action_mask"]])
    return mb


def test_dpo_step_lowers_dpo_loss(dist_single, tiny_model_dir):
    engine = _engine(Actor(load_causal_lm(tiny_model_dir)))
    ref = load_reference(tiny_model_dir)
    mb = _pairs(6)
    # rows: chosen 0, 1, then rejected 0, 1; the reference is the initial policy shifted by known offsets
    offsets = torch.tensor([0.5, -0.3, -0.4, 0.2])
    mb["ref_logp"] = reference_sequence_logp(ref, _model_rows(mb), mb["loss_mask"]) + offsets
    results = [
        dpo_step(engine, [DPOBatch(**mb)], dpo_loss_fn=functools.partial(dpo_loss, beta=0.1))
        for _ in range(5)
    ]
    # at the first step policy == reference + offsets, so h = (-0.5 - 0.4, 0.3 + 0.2) = (-0.9, 0.5)
    h = (-0.9, 0.5)
    by_hand = sum(math.log1p(math.exp(-0.1 * x)) for x in h) / 2  # mean of -log sigmoid(beta * h)
    assert results[0].loss == pytest.approx(by_hand, abs=1e-5)
    assert results[0].metrics["logit_margin"] == pytest.approx(sum(h) / 2, abs=1e-4)
    assert results[0].metrics["accuracy"] == 0.5
    # ... and the same loss from a plain forward of the policy
    logp, _ = _plain_logp(load_causal_lm(tiny_model_dir), mb)
    seq = (logp * mb["loss_mask"]).sum(-1)
    ref_seq = mb["ref_logp"].double()
    plain = dpo_loss(seq[:2], seq[2:], ref_seq[:2], ref_seq[2:], beta=0.1).loss.mean()
    assert results[0].loss == pytest.approx(float(plain), abs=1e-5)
    assert results[-1].loss < results[0].loss - 0.1
    assert results[-1].metrics["accuracy"] == 1.0


def test_kto_step_lowers_kto_loss(dist_single, tiny_model_dir):
    engine = _engine(Actor(load_causal_lm(tiny_model_dir)))
    ref = load_reference(tiny_model_dir)
    mb = _pairs(7)  # rows: 2 examples, then 2 mismatched completions for the KL reference point
    # the reference is the initial policy shifted by known offsets: at the first step the examples'
    # log-ratios are r = (-0.5, 0.6) and the reference point z0 = max(0, mean(0.4, 0.2)) = 0.3
    offsets = torch.tensor([0.5, -0.6, -0.4, -0.2])
    mb["ref_logp"] = reference_sequence_logp(ref, _model_rows(mb), mb["loss_mask"]) + offsets
    mb["desirable"] = torch.tensor([True, False])
    step = functools.partial(
        kto_step, kto_loss_fn=functools.partial(kto_loss, beta=1.0), kl_baseline_fn=kto_kl_baseline
    )
    results = [step(engine, [KTOBatch(**mb)]) for _ in range(5)]

    def sigmoid(x):
        return 1 / (1 + math.exp(-x))

    # desirable: 1 - sigmoid(beta (r - z0)); undesirable: 1 - sigmoid(beta (z0 - r)). (beta = 1: with one
    # example of each kind, z0 cancels from the mean to first order, so a small beta would hide it.)
    by_hand = ((1 - sigmoid(-0.5 - 0.3)) + (1 - sigmoid(0.3 - 0.6))) / 2
    assert results[0].loss == pytest.approx(by_hand, abs=1e-5)
    assert results[0].metrics["kl_baseline"] == pytest.approx(0.3, abs=1e-5)
    assert results[-1].loss < results[0].loss - 0.02


def test_accumulation_window_normalisation_matches_one_big_batch(dist_single, tiny_model_dir):
    """Two uneven micro-batches (gas=2) give the same update as one micro-batch with all rows.
    (SGD, so the update is proportional to the gradient; Adam's first step is sign-like and would
    amplify rounding noise in near-zero gradient entries.)"""
    a, b = _rows(1, 12, 8, prompt=2), _rows(3, 6, 9, prompt=5)
    for mb in (a, b):
        mb["loss_mask"] = mb.pop("action_mask")
    width = 12
    whole = {k: torch.cat([a[k], torch.nn.functional.pad(b[k], (0, width - b[k].shape[1]))]) for k in a}
    init = {f"model.{k}": v for k, v in load_causal_lm(tiny_model_dir).state_dict().items()}
    states = []
    for gas, mbs in ((1, [whole]), (2, [a, b])):
        strategy = Strategy(StrategyOptions(zero_stage=0, grad_accum_steps=gas, grad_clip=None))
        engine = strategy.prepare(
            Actor(load_causal_lm(tiny_model_dir)), optimizer=lambda p: torch.optim.SGD(p, lr=1.0)
        )
        r = sft_step(engine, [SFTBatch(**mb) for mb in mbs], sft_loss_fn=sft_loss)
        states.append((r.loss, {k: v.detach().clone() for k, v in engine.module.state_dict().items()}))
    assert states[0][0] == pytest.approx(states[1][0], abs=1e-6)
    assert states[0][0] == pytest.approx(_plain_nll(tiny_model_dir, [a, b]), rel=1e-5)  # 10 + 3 * 1 tokens
    for k in states[0][1]:
        torch.testing.assert_close(states[0][1][k], states[1][1][k], atol=1e-6, rtol=0)
    moved = max((states[0][1][k] - v).abs().max().item() for k, v in init.items())
    assert moved > 1e-3


def test_torch_optimizer_passed_in_and_muon(dist_single, tiny_model_dir):
    model = Actor(load_causal_lm(tiny_model_dir))
    s = Strategy(StrategyOptions(zero_stage=0))
    engine = s.prepare(model, optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    mb = _rows(2, 8, 10)
    mb["loss_mask"] = mb.pop("action_mask")
    nll = _plain_nll(tiny_model_dir, [mb])
    losses = _run(lambda: sft_step(engine, [SFTBatch(**mb)], sft_loss_fn=sft_loss), n=3)
    assert losses[0] == pytest.approx(nll, rel=1e-5)
    assert losses[-1] < losses[0]
    muon = _engine(Actor(load_causal_lm(tiny_model_dir)), optimizer="muon", lr=2e-2)
    losses = _run(lambda: sft_step(muon, [SFTBatch(**mb)], sft_loss_fn=sft_loss), n=3)
    assert losses[0] == pytest.approx(nll, rel=1e-5)
    assert losses[-1] < losses[0]


@pytest.mark.parametrize(
    "opts",
    [
        {"zero_stage": 2, "offload_optimizer": True},
        {"zero_stage": 3, "offload_optimizer": True, "offload_params": True},
        {"zero_stage": 2, "precision": "bf16"},
    ],
    ids=["zero2-offload", "zero3-offload-all", "zero2-bf16"],
)
def test_offload_and_bf16_configurations_train(dist_single, tiny_model_dir, opts):
    strategy = Strategy(StrategyOptions(lr=1e-2, **opts))
    engine = strategy.prepare(Actor(load_causal_lm(tiny_model_dir, ds_config=strategy.ds_config())))
    mb = _rows(2, 10, 11)
    mb["loss_mask"] = mb.pop("action_mask")
    losses = _run(lambda: sft_step(engine, [SFTBatch(**mb)], sft_loss_fn=sft_loss), n=4)
    # the first loss is the fp32 NLL of the initial weights (bf16 forward: within its rounding)
    nll = _plain_nll(tiny_model_dir, [mb])
    assert losses[0] == pytest.approx(nll, rel=2e-2 if opts.get("precision") == "bf16" else 1e-5)
    assert losses[-1] < losses[0] - 0.2


def test_packed_micro_batch_gives_the_same_step_as_padded(dist_single, tiny_model_dir):
    """The same sequences, padded or packed, give the same loss and the same SGD update."""
    from rlhf_learner.packing import pack_sequences

    g = torch.Generator().manual_seed(12)
    seqs = []
    for n in (9, 4, 13, 6):
        mask = torch.ones(n, dtype=torch.bool)
        mask[0] = False  # the first token has no prediction in either layout
        seqs.append({"input_ids": torch.randint(3, 400, (n,), generator=g), "loss_mask": mask})
    width = 13
    padded = {
        "input_ids": torch.stack(
            [torch.nn.functional.pad(s["input_ids"], (0, width - len(s["input_ids"]))) for s in seqs]
        ),
        "loss_mask": torch.stack(
            [torch.nn.functional.pad(s["loss_mask"], (0, width - len(s["loss_mask"]))) for s in seqs]
        ),
        "attention_mask": torch.stack(
            [
                torch.nn.functional.pad(
                    torch.ones(len(s["input_ids"]), dtype=torch.long), (0, width - len(s["input_ids"]))
                )
                for s in seqs
            ]
        ),
    }
    packed = pack_sequences(seqs, max_tokens_per_row=16).tensors
    assert packed["input_ids"].shape[0] < len(seqs)
    out = []
    for mb in (padded, packed):
        strategy = Strategy(StrategyOptions(zero_stage=0, grad_clip=None))
        engine = strategy.prepare(
            Actor(load_causal_lm(tiny_model_dir)), optimizer=lambda p: torch.optim.SGD(p, lr=1.0)
        )
        loss = sft_step(engine, [SFTBatch(**mb)], sft_loss_fn=sft_loss).loss
        out.append((loss, {k: v.detach().clone() for k, v in engine.module.state_dict().items()}))
    assert out[0][0] == pytest.approx(out[1][0], abs=1e-5)
    for k in out[0][1]:
        torch.testing.assert_close(out[0][1][k], out[1][1][k], atol=1e-5, rtol=0)


def test_moe_router_aux_loss_is_added_with_its_coefficient(dist_single, tmp_path):
    """A tiny mixture-of-experts model (Mixtral): ``aux_loss_coef`` adds the router's balancing loss."""
    from transformers import AutoModelForCausalLM, MixtralConfig

    cfg = MixtralConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "moe")
    mb = _rows(2, 8, 13)
    losses = []
    for coef in (0.0, 1.0):
        engine = _engine(Actor(load_causal_lm(tmp_path / "moe")), lr=1e-6)
        mb["old_logp"] = reference_logp(engine, _model_rows(mb))
        mb["advantages"] = torch.ones(2, 8)
        r = ppo_actor_step(
            engine,
            [PolicyBatch(**mb)],
            policy_loss_fn=policy_loss,
            aggregate_fn=TOKEN_MEAN,
            aux_loss_coef=coef,
        )
        losses.append(r.loss)
    # Same weights and data, ratio 1 and advantage 1: the policy loss is -1 per token, and coef=1 adds the
    # router's balancing loss, as the plain model reports it for this batch.
    moe = AutoModelForCausalLM.from_pretrained(tmp_path / "moe")
    with torch.no_grad():
        aux = moe(
            input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], output_router_logits=True
        ).aux_loss
    assert losses[0] == pytest.approx(-1.0, abs=1e-5)
    assert losses[1] == pytest.approx(-1.0 + float(aux), abs=1e-5)
    assert losses[1] - losses[0] > 0.5  # about 1 for balanced routing


def test_checkpoint_errors_are_clear(dist_single, tiny_model_dir, tmp_path):
    strategy = Strategy(StrategyOptions(zero_stage=0))
    engine = strategy.prepare(Actor(load_causal_lm(tiny_model_dir)))
    with pytest.raises(ValueError, match="does not exist"):
        strategy.load_checkpoint(engine, tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no 'latest' file"):
        strategy.load_checkpoint(engine, tmp_path / "empty")


def test_offloaded_zero3_reference_gives_the_plain_reference_logprobs(dist_single, tiny_model_dir):
    strategy = Strategy(StrategyOptions(zero_stage=3, offload_params=True))
    ref = strategy.prepare(
        load_reference(tiny_model_dir, ds_config=strategy.ds_config(train=False)), train=False
    )
    plain = load_reference(tiny_model_dir)
    mb = _rows(2, 9, 14)
    torch.testing.assert_close(
        reference_logp(ref, _model_rows(mb)), reference_logp(plain, _model_rows(mb)), atol=1e-5, rtol=0
    )


def test_fp32_zero_stage_0_reports_the_gradient_norm_zero_2_reports(dist_single, tiny_model_dir):
    """DeepSpeed clips stage-0 fp32 gradients without keeping their norm: the step measures it itself,
    before the clip, over the whole window (two micro-batches), equal to what ZeRO-2 reports."""
    mbs = [_rows(2, 12, seed) for seed in (3, 4)]
    for mb in mbs:
        mb["loss_mask"] = mb.pop("action_mask")
    norms = {}
    for stage in (0, 2):
        engine = _engine(Actor(load_causal_lm(tiny_model_dir)), stage=stage, gas=2, grad_clip=1e-3)
        norms[stage] = [
            sft_step(engine, [SFTBatch(**mb) for mb in mbs], sft_loss_fn=sft_loss).grad_norm for _ in range(2)
        ]
    assert norms[0][0] is not None and norms[0][0] > 1e-3  # clipped: the norm is the one before the clip
    assert norms[0] == pytest.approx(norms[2], rel=1e-4)


def test_zero2_on_one_rank_runs_as_stage_0_with_the_same_updates(dist_single, tiny_model_dir):
    """``for_ranks(1)`` turns ZeRO-2 into stage 0 (nothing to shard on one rank): three AdamW steps with
    gradient clipping move the weights as ZeRO-2's partitioned optimizer does. Kept: offload (it needs
    ZeRO) and bf16 with accumulation (stage 0 would sum the gradients in bf16)."""
    zero2 = StrategyOptions(zero_stage=2, lr=3e-3, grad_clip=0.5)
    assert zero2.for_ranks(1).zero_stage == 0 and zero2.for_ranks(2).zero_stage == 2
    assert StrategyOptions(zero_stage=2, offload_optimizer=True).for_ranks(1).zero_stage == 2
    assert StrategyOptions(zero_stage=1, precision="bf16", grad_accum_steps=2).for_ranks(1).zero_stage == 1
    assert StrategyOptions(zero_stage=1, precision="bf16").for_ranks(1).zero_stage == 0
    mb = _rows(2, 12, 3)
    mb["loss_mask"] = mb.pop("action_mask")
    states = []
    for options in (zero2, zero2.for_ranks(1)):
        engine = Strategy(options).prepare(Actor(load_causal_lm(tiny_model_dir)))
        losses = [sft_step(engine, [SFTBatch(**mb)], sft_loss_fn=sft_loss).loss for _ in range(3)]
        states.append((losses, {k: v.detach().clone() for k, v in engine.module.state_dict().items()}))
    assert states[0][0] == pytest.approx(states[1][0], rel=1e-5)
    for k, v in states[0][1].items():
        torch.testing.assert_close(states[1][1][k], v, atol=1e-5, rtol=1e-4)


def test_bf16_on_one_rank_skips_the_all_reduce_with_the_same_updates(dist_single, tiny_model_dir):
    """A one-rank bf16 ZeRO-0 engine skips DeepSpeed's gradient all-reduce (a group of one: nothing to
    average) and moves the weights bit for bit as with it, a parameter without a gradient included (the
    frozen-then-unused case: the wrapper gives it a zero gradient, as the all-reduce would)."""
    options = StrategyOptions(zero_stage=0, precision="bf16", lr=3e-3, grad_clip=0.5, weight_decay=1.0)
    mb = _rows(2, 12, 3)
    mb["loss_mask"] = mb.pop("action_mask")
    states = []
    for reduce in (False, True):
        torch.manual_seed(0)
        model = load_causal_lm(tiny_model_dir)
        unused = torch.nn.Parameter(torch.ones(3))
        model.register_parameter("unused_extra", unused)  # trained, but no loss reaches it
        engine = Strategy(options).prepare(Actor(model))
        assert engine.enable_backward_allreduce is False
        engine.enable_backward_allreduce = reduce
        for _ in range(3):
            sft_step(engine, [SFTBatch(**mb)], sft_loss_fn=sft_loss)
        states.append({k: v.detach().clone() for k, v in engine.module.state_dict().items()})
    assert float(states[0]["model.unused_extra"][0]) < 1.0  # weight decay reached it
    for k, v in states[1].items():
        assert torch.equal(states[0][k], v), k
    one = Strategy(StrategyOptions(zero_stage=0)).prepare(Actor(load_causal_lm(tiny_model_dir)))
    assert one.enable_backward_allreduce  # fp32 keeps it: its plain optimizer skips None gradients


def test_reference_log_probs_asked_for_after_each_forward_give_the_same_step(dist_single, tiny_model_dir):
    """``ref_logp_of`` (reference log-probs bound late, while a reference forward elsewhere may still
    run) gives the loss, metrics and update of the same log-probs in the batches, and is asked for
    micro-batch ``i``'s only once its forward has run."""
    ref = load_reference(tiny_model_dir)
    mbs = [_rows(2, 10, seed) for seed in (3, 4)]
    g = torch.Generator().manual_seed(6)
    refs = []
    for mb in mbs:
        refs.append(
            reference_logp(ref, _model_rows(mb)) + 0.05 * torch.randn(mb["input_ids"].shape, generator=g)
        )
        mb["advantages"] = torch.randn(mb["input_ids"].shape, generator=g)
    kw = dict(
        policy_loss_fn=functools.partial(policy_loss, clip_eps_low=0.2, clip_eps_high=0.2),
        aggregate_fn=TOKEN_MEAN,
        kl_loss_fn=functools.partial(approx_kl, estimator="k3"),
        kl_coef=0.5,
    )
    results, weights = [], []
    for late in (False, True):
        strategy = Strategy(StrategyOptions(zero_stage=0, grad_accum_steps=2, grad_clip=None))
        engine = strategy.prepare(
            Actor(load_causal_lm(tiny_model_dir)), optimizer=lambda p: torch.optim.SGD(p, lr=1.0)
        )
        forwards, asked = [], []
        engine.module.register_forward_hook(lambda *_, forwards=forwards: forwards.append(1))

        def ref_logp_of(i, asked=asked, forwards=forwards):
            asked.append((i, len(forwards)))
            return refs[i]

        if late:
            r = ppo_actor_step(engine, [PolicyBatch(**mb) for mb in mbs], ref_logp_of=ref_logp_of, **kw)
            assert asked == [(0, 1), (1, 2)]  # each after its own forward, none before
        else:
            batches = [PolicyBatch(**mb, ref_logp=lp) for mb, lp in zip(mbs, refs, strict=True)]
            r = ppo_actor_step(engine, batches, **kw)
        results.append(r)
        weights.append({k: v.detach().clone() for k, v in engine.module.state_dict().items()})
    assert results[1].loss == pytest.approx(results[0].loss, abs=1e-6)
    assert results[1].metrics["kl"] == pytest.approx(results[0].metrics["kl"], rel=1e-6)
    assert results[0].metrics["kl"] > 1e-4
    for k in weights[0]:
        torch.testing.assert_close(weights[1][k], weights[0][k], atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="ref_logp_of"):
        ppo_actor_step(engine, [PolicyBatch(**mb) for mb in mbs], ref_logp_of=lambda i: refs[i][:, 1:], **kw)
