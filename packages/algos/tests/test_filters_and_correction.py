"""Filters, off-policy correction weights and length penalties against plain reference loops."""

import math

import pytest
import torch
from rlhf_algos import dynamic_filter, masked_whiten, overlong_penalty, stop_penalty, vllm_is_weights


def dynamic_filter_reference(scores, low, high):
    keep = []
    for row in scores.tolist():
        mean = sum(row) / len(row)
        keep.append(low < mean < high)
    return keep


def is_weights_reference(old, roll, mask, mode, low, high):
    """Per-token weights, one token at a time; float64 throughout."""
    out = torch.zeros(old.shape, dtype=torch.float64)
    for b in range(old.shape[0]):
        steps = mask[b].nonzero().flatten().tolist()
        log_rho = {t: float(old[b, t]) - float(roll[b, t]) for t in steps}
        rho = {t: math.exp(x) for t, x in log_rho.items()}
        if mode == "seq-mask-tis":
            geo = math.exp(sum(log_rho.values()) / max(len(steps), 1))
            if not low <= geo <= high:
                continue
        for t in steps:
            if mode == "tis":
                out[b, t] = min(max(rho[t], low), high)
            elif mode == "icepop":
                out[b, t] = rho[t] if low <= rho[t] <= high else 0.0
            else:
                out[b, t] = min(rho[t], high)
    return out


def overlong_reference(lengths, max_length, buffer_length, factor):
    out = []
    start = max_length - buffer_length
    for length in lengths.tolist():
        if length <= start:
            out.append(0.0)
        elif length <= max_length:
            out.append((start - length) / buffer_length * factor)
        else:
            out.append(-factor)
    return torch.tensor(out)


def stop_reference(rewards, truncated, coef):
    out = []
    for r, t in zip(rewards.tolist(), truncated.tolist(), strict=True):
        if not t:
            out.append(r)
        else:
            out.append(r * coef if coef >= 0 else coef)
    return torch.tensor(out)


@pytest.mark.parametrize(("low", "high"), [(0.0, 1.0), (0.2, 0.8), (-1.0, 0.5)])
def test_dynamic_filter_matches_reference_loop(gen, low, high):
    binary = torch.randint(0, 2, (64, 4), generator=gen).float()  # many all-0 / all-1 groups
    graded = torch.randint(0, 5, (64, 5), generator=gen).float() / 4  # means hit 0.2, 0.8 exactly too
    for scores in (binary, graded, torch.randn(32, 3, generator=gen)):
        got = dynamic_filter(scores, low=low, high=high)
        assert got.dtype == torch.bool
        assert got.tolist() == dynamic_filter_reference(scores, low, high)
    # both outcomes occur on the binary scores, so the comparison is not vacuous
    assert {True, False} <= set(dynamic_filter(binary, low=low, high=high).tolist())


def test_dynamic_filter_drops_all_equal_groups():
    scores = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.5, 0.5, 0.5]])
    assert dynamic_filter(scores, low=0.0, high=1.0).tolist() == [False, False, True, True]
    # the range is open: a mean equal to low or to high is dropped
    assert dynamic_filter(scores, low=0.5, high=1.0).tolist() == [False, False, False, False]
    assert dynamic_filter(scores, low=0.0, high=0.5).tolist() == [False, False, True, False]
    with pytest.raises(ValueError, match="non-finite"):
        dynamic_filter(torch.tensor([[float("nan"), 1.0]]), low=0.0, high=1.0)
    with pytest.raises(ValueError, match="low < high"):
        dynamic_filter(scores, low=1.0, high=1.0)


