import pytest
import torch
from rlhf_algos import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    AdvantageInputs,
    compute_advantages,
    group_shaped_rewards,
    register_estimator,
    token_level_rewards,
)


def shaping_reference(rewards, estimator):
    out = torch.zeros_like(rewards)
    for p in range(rewards.shape[0]):
        row = rewards[p].tolist()
        n = len(row)
        mean = sum(row) / n
        std = (sum((x - mean) ** 2 for x in row) / (n - 1)) ** 0.5
        for i, r in enumerate(row):
            others = [x for j, x in enumerate(row) if j != i]
            out[p, i] = {
                "rloo": r - sum(others) / (n - 1),
                "reinforce_baseline": r - mean,
                "dr_grpo": r - mean,
                "group_norm": (r - mean) / (std + 1e-6),
            }[estimator]
    return out


@pytest.mark.parametrize("estimator", ["rloo", "reinforce_baseline", "group_norm", "dr_grpo"])
def test_group_shaping_matches_reference(gen, estimator):
    rewards = torch.randn(5, 4, generator=gen)
    torch.testing.assert_close(
        group_shaped_rewards(rewards, estimator), shaping_reference(rewards, estimator)
    )


def test_group_shaping_edge_cases():
    same = torch.ones(3, 4)
    assert (group_shaped_rewards(same, "group_norm") == 0).all()  # all-equal groups: no signal, no NaN
    with pytest.raises(ValueError, match="at least 2 samples per prompt"):
        group_shaped_rewards(torch.ones(3, 1), "rloo")
    with pytest.raises(ValueError, match="non-finite"):
        group_shaped_rewards(torch.tensor([[1.0, float("nan")]]), "group_norm")
    with pytest.raises(ValueError, match="unknown group shaping"):
        group_shaped_rewards(torch.ones(2, 2), "grpo")


