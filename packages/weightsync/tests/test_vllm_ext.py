"""A real vLLM-CPU engine receives new weights through the worker extension while running.

After each sync (and ``reset_prefix_cache``) vLLM's per-token prompt logprobs match a transformers
forward of the tiny model holding the same weights to ``TOL`` and differ from the logprobs before
the sync. Syncs go over gloo (twice, version bump) and then over shm after re-joining.
"""

from __future__ import annotations

import os

import pytest
import torch
from rlhf_weightsync import WeightSender

TOL = 1e-4  # max |logprob difference| vLLM vs transformers, fp32 (seen ~1e-6)
EXT = "rlhf_weightsync.vllm_ext.WeightSyncWorkerExtension"
TOKENS = [int(t) for t in torch.randint(260, 500, (48,), generator=torch.Generator().manual_seed(7))]


@pytest.fixture(scope="session")
def llm(tiny_model_dir):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    engine = LLM(
        model=str(tiny_model_dir),
        dtype="float32",
        max_model_len=256,
        seed=0,
        worker_extension_cls=EXT,
        enforce_eager=True,  # no torch.compile start-up: the weights path is what is tested
        **({"gpu_memory_utilization": 0.2} if torch.cuda.is_available() else {}),
    )
    yield engine
    engine.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def vllm_logprobs(llm) -> torch.Tensor:
    from vllm import SamplingParams, TokensPrompt

    out = llm.generate(
        [TokensPrompt(prompt_token_ids=TOKENS)],
        SamplingParams(max_tokens=1, prompt_logprobs=0),
        use_tqdm=False,
    )[0]
    return torch.tensor(
        [pos[tok].logprob for pos, tok in zip(out.prompt_logprobs[1:], TOKENS[1:], strict=True)]
    )


@torch.no_grad()
def hf_logprobs(model) -> torch.Tensor:
    logits = model(torch.tensor([TOKENS])).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(TOKENS[1:])[:, None])[:, 0]


@torch.no_grad()
def perturb(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.add_(0.05 * torch.randn(p.shape, generator=gen))


def join(llm, transport: str, port: int, run_in_thread, device: str = "cpu") -> WeightSender:
    kwargs = dict(transport=transport, master_addr="127.0.0.1", master_port=port, rank_offset=1, world_size=2)
    thread, box = run_in_thread(llm.collective_rpc, "init_weight_sync", kwargs={**kwargs, "timeout_s": 60})
    sender = WeightSender(
        transport=transport,
        master_addr="127.0.0.1",
        master_port=port,
        world_size=2,
        timeout_s=60,
        device=device,
    )
    thread.join()
    assert "error" not in box, box.get("error")
    return sender


def sync(llm, sender: WeightSender, named, run_in_thread) -> tuple[dict, object]:
    thread, box = run_in_thread(llm.collective_rpc, "receive_weights", kwargs={"timeout_s": 60})
    stats = sender.send(named)
    thread.join()
    assert "error" not in box, box.get("error")
    llm.reset_prefix_cache()
    return box["value"][0], stats


def test_vllm_engine_receives_weights_and_matches_transformers(llm, hf_model, free_port, run_in_thread):
    before = vllm_logprobs(llm)
    assert (before - hf_logprobs(hf_model)).abs().max() < TOL  # same weights, same numbers to start with

    sender = join(llm, "gloo", free_port(), run_in_thread)
    previous = before
    # state_dict() names the tied lm_head.weight (an alias of the embedding); named_parameters() does not
    for version, walk in ((1, hf_model.state_dict().items), (2, hf_model.named_parameters)):
        perturb(hf_model, seed=version)
        reply, stats = sync(llm, sender, walk(), run_in_thread)
        assert reply["version"] == stats.version == version
        assert reply["num_tensors"] == stats.num_tensors == len(list(hf_model.parameters()))
        assert reply["num_bytes"] == stats.num_bytes
        now = vllm_logprobs(llm)
        assert (now - hf_logprobs(hf_model)).abs().max() < TOL, f"gloo sync {version}"
        assert (now - previous).abs().max() > 1e-2, "the engine still computes with the old weights"
        previous = now
    llm.collective_rpc("close_weight_sync")
    sender.close()

    sender = join(llm, "shm", free_port(), run_in_thread)
    perturb(hf_model, seed=3)
    reply, stats = sync(llm, sender, hf_model.named_parameters(), run_in_thread)
    assert reply["version"] == 1
    now = vllm_logprobs(llm)
    assert (now - hf_logprobs(hf_model)).abs().max() < TOL, "shm sync"
    assert (now - previous).abs().max() > 1e-2
    llm.collective_rpc("close_weight_sync")
    sender.close()


def test_extension_refuses_misuse(llm):
    with pytest.raises(Exception, match="call init_weight_sync first"):
        llm.collective_rpc("receive_weights")
    with pytest.raises(Exception, match="rank_offset: expected >= 1"):
        llm.collective_rpc(
            "init_weight_sync",
            kwargs=dict(
                transport="gloo", master_addr="127.0.0.1", master_port=1, rank_offset=0, world_size=2
            ),
        )


@pytest.mark.gpu
@pytest.mark.parametrize("transport", ["cuda_ipc", "nccl"])
def test_gpu_transports_reach_a_vllm_worker(llm, hf_model, free_port, run_in_thread, transport):
    """On a GPU: CUDA IPC from the worker's own GPU, and NCCL from another GPU, into the running vLLM
    worker (its first GPU); its log-probs then equal transformers' with the same weights."""
    import copy

    if transport == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("nccl needs one GPU per rank; this machine has one")
    device = "cuda:0" if transport == "cuda_ipc" else "cuda:1"
    model = copy.deepcopy(hf_model)
    perturb(model, seed=11)
    sender = join(llm, transport, free_port(), run_in_thread, device=device)
    named = [(n, p.detach().to(device)) for n, p in model.named_parameters()]
    reply, stats = sync(llm, sender, named, run_in_thread)
    assert reply["num_bytes"] == stats.num_bytes
    assert (vllm_logprobs(llm) - hf_logprobs(model)).abs().max() < TOL, transport
    llm.collective_rpc("close_weight_sync")
    sender.close()