@pytest.mark.parametrize("mode", ["tis", "icepop", "seq-mask-tis"])
@pytest.mark.parametrize(("low", "high"), [(0.0, 2.0), (0.5, 1.5), (0.8, 1.2)])
def test_is_weights_match_reference_loop(make_mask, gen, mode, low, high):
    mask = make_mask(16, 11, gen=gen, holes=True)
    mask[3] = False  # an empty row: no weights
    old = torch.randn(16, 11, generator=gen, dtype=torch.float64) - 2.0
    # per-row spread: some rows close to the engine (kept by seq-mask-tis), some far (dropped)
    spread = torch.linspace(0.02, 1.5, 16, dtype=torch.float64)[:, None]
    roll = old + spread * torch.randn(16, 11, generator=gen, dtype=torch.float64)
    # garbage outside the mask is ignored
    old_g = torch.where(mask, old, torch.tensor(float("nan"), dtype=torch.float64))
    roll_g = torch.where(mask, roll, torch.tensor(float("-inf"), dtype=torch.float64))
    w = vllm_is_weights(old_g, roll_g, mask, mode, low=low, high=high)
    ref = is_weights_reference(old, roll, mask, mode, low, high)
    torch.testing.assert_close(w, ref, rtol=1e-12, atol=1e-12)
    assert (w[~mask] == 0).all()
    # not vacuous: some tokens are weighted, and (for the narrower ranges) some are cut
    assert (ref[mask] > 0).any()
    if (low, high) != (0.0, 2.0):
        assert ((ref[mask] == 0) | (ref[mask] == high) | (ref[mask] == low)).any()
    # weights are detached
    old_req = old.clone().requires_grad_(True)
    assert not vllm_is_weights(old_req, roll, mask, mode, low=low, high=high).requires_grad


def test_is_correction_modes():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    old = torch.log(torch.tensor([[0.5, 0.9, 0.1, 0.3], [0.5, 0.5, 0.5, 0.5]]))
    roll = torch.log(torch.tensor([[0.5, 0.3, 0.4, 0.3], [0.5, 0.5, 0.5, 0.5]]))
    # ratios: row 0 -> 1, 3, 0.25 ; row 1 -> 1, 1
    tis = vllm_is_weights(old, roll, mask, "tis", low=0.0, high=2.0)
    torch.testing.assert_close(tis, torch.tensor([[1.0, 2.0, 0.25, 0.0], [1.0, 1.0, 0.0, 0.0]]))
    tis_low = vllm_is_weights(old, roll, mask, "tis", low=0.5, high=2.0)  # 0.25 is raised to low
    torch.testing.assert_close(tis_low, torch.tensor([[1.0, 2.0, 0.5, 0.0], [1.0, 1.0, 0.0, 0.0]]))
    ice = vllm_is_weights(old, roll, mask, "icepop", low=0.5, high=2.0)
    torch.testing.assert_close(ice, torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]]))
    # icepop's range is closed: a ratio of exactly 1 survives low=1
    ice1 = vllm_is_weights(old, roll, mask, "icepop", low=1.0, high=4.0)
    torch.testing.assert_close(ice1, torch.tensor([[1.0, 3.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]]))
    # ... and high=1 (closed at the top too)
    ice2 = vllm_is_weights(old, roll, mask, "icepop", low=0.0, high=1.0)
    torch.testing.assert_close(ice2, torch.tensor([[1.0, 0.0, 0.25, 0.0], [1.0, 1.0, 0.0, 0.0]]))
    # geometric mean of row 0 = (1 * 3 * 0.25) ** (1/3) = 0.9086: dropped with low=0.95, kept with 0.5
    seq = vllm_is_weights(old, roll, mask, "seq-mask-tis", low=0.95, high=2.0)
    torch.testing.assert_close(seq, torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]]))
    seq2 = vllm_is_weights(old, roll, mask, "seq-mask-tis", low=0.5, high=2.0)
    torch.testing.assert_close(seq2, torch.tensor([[1.0, 2.0, 0.25, 0.0], [1.0, 1.0, 0.0, 0.0]]))
    # ... and dropped by an upper bound below it; the per-token cap is `high`, with no lower clamp
    seq3 = vllm_is_weights(old, roll, mask, "seq-mask-tis", low=0.0, high=0.9)
    torch.testing.assert_close(seq3, torch.zeros(2, 4))
    # the geometric mean is over masked tokens only: the masked-out ratios of 8 do not count
    mask2 = torch.tensor([[1, 1, 0, 0]], dtype=torch.bool)
    o2, r2 = torch.log(torch.tensor([[2.0, 0.5, 8.0, 8.0]])), torch.zeros(1, 4)
    torch.testing.assert_close(  # sqrt(2 * 0.5) = 1 -> kept at low = 1
        vllm_is_weights(o2, r2, mask2, "seq-mask-tis", low=1.0, high=3.0), torch.tensor([[2.0, 0.5, 0, 0]])
    )


