"""On-policy distillation's per-token advantage, against its closed form on hand-made log-probs."""

import pytest
import torch
from rlhf_algos import AdvantageInputs, compute_advantages, distill_advantages, reverse_kl


def test_the_advantage_is_the_teachers_log_prob_minus_the_students_per_sampled_token():
    student = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-0.2, -0.3, 0.0, 0.0]])
    teacher = torch.tensor([[-0.5, -2.5, -0.5, 9.0], [-0.1, -1.3, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 0]], dtype=torch.bool)  # a hole (an environment's token)
    per_token = torch.tensor([[0.5, -0.5, 0.0, 0.0], [0.1, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(distill_advantages(student, teacher, mask), per_token)
    # discounted: each action token adds the later ones' at gamma^(their distance in action tokens)
    g = 0.5
    want = torch.tensor(
        [[0.5 + g * -0.5 + g * g * 0.0, -0.5 + g * 0.0, 0.0, 0.0], [0.1 + g * 0.0, 0.0, 0.0, 0.0]]
    )
    torch.testing.assert_close(distill_advantages(student, teacher, mask, discount=g), want)
    # the reverse KL estimate: mean over the action tokens of log student - log teacher
    assert float(reverse_kl(student, teacher, mask)) == pytest.approx((-0.5 + 0.5 + 0.0 - 0.1 + 0.0) / 5)
    assert float(reverse_kl(student, student, mask)) == 0.0  # a student that is its teacher
    with pytest.raises(ValueError, match="gamma must be in"):
        distill_advantages(student, teacher, mask, discount=1.5)


def test_the_distill_estimator_ignores_the_scores_and_mixing_at_zero_is_the_reward_alone():
    mask = torch.ones(4, 3, dtype=torch.bool)
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0])
    inputs = AdvantageInputs(scores=scores, mask=mask, n_samples_per_prompt=2)
    adv, ret = compute_advantages("distill", inputs)
    assert not adv.any() and not ret.any()  # the teacher's term is all there is
    grpo, _ = compute_advantages("group_norm", inputs)
    student, teacher = torch.randn(4, 3), torch.randn(4, 3)
    mixed = grpo + 0.0 * distill_advantages(student, teacher, mask)
    torch.testing.assert_close(mixed, grpo)
