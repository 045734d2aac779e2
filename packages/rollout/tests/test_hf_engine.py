"""transformers-engine specifics: the logits processing, weight loading, capabilities."""

from __future__ import annotations

import itertools

import pytest
import torch
from rlhf_rollout import SamplingParams, TransformersEngine, UnsupportedOperationError, process_logits
from rollout_testutil import PROMPTS, reference_logprobs


def _reference_processed(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Enumerate the kept set by its definition: the top-k tokens, then the smallest prefix of the
    remaining tokens (most likely first) whose renormalised probability reaches ``top_p``."""
    x = logits.double() / temperature
    order = sorted(range(len(x)), key=lambda i: -x[i].item())
    kept = order[:top_k] if top_k else order
    probs = torch.softmax(x[kept], 0)
    nucleus, mass = [], 0.0
    for tok, pr in zip(kept, probs.tolist(), strict=True):
        nucleus.append(tok)
        mass += pr
        if mass >= top_p:
            break
    out = torch.full_like(x, float("-inf"))
    out[nucleus] = torch.log_softmax(x[nucleus], 0)
    return out


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), list(itertools.product([0.5, 1.0], [0, 3], [1.0, 0.6]))
)
def test_process_logits_matches_its_definition(temperature, top_k, top_p):
    logits = torch.randn(12, generator=torch.Generator().manual_seed(7)) * 2
    got = process_logits(logits[None], temperature=temperature, top_k=top_k, top_p=top_p)[0].double()
    ref = _reference_processed(logits, temperature, top_k, top_p)
    assert torch.equal(torch.isinf(got), torch.isinf(ref))
    finite = torch.isfinite(ref)
    torch.testing.assert_close(got[finite], ref[finite], atol=1e-6, rtol=0)


def test_top_p_samples_stay_in_the_nucleus(hf_engine, hf_model):
    p = SamplingParams(temperature=1.0, top_p=0.3, max_new_tokens=16, n=2, seed=9)
    for prompt, row in zip(PROMPTS, hf_engine.generate(PROMPTS, p), strict=True):
        for g in row:
            with torch.no_grad():
                logits = hf_model(torch.tensor([prompt + g.token_ids])).logits[0, len(prompt) - 1 : -1]
            ref = process_logits(logits, temperature=1.0, top_k=0, top_p=0.3)
            picked = ref.gather(-1, torch.tensor(g.token_ids)[:, None])[:, 0]
            assert torch.isfinite(picked).all()
            torch.testing.assert_close(picked, torch.tensor(g.logprobs), atol=1e-4, rtol=0)


def test_load_weights_changes_generation_and_checks_names(tiny_model_dir, hf_model):
    engine = TransformersEngine(model=tiny_model_dir)
    p = SamplingParams(temperature=1.0, max_new_tokens=12, seed=4)
    before = engine.generate(PROMPTS[:2], p)
    new = {k: v.clone() for k, v in hf_model.state_dict().items()}
    new["model.norm.weight"] = new["model.norm.weight"] * 3.0
    assert engine.load_weights(new.items()) == len(new)
    after = engine.generate(PROMPTS[:2], p)
    assert [r[0].token_ids for r in before] != [r[0].token_ids for r in after]
    model = type(hf_model).from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.load_state_dict(new)
    for prompt, row in zip(PROMPTS[:2], after, strict=True):
        ref = reference_logprobs(model, prompt, row[0].token_ids)
        torch.testing.assert_close(torch.tensor(row[0].logprobs, dtype=ref.dtype), ref, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match=r"'model\.nope' is not a parameter"):
        engine.load_weights([("model.nope", torch.zeros(1))])
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(3,\)"):
        engine.load_weights([("model.norm.weight", torch.zeros(3))])


def test_capabilities_are_honest(hf_engine):
    caps = hf_engine.capabilities
    assert caps.backend == "transformers" and caps.load_weights and not caps.sleep
    with pytest.raises(UnsupportedOperationError, match="no sleep mode"):
        hf_engine.sleep()
    assert not caps.weight_sync_extension
    with pytest.raises(UnsupportedOperationError, match="without worker_extension_cls"):
        hf_engine.init_weight_sync(
            transport="gloo", master_addr="127.0.0.1", master_port=1, rank_offset=1, world_size=2
        )
    hf_engine.reset_prefix_cache()  # documented no-op


def test_no_hidden_truncation_of_the_distribution(hf_engine, hf_model):
    """generate() fills unset options from global defaults (top_k=50); ours must stay off: with
    top_k=0 some sampled tokens rank below the 50 most likely ones."""
    p = SamplingParams(temperature=1.0, max_new_tokens=32, n=2, seed=0)
    ranks = []
    for prompt, row in zip(PROMPTS, hf_engine.generate(PROMPTS, p), strict=True):
        for g in row:
            with torch.no_grad():
                logits = hf_model(torch.tensor([prompt + g.token_ids])).logits[0, len(prompt) - 1 : -1]
            chosen = logits.gather(-1, torch.tensor(g.token_ids)[:, None])
            ranks += (logits > chosen).sum(-1).tolist()
    assert max(ranks) >= 50