def test_is_correction_bad_input():
    mask = torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="non-finite"):
        vllm_is_weights(torch.tensor([[0.0, float("nan")]]), torch.zeros(1, 2), mask, "tis")
    with pytest.raises(ValueError, match="unknown IS correction"):
        vllm_is_weights(torch.zeros(1, 2), torch.zeros(1, 2), mask, "is")
    with pytest.raises(ValueError, match="low < high"):
        vllm_is_weights(torch.zeros(1, 2), torch.zeros(1, 2), mask, "tis", low=2.0, high=2.0)
    # an empty mask is fine: no weights
    assert (vllm_is_weights(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2), "icepop") == 0).all()


@pytest.mark.parametrize(
    ("max_length", "buffer_length", "factor"), [(20, 4, 1.0), (64, 16, 0.5), (10, 10, 2.0), (7, 1, 1.0)]
)
def test_overlong_penalty_matches_reference_loop(gen, max_length, buffer_length, factor):
    lengths = torch.cat(
        [torch.arange(0, 2 * max_length + 2), torch.randint(0, 3 * max_length, (50,), generator=gen)]
    )
    pen = overlong_penalty(lengths, max_length=max_length, buffer_length=buffer_length, penalty_factor=factor)
    torch.testing.assert_close(pen, overlong_reference(lengths, max_length, buffer_length, factor))


def test_overlong_penalty_ramps_inside_the_buffer():
    lengths = torch.tensor([10, 16, 17, 18, 20, 21, 25])
    pen = overlong_penalty(lengths, max_length=20, buffer_length=4, penalty_factor=1.0)
    torch.testing.assert_close(pen, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0]))
    pen = overlong_penalty(lengths, max_length=20, buffer_length=4, penalty_factor=0.2)
    torch.testing.assert_close(pen, torch.tensor([0.0, 0.0, -0.05, -0.1, -0.2, -0.2, -0.2]))
    for bad in (0, 21):
        with pytest.raises(ValueError, match="buffer_length"):
            overlong_penalty(lengths, max_length=20, buffer_length=bad)


@pytest.mark.parametrize("coef", [0.0, 0.5, 1.0, 2.0, -1.0, -0.25])
def test_stop_penalty_matches_reference_loop(gen, coef):
    rewards = torch.randn(40, generator=gen)
    truncated = torch.rand(40, generator=gen) < 0.4
    assert truncated.any() and not truncated.all()
    torch.testing.assert_close(
        stop_penalty(rewards, truncated, coef=coef), stop_reference(rewards, truncated, coef)
    )
    # an integer 0/1 mask means the same as a bool one
    torch.testing.assert_close(
        stop_penalty(rewards, truncated.long(), coef=coef), stop_reference(rewards, truncated, coef)
    )


def test_stop_penalty_scales_or_replaces():
    r, t = torch.tensor([2.0, 2.0, -3.0]), torch.tensor([True, False, True])
    torch.testing.assert_close(stop_penalty(r, t, coef=0.5), torch.tensor([1.0, 2.0, -1.5]))
    torch.testing.assert_close(stop_penalty(r, t, coef=0.0), torch.tensor([0.0, 2.0, 0.0]))
    torch.testing.assert_close(stop_penalty(r, t, coef=-1.0), torch.tensor([-1.0, 2.0, -1.0]))
    with pytest.raises(ValueError, match="shape"):
        stop_penalty(r, t[:2], coef=0.5)


def test_masked_whiten_with_and_without_std():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 4.0, 100.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]], dtype=torch.bool)
    w = masked_whiten(x, mask)
    assert w[mask].mean().item() == pytest.approx(0.0, abs=1e-6)
    assert w[mask].std().item() == pytest.approx(1.0, rel=1e-4)
    assert (w[~mask] == 0).all()
    centred = masked_whiten(x, mask, scale=False)
    torch.testing.assert_close(centred[mask], torch.tensor([-1.5, -0.5, 0.5, 1.5]))
    with pytest.raises(ValueError, match="selects no element"):
        masked_whiten(x, torch.zeros(2, 3))
