"""Distillation math: on-policy advantages and offline divergences, against closed forms on hand-made log-probs."""

import pytest
import torch
from rlhf_algos import (
    AdvantageInputs,
    compute_advantages,
    distill_advantages,
    generalized_jsd,
    reverse_kl,
    token_divergence,
    with_rest,
)


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


def _dist(*probs: float) -> torch.Tensor:
    return torch.tensor(probs).log()


def test_each_divergence_equals_its_closed_form_on_a_hand_made_pair():
    s, t = _dist(0.5, 0.25, 0.25), _dist(0.25, 0.25, 0.5)
    ps, pt = s.exp(), t.exp()
    fwd = float((pt * (pt / ps).log()).sum())
    rev = float((ps * (ps / pt).log()).sum())
    assert float(token_divergence(s, t, loss="forward_kl")) == pytest.approx(fwd)
    assert float(token_divergence(s, t, loss="reverse_kl")) == pytest.approx(rev)
    m = 0.3 * pt + 0.7 * ps
    jsd = 0.3 * float((pt * (pt / m).log()).sum()) + 0.7 * float((ps * (ps / m).log()).sum())
    assert float(token_divergence(s, t, loss="jsd", beta=0.3)) == pytest.approx(jsd)


def test_divergences_vanish_when_the_student_is_the_teacher_and_handle_zero_probabilities():
    t = torch.log_softmax(torch.randn(4, 7), -1)
    for loss in ("forward_kl", "reverse_kl", "jsd"):
        torch.testing.assert_close(token_divergence(t, t, loss=loss), torch.zeros(4), atol=1e-6, rtol=0)
    s, t = _dist(0.5, 0.5, 0.0), _dist(0.5, 0.25, 0.25)
    assert torch.isfinite(token_divergence(s, t, loss="reverse_kl"))  # 0 log 0 = 0
    assert torch.isinf(
        token_divergence(s, t, loss="forward_kl")
    )  # the teacher's mass where the student has none


def test_jsd_tends_to_the_scaled_kls_at_its_ends_and_checks_beta():
    s, t = torch.log_softmax(torch.randn(5), -1), torch.log_softmax(torch.randn(5), -1)
    b = 1e-4
    fwd, rev = token_divergence(s, t, loss="forward_kl"), token_divergence(s, t, loss="reverse_kl")
    assert float(generalized_jsd(s, t, b) / b) == pytest.approx(float(fwd), rel=1e-2)
    assert float(generalized_jsd(s, t, 1 - b) / b) == pytest.approx(float(rev), rel=1e-2)
    with pytest.raises(ValueError, match="beta"):
        generalized_jsd(s, t, 1.0)


def test_the_rest_bucket_adds_nothing_for_the_whole_vocabulary_and_counts_mass_outside_the_top_k():
    logp = torch.log_softmax(torch.randn(3, 9, generator=torch.Generator().manual_seed(0)), -1)
    full = with_rest(logp)
    assert full.shape == (3, 10) and float(full[:, -1].exp().max()) <= 1e-6  # float32 rounding of the sum
    top = with_rest(logp.topk(4, dim=-1).values)
    torch.testing.assert_close(top.exp().sum(-1), torch.ones(3))
    # a student with all its mass off the teacher's single top token is far from it, not equal to it
    teacher, student = _dist(0.9, 0.05, 0.05), _dist(0.01, 0.5, 0.49)
    t1, s1 = with_rest(teacher[:1]), with_rest(student[:1])  # top 1: token 0, then the rest
    assert float(token_divergence(s1, t1, loss="forward_kl")) > 1.0
    torch.testing.assert_close(t1.exp(), torch.tensor([0.9, 0.1]))