def test_token_level_rewards_places_score_on_last_action_token():
    mask = torch.tensor([[0, 1, 1, 0, 1, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    kl = torch.full((2, 6), 0.5)
    r = token_level_rewards(torch.tensor([3.0, -7.0]), mask, kl=kl, kl_coef=0.1, reward_clip=5.0)
    expected = torch.tensor([[0.0, -0.05, -0.05, 0.0, 3.0 - 0.05, 0.0], [-0.05] * 5 + [-5.0 - 0.05]])
    torch.testing.assert_close(r, expected)
    with pytest.raises(ValueError, match="row 1 is empty"):
        token_level_rewards(torch.ones(2), torch.tensor([[1, 0], [0, 0]], dtype=torch.bool))


def test_registry_names_and_rules():
    assert set(ADVANTAGE_ESTIMATORS) == {
        "gae",
        "reinforce",
        "reinforce_baseline",
        "rloo",
        "group_norm",
        "dr_grpo",
        "distill",
    }
    with pytest.raises(ValueError, match="already registered"):
        register_estimator(AdvantageEstimator(name="gae", group_shaping=None, uses_critic=True, whiten=False))
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'"):
        compute_advantages("ppo", AdvantageInputs(scores=torch.ones(2), mask=torch.ones(2, 3)))


def test_estimator_names_have_one_source_and_the_registry_is_read_only():
    from typing import get_args

    from rlhf_algos import BUILTIN_ESTIMATORS, EstimatorName

    names = get_args(EstimatorName)
    assert names == ("gae", "reinforce", "reinforce_baseline", "rloo", "group_norm", "dr_grpo", "distill")
    assert all(ADVANTAGE_ESTIMATORS[n] is e for n, e in zip(names, BUILTIN_ESTIMATORS, strict=True))
    with pytest.raises(TypeError):
        ADVANTAGE_ESTIMATORS["mine"] = ADVANTAGE_ESTIMATORS["gae"]  # type: ignore[index]
    with pytest.raises(TypeError):
        del ADVANTAGE_ESTIMATORS["gae"]  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", ["rloo", "group_norm", "dr_grpo", "reinforce_baseline"])
def test_group_estimators_reject_single_sample(name):
    inputs = AdvantageInputs(scores=torch.ones(4), mask=torch.ones(4, 3), n_samples_per_prompt=1)
    with pytest.raises(ValueError, match="n_samples_per_prompt >= 2"):
        compute_advantages(name, inputs)


def test_group_norm_without_kl_broadcasts_shaped_score_to_every_action_token(make_mask, gen):
    mask = make_mask(8, 20, gen=gen, holes=True)
    scores = torch.randn(8, generator=gen)
    adv, ret = compute_advantages(
        "group_norm", AdvantageInputs(scores=scores, mask=mask, n_samples_per_prompt=4)
    )
    shaped = shaping_reference(scores.view(2, 4), "group_norm").view(-1)
    torch.testing.assert_close(adv, shaped[:, None] * mask)
    torch.testing.assert_close(ret, adv)


def test_rloo_with_kl_matches_hand_pipeline(make_mask, gen):
    mask = make_mask(6, 12, gen=gen, holes=True)
    scores, kl = torch.randn(6, generator=gen), torch.rand(6, 12, generator=gen)
    adv, ret = compute_advantages(
        "rloo", AdvantageInputs(scores=scores, mask=mask, kl=kl, n_samples_per_prompt=3), kl_coef=0.05
    )
    shaped = shaping_reference(scores.view(2, 3), "rloo").view(-1)
    expected_ret = torch.zeros(6, 12)
    for b in range(6):
        g, steps = 0.0, mask[b].nonzero().flatten().tolist()
        for t in reversed(steps):
            g += -0.05 * float(kl[b, t]) + (float(shaped[b]) if t == steps[-1] else 0.0)
            expected_ret[b, t] = g
    torch.testing.assert_close(ret, expected_ret, atol=1e-5, rtol=1e-5)
    sel = adv[mask]
    assert abs(float(sel.mean())) < 1e-5 and abs(float(sel.std()) - 1.0) < 1e-3  # whitened


def gae_estimator_reference(scores, values, mask, gamma, lam):
    """The gae estimator by hand: the score on each row's last action token, textbook GAE over the
    action tokens (holes skipped), returns = advantages + values, advantages whitened over the batch."""
    adv = torch.zeros(mask.shape, dtype=torch.float64)
    for b in range(mask.shape[0]):
        steps = mask[b].nonzero().flatten().tolist()
        last = 0.0
        for i in reversed(range(len(steps))):
            t = steps[i]
            reward = float(scores[b]) if i == len(steps) - 1 else 0.0
            next_v = float(values[b, steps[i + 1]]) if i + 1 < len(steps) else 0.0
            last = reward + gamma * next_v - float(values[b, t]) + gamma * lam * last
            adv[b, t] = last
    ret = (adv + values.double()) * mask
    sel = adv[mask]
    mean, var = sel.mean(), sel.var(unbiased=True)
    whitened = (adv - mean) / torch.sqrt(var + 1e-8) * mask
    return whitened, ret


def test_gae_estimator_needs_values(make_mask, gen):
    mask = make_mask(4, 9, gen=gen, holes=False)
    inputs = AdvantageInputs(scores=torch.randn(4, generator=gen), mask=mask)
    with pytest.raises(ValueError, match="needs critic values"):
        compute_advantages("gae", inputs)
    values = torch.randn(4, 9, generator=gen)
    _, ret = compute_advantages(
        "gae", AdvantageInputs(scores=inputs.scores, mask=mask, values=values), gamma=1.0, lam=0.95
    )
    # with gamma=1 the return at the last action token is that token's reward (the score).
    last = mask.long().cumsum(-1).argmax(-1)
    torch.testing.assert_close(ret[torch.arange(4), last], inputs.scores)


@pytest.mark.parametrize(("gamma", "lam"), [(0.9, 0.8), (1.0, 0.95), (0.99, 0.0)])
def test_gae_estimator_matches_reference_over_the_given_values(make_mask, gen, gamma, lam):
    mask = make_mask(6, 16, gen=gen, holes=True)
    scores = torch.randn(6, generator=gen)
    values = torch.randn(6, 16, generator=gen)
    adv, ret = compute_advantages(
        "gae", AdvantageInputs(scores=scores, mask=mask, values=values), gamma=gamma, lam=lam
    )
    ref_adv, ref_ret = gae_estimator_reference(scores, values, mask, gamma, lam)
    torch.testing.assert_close(adv.double(), ref_adv, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret.double(), ref_ret, atol=1e-5, rtol=1e-5)

    # Raise the value of one action token (the j-th of row b, not its last) by d: delta_j falls by d and
    # delta_{j-1} rises by gamma * d, so the raw advantage at step i changes by -d (i == j),
    # gamma * d * (1 - lam) * (gamma * lam) ** (j - 1 - i) (i < j), 0 (i > j and other rows); the return
    # (advantage + value) by 0 at j and the same amount before it.
    b = int(mask.sum(-1).argmax())
    steps = mask[b].nonzero().flatten().tolist()
    j, d = len(steps) // 2, 0.75
    assert 0 < j < len(steps) - 1
    bumped = values.clone()
    bumped[b, steps[j]] += d
    adv2, ret2 = compute_advantages(
        "gae", AdvantageInputs(scores=scores, mask=mask, values=bumped), gamma=gamma, lam=lam
    )
    expected_ret_change = torch.zeros(6, 16, dtype=torch.float64)
    for i in range(j):
        expected_ret_change[b, steps[i]] = gamma * d * (1 - lam) * (gamma * lam) ** (j - 1 - i)
    torch.testing.assert_close((ret2 - ret).double(), expected_ret_change, atol=1e-5, rtol=1e-5)
    raw_change = expected_ret_change.clone()
    raw_change[b, steps[j]] = -d
    # the advantages are whitened: whitening the changed raw advantages gives the new ones
    raw_adv = ref_ret - values.double() * mask
    sel = (raw_adv + raw_change)[mask]
    expected_adv2 = ((raw_adv + raw_change) - sel.mean()) / torch.sqrt(sel.var() + 1e-8) * mask
    torch.testing.assert_close(adv2.double(), expected_adv2, atol=1e-5, rtol=1e-5)
    assert (adv2 - adv).abs().max() > 0.05
