"""The folder exported from a ZeRO-3 run on 2 ranks loads in vLLM (CPU) with transformers' log-probs."""

from __future__ import annotations

import os

import pytest
import torch


@pytest.mark.slow
def test_exported_folder_loads_in_vllm_with_matching_logprobs(multirank):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    export = multirank["out"] / "export"
    llm = LLM(model=str(export), dtype="float32", enforce_eager=True, seed=0)
    try:
        prompt = [5, 77, 123, 300, 42, 9]
        params = SamplingParams(max_tokens=8, temperature=1.0, logprobs=0, seed=0)
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params)[0].outputs[0]
    finally:  # its engine-core process ends now, not whenever the garbage collector reaches the LLM
        llm.llm_engine.engine_core.shutdown()
    tokens = list(out.token_ids)
    vllm_lp = torch.tensor([next(iter(d.values())).logprob for d in out.logprobs])
    model = AutoModelForCausalLM.from_pretrained(export)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    hf_lp = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)
    torch.testing.assert_close(vllm_lp, hf_lp, atol=1e-4, rtol=0)
