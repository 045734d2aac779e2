"""GPU paths: flash-attn varlen packing, liger kernels, NCCL + ring-flash-attn, QLoRA.

Marked ``gpu``: skipped where CUDA is absent (the rlhf-testkit plugin does that).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from rlhf_testkit.net import without_rendezvous

pytestmark = pytest.mark.gpu


def test_flash_attention_packed_equals_unpacked(tiny_model_dir):
    pytest.importorskip("flash_attn", reason="flash-attn is not installed (uv sync --extra flash)")
    from rlhf_learner.models import Actor, ModelOptions, load_causal_lm
    from rlhf_learner.packing import pack_sequences, unpack

    opts = ModelOptions(attn_implementation="flash_attention_2", dtype="bf16")
    actor = Actor(load_causal_lm(tiny_model_dir, options=opts)).cuda()
    g = torch.Generator().manual_seed(0)
    seqs = [{"input_ids": torch.randint(3, 400, (n,), generator=g)} for n in (9, 3, 14, 6, 11)]
    packed = pack_sequences(seqs, max_tokens_per_row=24)
    rows = {k: v.cuda() for k, v in packed.tensors.items()}
    with torch.no_grad():
        out = actor(rows["input_ids"], position_ids=rows["position_ids"])
        for i, s in enumerate(seqs):
            alone = actor(s["input_ids"][None].cuda()).logp[0]
            torch.testing.assert_close(unpack(out.logp, packed.placement)[i], alone, atol=3e-2, rtol=0)


def test_liger_actor_matches_plain_actor(tiny_model_dir):
    from rlhf_learner.models import Actor, ModelOptions, load_causal_lm

    ids = torch.randint(3, 400, (2, 16)).cuda()
    plain = Actor(load_causal_lm(tiny_model_dir)).cuda()
    liger = Actor(load_causal_lm(tiny_model_dir, options=ModelOptions(liger=True))).cuda()
    with torch.no_grad():
        torch.testing.assert_close(liger(ids).logp, plain(ids).logp, atol=1e-3, rtol=0)


def test_nccl_init_and_ring_flash_attention_in_a_fresh_process():
    pytest.importorskip("flash_attn", reason="ring-flash-attn needs flash-attn (uv sync --extra ring)")
    script = textwrap.dedent(
        """
        import torch, torch.distributed as dist, torch.nn.functional as F
        from rlhf_learner.strategy import init_distributed
        from rlhf_learner.ring_attention import ring_flash_attention
        init_distributed(backend="nccl", timeout_s=60)
        assert dist.get_backend() == "nccl"
        t = torch.ones(4, device="cuda")
        dist.all_reduce(t)
        q, k, v = (torch.randn(1, 4, 64, 32, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = ring_flash_attention(q, k, v)
        assert (out - ref).abs().max().item() < 2e-2, (out - ref).abs().max().item()
        dist.destroy_process_group()
        print("ok")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], env=without_rendezvous(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr


RING_OF_TWO = textwrap.dedent(
    """
    import os, sys, torch, torch.distributed as dist, torch.multiprocessing as mp
    from rlhf_learner.ring_attention import ring_flash_varlen_attention

    LENGTHS, H, HKV, D = (5, 11, 7, 9), 4, 2, 32  # 32 tokens packed in one row; grouped-query heads

    def reference(q, k, v, pos):
        out = torch.zeros_like(q)
        k, v = k.repeat_interleave(H // HKV, 1), v.repeat_interleave(H // HKV, 1)
        lo = 0
        for n in LENGTHS:
            sl = slice(lo, lo + n)
            out[:, :, sl] = torch.nn.functional.scaled_dot_product_attention(q[:, :, sl], k[:, :, sl], v[:, :, sl], is_causal=True)
            lo += n
        return out

    def rank_main(rank, port):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=2)
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, H, 32, D, generator=g)
        k, v = (torch.randn(1, HKV, 32, D, generator=g) for _ in range(2))
        grad = torch.randn(1, H, 32, D, generator=g)
        pos = torch.cat([torch.arange(n) for n in LENGTHS])[None]
        want = [t.detach().cuda().requires_grad_() for t in (q, k, v)]
        reference(*want, pos).backward(grad.cuda())
        chunk = slice(16 * rank, 16 * rank + 16)
        mine = [t[:, :, chunk].cuda().bfloat16().requires_grad_() for t in (q, k, v)]
        out = ring_flash_varlen_attention(*mine, pos[:, chunk].cuda())
        out.backward(grad[:, :, chunk].cuda().bfloat16())
        ref_out = reference(*(t.detach().cuda() for t in (q, k, v)), pos)[:, :, chunk]
        worst = max(
            (out.float() - ref_out).abs().max().item(),
            *((m.grad.float() - w.grad[:, :, chunk]).abs().max().item() for m, w in zip(mine, want)),
        )
        assert worst < 5e-2, (rank, worst)
        dist.destroy_process_group()

    if __name__ == "__main__":
        mp.spawn(rank_main, args=(int(sys.argv[1]),), nprocs=2)
        print("ok")
    """
)


@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="NCCL puts each rank of the ring on a GPU of its own"
)
def test_packed_rows_take_ring_flash_attns_varlen_kernels_on_a_ring_of_two(tmp_path):
    """Two ranks, each with a contiguous half of a packed row of four sequences: ring-flash-attn's varlen
    kernels give each sequence's causal attention (and its gradients) as one device computes them."""
    pytest.importorskip("flash_attn", reason="ring-flash-attn needs flash-attn (uv sync --extra ring)")
    from rlhf_learner.strategy import free_port

    script = tmp_path / "ring.py"
    script.write_text(RING_OF_TWO)
    proc = subprocess.run(
        [sys.executable, str(script), str(free_port())], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr


def test_qlora_trains(tiny_model_dir):
    pytest.importorskip("bitsandbytes", reason="QLoRA needs bitsandbytes (uv sync --extra qlora)")
    from rlhf_learner.lora import LoraOptions, apply_lora, load_qlora_base
    from rlhf_learner.models import Actor

    model = apply_lora(load_qlora_base(tiny_model_dir), LoraOptions(rank=4, load_in_4bit=True))
    actor = Actor(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(3, 400, (2, 12)).cuda()
    losses = []
    for _ in range(5):
        loss = -actor(ids).logp[:, 1:].float().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_load_in_4bit_quantizes_the_base_and_only_lora_gets_gradients(tiny_model_dir):
    pytest.importorskip("bitsandbytes", reason="QLoRA needs bitsandbytes (uv sync --extra qlora)")
    import bitsandbytes as bnb
    from rlhf_learner.lora import LoraOptions
    from rlhf_learner.models import Actor, load_causal_lm

    model = load_causal_lm(tiny_model_dir, lora=LoraOptions(rank=4, load_in_4bit=True))
    assert model.get_base_model().is_loaded_in_4bit
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())
    ids = torch.randint(3, 400, (2, 12), generator=torch.Generator().manual_seed(0)).cuda()
    loss = -Actor(model)(ids).logp[:, 1:].float().mean()
    loss.backward()
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    assert with_grad and all("lora_" in n for n in with_grad)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == with_grad
    assert all(p.grad.abs().sum() > 0 for n, p in model.named_parameters() if "lora_B" in n)


def _merged_logits_tolerance(expect: torch.Tensor) -> float:
    """5% of the logit scale: the merged weights are bf16 (the compute dtype) and the peft forward runs
    its 4-bit linears in bf16 with the adapters beside them in fp32, so both sides round differently."""
    return 5e-2 * expect.abs().max().item()


def test_qlora_step_changes_only_adapters_and_merged_weights_give_its_logits(tiny_model_dir, tmp_path):
    pytest.importorskip("bitsandbytes", reason="QLoRA needs bitsandbytes (uv sync --extra qlora)")
    import json

    from rlhf_learner.lora import LoraOptions, merged_state_dict
    from rlhf_learner.models import Actor, load_causal_lm
    from rlhf_learner.strategy import Strategy, StrategyOptions
    from transformers import AutoModelForCausalLM

    model = load_causal_lm(tiny_model_dir, lora=LoraOptions(rank=8, alpha=16.0, load_in_4bit=True))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 400, (2, 12), generator=g).cuda()
    (-Actor(model)(ids).logp[:, 1:].float().mean()).backward()
    opt.step()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert any("lora_B" in n for n in changed) and all("lora_" in n for n in changed), changed

    with torch.no_grad():  # adapters large enough that a merge which dropped them could not pass
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(0.2 * torch.randn(p.shape, generator=g).to(p.device))
    model.eval()
    with torch.no_grad():
        expect = model(input_ids=ids).logits.float()
        with model.disable_adapter():
            without = model(input_ids=ids).logits.float()
    tol = _merged_logits_tolerance(expect)
    assert (expect - without).abs().max() > 2 * tol  # the adapters change the function

    strategy = Strategy(StrategyOptions(zero_stage=2))
    merged, _ = merged_state_dict(model, strategy.full_state_dict(model))  # as the worker's send_weights
    assert not [k for k in merged if ".lora_" in k or "base_layer" in k or "absmax" in k or "quant" in k]
    assert all(t.dtype == torch.bfloat16 for t in merged.values())
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict({k: v.float() for k, v in merged.items()}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embedding
    with torch.no_grad():
        got = plain.cuda()(ids).logits.float()
        again = model(input_ids=ids).logits.float()
    assert (got - expect).abs().max() <= tol
    torch.testing.assert_close(again, expect, atol=1e-3 * expect.abs().max().item(), rtol=0)  # model intact

    for dtype, name in ((None, "bfloat16"), (torch.float32, "float32")):
        folder = strategy.export_hf(Actor(model), tmp_path / name, dtype=dtype)
        cfg = json.loads((folder / "config.json").read_text())
        assert "quantization_config" not in cfg and cfg["dtype"] == name
        exported = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda()
        with torch.no_grad():
            assert (exported(ids).logits.float() - expect).abs().max() <= tol


def test_offload_states_frees_the_gpu_and_reload_restores_training(tiny_model_dir):
    """The hybrid engine's learner side: a ZeRO-3 engine's states go to host memory (the GPU's free memory
    grows) and come back; the next optimizer step then runs as usual."""
    script = textwrap.dedent(
        f"""
        import torch
        from rlhf_learner import Strategy, StrategyOptions
        from rlhf_learner.models import Actor, load_causal_lm
        from rlhf_learner.strategy import offload_states, reload_states
        s = Strategy(StrategyOptions(zero_stage=3, precision="bf16"))
        s.setup_distributed(rank=0, world_size=1, master_addr="127.0.0.1", master_port=29533)
        engine = s.prepare(Actor(load_causal_lm({str(tiny_model_dir)!r})))
        ids = torch.randint(3, 400, (2, 16)).cuda()
        engine.backward(engine(ids).logp.mean()); engine.step()
        free = torch.cuda.mem_get_info()[0]
        assert offload_states(engine) == "offloaded"
        assert torch.cuda.mem_get_info()[0] > free
        assert reload_states(engine) == "reloaded"
        engine.backward(engine(ids).logp.mean()); engine.step()
        print("ok")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], env=without_rendezvous(), capture_output=True, text=True, timeout=300
    )
    assert out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_fsdp2_bf16_mixed_precision_cpu_offload_and_hybrid_engine_moves(tiny_model_dir):
    """fsdp2 on NCCL (a fresh process, a group of one): bf16 compute over fp32 sharded parameters trains;
    CPU offload keeps the parameters in host memory and still trains; offload_states frees the GPU of a
    plain fsdp2 engine and reload_states brings it back for the next step."""
    script = textwrap.dedent(
        f"""
        import torch
        from rlhf_algos import sft_loss
        from rlhf_learner import Actor, SFTBatch, load_causal_lm, sft_step
        from rlhf_learner.strategy import StrategyOptions, make_strategy
        ids = torch.randint(3, 400, (2, 16))
        mb = SFTBatch(input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=torch.ones_like(ids).bool())
        for opts in (dict(precision="bf16"), dict(zero_stage=3, offload_params=True, precision="bf16")):
            strategy = make_strategy(StrategyOptions(backend="fsdp2", lr=1e-2, **opts))
            strategy.setup_distributed(backend="nccl")
            engine = strategy.prepare(Actor(load_causal_lm({str(tiny_model_dir)!r})))
            p = next(engine.module.parameters())
            assert p.dtype == torch.float32
            assert p.to_local().device.type == ("cpu" if opts.get("offload_params") else "cuda")
            losses = [sft_step(engine, [mb], sft_loss_fn=sft_loss).loss for _ in range(4)]
            assert losses[-1] < losses[0] - 0.2, losses
        assert strategy.offload_states(engine).startswith("skipped")  # offloaded already
        strategy = make_strategy(StrategyOptions(backend="fsdp2", lr=1e-2))
        engine = strategy.prepare(Actor(load_causal_lm({str(tiny_model_dir)!r})))
        sft_step(engine, [mb], sft_loss_fn=sft_loss)
        held = torch.cuda.memory_allocated()
        assert strategy.offload_states(engine) == "offloaded"
        assert torch.cuda.memory_allocated() < held / 2
        assert strategy.reload_states(engine) == "reloaded"
        sft_step(engine, [mb], sft_loss_fn=sft_loss)
        print("ok")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], env=without_rendezvous(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr
