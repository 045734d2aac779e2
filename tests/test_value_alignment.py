"""The critic's values sit where GAE expects them: the value used for an action token is the value of
the state before it. Hand-built case where reading the head one position late changes the advantage."""

from __future__ import annotations

import torch
from rlhf_algos import gae
from rlhf_learner import load_critic


def test_gae_uses_the_value_of_the_state_before_each_action(tiny_model_dir):
    critic = load_critic(tiny_model_dir)
    ids = torch.tensor([[5, 17, 42, 99, 7, 23]])
    prompt_len = 3
    action = torch.zeros_like(ids, dtype=torch.bool)
    action[0, prompt_len:] = True
    with torch.no_grad():
        head = critic.values(ids)  # V(x_<=t) at column t
        values = critic(ids)  # what the PPO recipe hands to GAE
    assert head[0].unique().numel() == ids.shape[1]  # distinct values: an off-by-one shows

    reward = torch.zeros(1, ids.shape[1])
    reward[0, -1] = 1.0
    adv, ret = gae(reward, values, action, gamma=1.0, lam=1.0)
    # gamma = lam = 1: A_t = R - V(state before t) = 1 - head[t - 1] for every action token t.
    expected = torch.zeros_like(reward)
    for t in range(prompt_len, ids.shape[1]):
        expected[0, t] = 1.0 - head[0, t - 1]
    torch.testing.assert_close(adv, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(ret[action], torch.ones(3), atol=1e-6, rtol=0)

    # lam < 1: each action's delta uses V(state before it) and V(state before the next action).
    adv_half, _ = gae(reward, values, action, gamma=1.0, lam=0.5)
    v = [head[0, t - 1] for t in range(prompt_len, ids.shape[1])]
    deltas = [v[1] - v[0], v[2] - v[1], 1.0 - v[2]]
    want = [deltas[0] + 0.5 * deltas[1] + 0.25 * deltas[2], deltas[1] + 0.5 * deltas[2], deltas[2]]
    torch.testing.assert_close(adv_half[0, prompt_len:], torch.stack(want), atol=1e-6, rtol=0)

    # The head read at the action token itself (the off-by-one) gives other advantages.
    wrong, _ = gae(reward, head, action, gamma=1.0, lam=1.0)
    assert (wrong - expected)[action].abs().max() > 1e-3
