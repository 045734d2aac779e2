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
    }
    with pytest.raises(ValueError, match="already registered"):
        register_estimator(AdvantageEstimator(name="gae", group_shaping=None, uses_critic=True, whiten=False))
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'"):
        compute_advantages("ppo", AdvantageInputs(scores=torch.ones(2), mask=torch.ones(2, 3)))


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


def test_gae_estimator_needs_values_and_uses_them(make_mask, gen):
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
