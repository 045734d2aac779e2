"""rlhf-algos alone (torch is its only dependency): GRPO-style advantages and the clipped policy loss
on a toy batch, the way any trainer can use them.

    uv run python examples/algos_only.py
"""

from __future__ import annotations

import torch
from rlhf_algos import AdvantageInputs, aggregate_loss, compute_advantages, policy_loss


def main() -> dict[str, float]:
    torch.manual_seed(0)
    # 2 prompts x 4 samples, 5 response tokens each (the last sample of prompt 1 stopped after 3)
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.5])
    mask = torch.ones(8, 5, dtype=torch.bool)
    mask[7, 3:] = False
    advantages, _ = compute_advantages(
        "group_norm", AdvantageInputs(scores=scores, mask=mask, n_samples_per_prompt=4)
    )
    # each group's advantages are centred: a better-than-its-group sample is pushed up
    per_sample = advantages[:, 0]
    for group in per_sample.view(2, 4):
        assert abs(float(group.mean())) < 1e-5

    old_logp = torch.randn(8, 5) - 2.0  # the sampler's log-probs of the response tokens
    logp = (old_logp + 0.05 * torch.randn(8, 5)).requires_grad_()  # the learner's, after some updates
    out = policy_loss(logp, old_logp, advantages, mask, clip_eps_low=0.2, clip_eps_high=0.28)
    loss = aggregate_loss(out.loss, mask, "token-mean")
    loss.backward()
    # the gradient raises the log-probs of samples with positive advantage
    assert float((logp.grad[per_sample > 0] * mask[per_sample > 0]).sum()) < 0
    result = {"loss": loss.item(), "clip_frac": float(out.clipped[mask].float().mean())}
    print(f"advantages per sample: {[round(float(a), 3) for a in per_sample]}")
    print(f"policy loss {result['loss']:.4f}, clipped fraction {result['clip_frac']:.3f}")
    return result


if __name__ == "__main__":
    main()
