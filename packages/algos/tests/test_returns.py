import pytest
import torch
from rlhf_algos import discounted_returns, gae


def gae_reference(rewards, values, mask, gamma, lam):
    """Textbook GAE over each row's action tokens, skipping holes."""
    adv = torch.zeros_like(rewards, dtype=torch.float64)
    for b in range(rewards.shape[0]):
        steps = mask[b].nonzero().flatten().tolist()
        last = 0.0
        for i in reversed(range(len(steps))):
            t = steps[i]
            next_v = float(values[b, steps[i + 1]]) if i + 1 < len(steps) else 0.0
            delta = float(rewards[b, t]) + gamma * next_v - float(values[b, t])
            last = delta + gamma * lam * last
            adv[b, t] = last
    ret = (adv + values.double()) * mask
    return adv, ret


def returns_reference(rewards, mask, gamma):
    out = torch.zeros_like(rewards, dtype=torch.float64)
    for b in range(rewards.shape[0]):
        g = 0.0
        for t in reversed(mask[b].nonzero().flatten().tolist()):
            g = float(rewards[b, t]) + gamma * g
            out[b, t] = g
    return out


@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize("time", [7, 64, 300])
@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.99, 0.95), (0.5, 0.0)])
def test_gae_matches_reference_loop(make_mask, gen, holes, time, gamma, lam):
    mask = make_mask(6, time, gen=gen, holes=holes)
    rewards = torch.randn(6, time, generator=gen)
    values = torch.randn(6, time, generator=gen)
    adv, ret = gae(rewards, values, mask, gamma=gamma, lam=lam)
    ref_adv, ref_ret = gae_reference(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv.double(), ref_adv, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ret.double(), ref_ret, atol=2e-5, rtol=1e-5)
    assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()


@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_discounted_returns_match_reference_loop(make_mask, gen, holes, gamma):
    mask = make_mask(5, 2100, gen=gen, holes=holes)
    rewards = torch.randn(5, 2100, generator=gen) * mask
    out = discounted_returns(rewards, mask, gamma=gamma)
    ref = returns_reference(rewards, mask, gamma)
    torch.testing.assert_close(out.double(), ref, atol=5e-4 if gamma == 1.0 else 2e-5, rtol=1e-5)


def test_holes_are_skipped_not_counted_as_steps():
    # One action, a 3-token environment hole, one action: the hole must not add discounting.
    mask = torch.tensor([[1, 0, 0, 0, 1]], dtype=torch.bool)
    rewards = torch.tensor([[0.0, 5.0, 5.0, 5.0, 1.0]])  # rewards on hole tokens are ignored
    out = discounted_returns(rewards, mask, gamma=0.5)
    torch.testing.assert_close(out, torch.tensor([[0.5, 0.0, 0.0, 0.0, 1.0]]))


@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.9, 0.7)])
def test_empty_rows_give_zeros_and_the_other_rows_match_the_reference(gen, gamma, lam, holes):
    mask = torch.zeros(4, 10, dtype=torch.bool)
    mask[1, 2:5] = True  # rows 0 and 3 are empty
    mask[2, [1, 2, 6, 9] if holes else [6, 7, 8]] = True
    rewards = torch.randn(4, 10, generator=gen)
    values = torch.randn(4, 10, generator=gen)
    adv, ret = gae(rewards, values, mask, gamma=gamma, lam=lam)
    ref_adv, ref_ret = gae_reference(rewards, values, mask, gamma, lam)
    for b in range(4):  # every row, the empty ones (all zeros) included
        torch.testing.assert_close(adv[b].double(), ref_adv[b], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(ret[b].double(), ref_ret[b], atol=1e-6, rtol=1e-6)
    assert (adv[0] == 0).all() and (ret[0] == 0).all() and (adv[3] == 0).all() and (ret[3] == 0).all()
    assert (ref_adv[1:3][mask[1:3]] != 0).all()
    out = discounted_returns(rewards, mask, gamma=gamma)
    ref = returns_reference(rewards, mask, gamma)
    for b in range(4):
        torch.testing.assert_close(out[b].double(), ref[b], atol=1e-6, rtol=1e-6)
    assert (out[0] == 0).all() and (out[3] == 0).all()


def test_nan_in_action_token_is_a_clear_error():
    mask = torch.ones(2, 4, dtype=torch.bool)
    values = torch.zeros(2, 4)
    values[1, 2] = float("nan")
    with pytest.raises(ValueError, match=r"values contains a non-finite value .* index \(1, 2\)"):
        gae(torch.zeros(2, 4), values, mask, gamma=1.0, lam=1.0)


def test_nan_outside_the_mask_is_ignored():
    mask = torch.tensor([[1, 1, 0]], dtype=torch.bool)
    values = torch.tensor([[0.0, 0.0, float("nan")]])
    adv, _ = gae(torch.tensor([[0.0, 1.0, 0.0]]), values, mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, torch.tensor([[1.0, 1.0, 0.0]]))


def test_bad_shapes_and_coefficients():
    with pytest.raises(ValueError, match="shape mismatch"):
        gae(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3), gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match="gamma"):
        discounted_returns(torch.zeros(1, 3), torch.ones(1, 3), gamma=1.5)
