"""One rank of the fsdp2 backend's checks (run by test_fsdp2.py as 1 or 2 processes), on the same
global batches as ``multirank_worker.py``'s DeepSpeed runs so the two backends can be compared.

Scenarios:
- ``train``: PPO actor steps (world 1: zero_stage 0; world 2: zero_stage 3), a checkpoint after step 2,
  export, gather, and a resume from the step-2 checkpoint; the losses and final weights are written.
- ``resume``: a fresh engine loads another world size's step-2 checkpoint and redoes step 3.
- ``sp``: sequence-parallel SFT (ring attention) under fsdp2.
- ``lora``: SFT steps of a LoRA actor, packed rows.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from multirank_worker import (
    GAS,
    STEPS,
    global_rows,
    join_from_args,
    micro_batches,
    ppo_step,
    sequence_parallel_sft,
    with_old_logp,
)
from rlhf_learner.models import Actor, load_causal_lm
from rlhf_learner.strategy import StrategyOptions, make_strategy


def options(world: int, **kw) -> StrategyOptions:
    base = dict(backend="fsdp2", zero_stage=3 if world > 1 else 0, lr=1e-3, grad_accum_steps=GAS)
    return StrategyOptions(**(base | dict(micro_batch_size=4 // world) | kw))


def train(model_dir: str, rank: int, world: int, out: Path) -> dict:
    strategy = make_strategy(options(world))
    strategy.setup_distributed()
    engine = strategy.prepare(Actor(load_causal_lm(model_dir)))
    res: dict = {"losses": [], "grad_norms": []}
    mbs = with_old_logp(engine, micro_batches(rank, world))
    state_at_2 = None
    for step in range(STEPS):
        if step == 2:
            strategy.save_checkpoint(
                engine, out / f"fsdp2_ckpt_w{world}", tag="step2", client_state={"step": 2}
            )
            res["rand_after_save"] = torch.rand(3).tolist()
            state_at_2 = strategy.full_state_dict(engine.module.model)
        r = ppo_step(engine, mbs)
        res["losses"].append(r.loss)
        res["grad_norms"].append(r.grad_norm)
    state = strategy.full_state_dict(engine.module.model)
    if rank == 0:
        torch.save(state, out / f"weights_fsdp2_w{world}.pt")
        torch.save(state_at_2, out / f"weights_fsdp2_step2_w{world}.pt")
    p = next(engine.module.parameters())
    res["local_numel"] = p.to_local().numel()
    with strategy.gather([p]) as full:
        res["gathered_shape"] = list(full[0].shape)
    mine = "" if rank == 0 else f"_r{rank}"
    from transformers import AutoTokenizer

    strategy.export_hf(
        engine.module,
        out / f"fsdp2_export_w{world}{mine}",
        tokenizer=AutoTokenizer.from_pretrained(model_dir),
    )
    # Resume from the step-2 checkpoint in a fresh engine and redo step 3.
    torch.manual_seed(1234)
    engine2 = strategy.prepare(Actor(load_causal_lm(model_dir)))
    res["caller_state"] = strategy.load_checkpoint(engine2, out / f"fsdp2_ckpt_w{world}")
    res["rand_after_load"] = torch.rand(3).tolist()
    res["resumed_loss"] = ppo_step(engine2, mbs).loss
    state2 = strategy.full_state_dict(engine2.module.model)
    res["resumed_max_diff"] = max((state2[k] - state[k]).abs().max().item() for k in state)
    return res


def resume(model_dir: str, rank: int, world: int, out: Path, source_world: int) -> dict:
    """Load the step-2 checkpoint written on ``source_world`` ranks and redo step 3 here."""
    strategy = make_strategy(options(world))
    strategy.setup_distributed()
    engine = strategy.prepare(Actor(load_causal_lm(model_dir)))
    mbs = with_old_logp(engine, micro_batches(rank, world))  # the old log-probs of the initial weights
    strategy.load_checkpoint(engine, out / f"fsdp2_ckpt_w{source_world}")
    loaded = strategy.full_state_dict(engine.module.model)
    saved = torch.load(out / f"weights_fsdp2_step2_w{source_world}.pt")
    resumed_loss = ppo_step(engine, mbs).loss
    after = strategy.full_state_dict(engine.module.model)  # the optimizer's state moved them as it did there
    final = torch.load(out / f"weights_fsdp2_w{source_world}.pt")
    return {
        "loaded_max_diff": max((loaded[k] - saved[k]).abs().max().item() for k in saved),
        "resumed_loss": resumed_loss,
        "after_step_max_diff": max((after[k] - final[k]).abs().max().item() for k in final),
        "optimizer_steps": engine.global_steps,
    }


def lora_packed(model_dir: str, backend: str) -> dict:
    """SFT steps of a LoRA actor on packed rows (one rank), under ``backend``."""
    from rlhf_algos import sft_loss
    from rlhf_learner import LoraOptions, SFTBatch, pack_sequences, sft_step

    strategy = make_strategy(StrategyOptions(backend=backend, zero_stage=0, lr=1e-2))
    strategy.setup_distributed()
    lm = load_causal_lm(model_dir, lora=LoraOptions(rank=4, alpha=8))
    engine = strategy.prepare(Actor(lm))
    rows = global_rows(seed=5)[:4]
    seqs = [{"input_ids": r["input_ids"], "loss_mask": r["action_mask"]} for r in rows]
    mb = SFTBatch(**pack_sequences(seqs, max_tokens_per_row=32).tensors)
    return {"losses": [sft_step(engine, [mb], sft_loss_fn=sft_loss).loss for _ in range(3)]}


def main() -> None:
    args = join_from_args("--scenario")
    out = Path(args.out)
    results: dict = {}
    if (args.scenario or "train") == "train":
        results["train"] = train(args.model, args.rank, args.world, out)
        results["sp"] = sequence_parallel_sft(args.model, args.world, out, backend="fsdp2")
        if args.world == 1:
            results["lora"] = {b: lora_packed(args.model, b) for b in ("deepspeed", "fsdp2")}
    else:
        results["resume"] = resume(args.model, args.rank, args.world, out, source_world=3 - args.world)
    name = f"fsdp2_{args.scenario or 'train'}_w{args.world}_r{args.rank}.json"
    (out / name).write_text(json.dumps(results))
    import torch.distributed as dist

    dist.barrier()  # no rank leaves while another is still in a collective
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
