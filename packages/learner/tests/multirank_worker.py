"""One rank of the learner's distributed checks (run by test_distributed.py as 1 or 2 processes).

Scenarios, in one process so DeepSpeed and transformers are imported once:
- ``train``: PPO actor steps with ZeRO-0 (world 1) or ZeRO-2 and ZeRO-3 (world 2) on the same global
  batch; losses and final full weights are written for comparison.
- ZeRO-3 extras (world 2): gather, checkpoint save / load / continue, HF export.
- ring attention (world 2): attention function and a whole model against single-rank references.
- ``kto``: KTO steps with ZeRO-0 (world 1) or ZeRO-2 (world 2) on the same global batch: the KL
  reference point is gathered over the ranks, so the split must not change the losses.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import torch
from rlhf_algos import aggregate_loss, kto_kl_baseline, kto_loss, policy_loss
from rlhf_learner.models import Actor, load_causal_lm, load_reference
from rlhf_learner.steps import (
    KTOBatch,
    ModelRows,
    PolicyBatch,
    SFTBatch,
    kto_step,
    ppo_actor_step,
    reference_logp,
    reference_sequence_logp,
)
from rlhf_learner.strategy import Strategy, StrategyOptions, make_strategy

LENGTHS = [12, 20, 9, 16, 24, 7, 18, 11]
GAS = 2
STEPS = 3


def global_rows(seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for n in LENGTHS:
        mask = torch.zeros(n, dtype=torch.bool)
        mask[4:] = True
        rows.append(
            {
                "input_ids": torch.randint(3, 400, (n,), generator=g),
                "action_mask": mask,
                "advantages": torch.randn(n, generator=g),
            }
        )
    return rows


def pad_rows(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    width = max(r["input_ids"].shape[0] for r in rows)
    out: dict[str, torch.Tensor] = {}
    for key in rows[0]:
        out[key] = torch.stack([torch.nn.functional.pad(r[key], (0, width - r[key].shape[0])) for r in rows])
    out["attention_mask"] = torch.stack(
        [
            torch.nn.functional.pad(
                torch.ones(r["input_ids"].shape[0], dtype=torch.long), (0, width - r["input_ids"].shape[0])
            )
            for r in rows
        ]
    )
    return out


def micro_batches(rank: int, world: int) -> list[dict[str, torch.Tensor]]:
    rows = global_rows()
    per_micro = len(rows) // GAS
    share = per_micro // world
    return [
        pad_rows(rows[g * per_micro + rank * share : g * per_micro + (rank + 1) * share]) for g in range(GAS)
    ]


def model_rows(mb: dict[str, torch.Tensor]) -> ModelRows:
    return ModelRows(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"])


def with_old_logp(engine, mbs) -> list[PolicyBatch]:
    """PPO epochs over one rollout: old log-probs from the weights before the first update."""
    return [PolicyBatch(**mb, old_logp=reference_logp(engine, model_rows(mb))) for mb in mbs]


def ppo_step(engine, mbs):
    return ppo_actor_step(
        engine,
        mbs,
        policy_loss_fn=policy_loss,
        aggregate_fn=functools.partial(aggregate_loss, mode="token-mean"),
    )


def build(strategy: Strategy, model_dir: str):
    return strategy.prepare(Actor(load_causal_lm(model_dir, ds_config=strategy.ds_config())))


def train(stage: int, model_dir: str, rank: int, world: int, out: Path, extras: bool) -> dict:
    strategy = Strategy(
        StrategyOptions(zero_stage=stage, lr=1e-3, grad_accum_steps=GAS, micro_batch_size=4 // world)
    )
    strategy.setup_distributed()
    engine = build(strategy, model_dir)
    res: dict = {"losses": [], "grad_norms": []}
    mbs = with_old_logp(engine, micro_batches(rank, world))
    for step in range(STEPS):
        if extras and step == 2:
            strategy.save_checkpoint(
                engine, out / "ckpt", tag="step2", client_state={"step": 2, "data_position": 16}
            )
            res["rand_after_save"] = torch.rand(3).tolist()
        r = ppo_step(engine, mbs)
        res["losses"].append(r.loss)
        res["grad_norms"].append(r.grad_norm)
    state = strategy.full_state_dict(engine.module.model)
    if rank == 0:
        torch.save(state, out / f"weights_z{stage}_w{world}.pt")
    if extras:
        p = next(engine.module.parameters())
        res["partitioned_numel"] = p.numel()
        with strategy.gather([p]):
            res["gathered_shape"] = list(p.shape)
        res["ds_shape"] = list(p.ds_shape)
        from transformers import AutoTokenizer

        # Only rank 0 touches the folder: rank 1 names another one, which must never appear.
        mine = "" if rank == 0 else f"_r{rank}"
        tok = AutoTokenizer.from_pretrained(model_dir)
        strategy.export_hf(engine.module, out / f"export{mine}", tokenizer=tok)
        strategy.export_hf(engine.module, out / f"export_sharded{mine}", max_shard_bytes=300_000)
        # A frozen reference sharded with ZeRO-3 inference gives the initial weights' log-probs.
        ref = strategy.prepare(
            load_reference(model_dir, ds_config=strategy.ds_config(train=False)), train=False
        )
        res["ref_logp_max_diff"] = max(
            (reference_logp(ref, mb) - mb.old_logp).abs().max().item() for mb in mbs
        )
        p_ref = next(ref.module.parameters())
        res["ref_shard"] = [p_ref.ds_tensor.numel(), p_ref.ds_numel]
        # Resume from the step-2 checkpoint in a fresh engine and redo step 3.
        torch.manual_seed(1234)
        engine2 = build(strategy, model_dir)
        caller = strategy.load_checkpoint(engine2, out / "ckpt")
        res["caller_state"] = caller
        res["rand_after_load"] = torch.rand(3).tolist()
        r = ppo_step(engine2, mbs)
        res["resumed_loss"] = r.loss
        state2 = strategy.full_state_dict(engine2.module.model)
        res["resumed_max_diff"] = max((state2[k] - state[k]).abs().max().item() for k in state)
    return res


def ring_checks(model_dir: str, rank: int, world: int) -> dict:
    import torch.distributed as dist
    import torch.nn.functional as F
    from rlhf_learner.ring_attention import (
        gather_sequence,
        ring_attention,
        split_sequence,
        use_ring_attention,
    )
    from transformers import AutoModelForCausalLM

    res: dict = {}
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 3, 16, 8, generator=g) for _ in range(3))
    dout = torch.randn(2, 3, 16, 8, generator=g)
    qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qf, kf, vf, is_causal=True)
    ref.backward(dout)
    ql, kl, vl = (split_sequence(t, dim=2).clone().requires_grad_() for t in (q, k, v))
    out = ring_attention(ql, kl, vl)
    out.backward(split_sequence(dout, dim=2))
    res["attn_out"] = (out - split_sequence(ref, dim=2)).abs().max().item()
    res["attn_dq"] = (ql.grad - split_sequence(qf.grad, dim=2)).abs().max().item()
    res["attn_dk"] = (kl.grad - split_sequence(kf.grad, dim=2)).abs().max().item()
    res["attn_dv"] = (vl.grad - split_sequence(vf.grad, dim=2)).abs().max().item()
    full_out = gather_sequence(out.detach(), dim=2)
    res["attn_gathered"] = (full_out - ref.detach()).abs().max().item()

    # A whole model: chunked with ring attention vs. the full sequence on one rank.
    ids = torch.randint(3, 400, (2, 32), generator=g)
    labels = ids[:, 1:]
    single = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
    logits = single(ids).logits[:, :-1]
    logp_ref = torch.log_softmax(logits, -1).gather(-1, labels[..., None]).squeeze(-1)
    logp_ref.sum().backward()
    ring = AutoModelForCausalLM.from_pretrained(model_dir)
    use_ring_attention(ring)
    pos = torch.arange(32).expand(2, 32)
    local_logits = ring(split_sequence(ids), position_ids=split_sequence(pos)).logits
    # Next-token labels, shifted globally; the very last position predicts nothing.
    next_ids = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)
    valid = torch.ones(2, 32, dtype=torch.bool)
    valid[:, -1] = False
    lp = torch.log_softmax(local_logits, -1).gather(-1, split_sequence(next_ids)[..., None]).squeeze(-1)
    lp = lp * split_sequence(valid)
    lp.sum().backward()
    full_lp = gather_sequence(lp.detach())[:, :-1]
    res["model_logp"] = (full_lp - logp_ref.detach()).abs().max().item()
    worst = 0.0
    for (_, a), (_, b) in zip(ring.named_parameters(), single.named_parameters(), strict=True):
        grad = a.grad.clone()
        dist.all_reduce(grad)
        worst = max(worst, (grad - b.grad).abs().max().item())
    res["model_grad"] = worst
    res |= packed_ring_checks(model_dir, g)
    return res


PACKED = [[5, 7, 4], [9, 3, 4]]  # sequence lengths of two packed rows of 16 tokens
PACKED_ODD = [[5, 6, 4], [8, 3, 4]]  # 15 tokens: the actor pads each row to 16 for two ranks


def packed_ring_checks(model_dir: str, g: torch.Generator) -> dict:
    """Packed rows through the ring: attention against a block-diagonal causal reference, and a whole
    actor (odd row length, so padded; gradient checkpointing on) against each sequence run alone on
    one rank (the unpacked truth)."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from rlhf_learner.models import Actor
    from rlhf_learner.ring_attention import ring_attention, sequence_starts, split_sequence
    from transformers import AutoModelForCausalLM

    res: dict = {}
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in PACKED])
    seq = torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(row)]) for row in PACKED])
    allowed = (seq[:, :, None] == seq[:, None, :]) & torch.ones(16, 16, dtype=torch.bool).tril()
    q, k, v = (torch.randn(2, 3, 16, 8, generator=g) for _ in range(3))
    dout = torch.randn(2, 3, 16, 8, generator=g)
    qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=allowed[:, None])
    ref.backward(dout)
    ql, kl, vl = (split_sequence(t, dim=2).clone().requires_grad_() for t in (q, k, v))
    out = ring_attention(ql, kl, vl, sequence_ids=sequence_starts(split_sequence(pos)))
    out.backward(split_sequence(dout, dim=2))
    res["packed_attn_out"] = (out - split_sequence(ref, dim=2)).abs().max().item()
    for name, local, full in (("dq", ql, qf), ("dk", kl, kf), ("dv", vl, vf)):
        res[f"packed_attn_{name}"] = (local.grad - split_sequence(full.grad, dim=2)).abs().max().item()

    ids = torch.randint(3, 400, (2, 15), generator=g)
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in PACKED_ODD])
    single = Actor(AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa"))
    expected = []
    for r, row in enumerate(PACKED_ODD):
        parts, start = [], 0
        for n in row:  # each sequence alone: the unpacked truth
            lp = single(ids[r : r + 1, start : start + n]).logp
            lp.sum().backward()
            parts.append(lp.detach())
            start += n
        expected.append(torch.cat(parts, dim=1))
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    # gradient checkpointing recomputes each layer in the backward pass: the packed-rows switch must
    # reach the recomputation too
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ring = Actor(model, sequence_parallel_group=dist.group.WORLD)
    logp = ring(ids, position_ids=pos).logp
    logp.sum().backward()
    res["packed_model_logp"] = (logp.detach() - torch.cat(expected)).abs().max().item()
    worst = 0.0
    for (_, a), (_, b) in zip(ring.named_parameters(), single.named_parameters(), strict=True):
        grad = a.grad.clone()
        dist.all_reduce(grad)
        # every rank computed the full (gathered) loss: the all-reduce counts it once per rank
        worst = max(worst, (grad / dist.get_world_size() - b.grad).abs().max().item())
    res["packed_model_grad"] = worst
    return res


def sequence_parallel_sft(model_dir: str, world: int, out: Path, backend: str = "deepspeed") -> dict:
    """SFT steps on 4 rows where the ranks of a sequence-parallel group (2 ranks, or 1 in a world of
    one) get the same rows and split each sequence with ring attention: world 2 is one group holding
    all rows; world 4 is two data-parallel groups of 2 holding 2 rows each (the second group does
    not contain rank 0). Compared with one process on all rows (world 1)."""
    from rlhf_algos import sft_loss
    from rlhf_learner.steps import sft_step

    options = StrategyOptions(
        backend=backend, zero_stage=2 if world > 1 else 0, lr=1e-3, sequence_parallel_size=min(world, 2)
    )
    strategy = make_strategy(options)
    strategy.setup_distributed()
    import torch.distributed as dist

    group = strategy.sequence_parallel_group  # made by setup_distributed (None in a world of one)
    actor = Actor(load_causal_lm(model_dir), sequence_parallel_group=group)
    engine = strategy.prepare(actor)
    share = 4 // strategy.data_parallel_size
    first = strategy.data_parallel_rank * share
    rows = global_rows(seed=3)[first : first + share]
    mb = pad_rows(rows)
    mb.pop("advantages")
    mb["loss_mask"] = mb.pop("action_mask")
    mb = SFTBatch(**mb)
    # A frozen reference on the same group: the same log-probs as the whole sequence on one rank.
    frozen = make_strategy(strategy.options.for_inference())
    ref = frozen.prepare(load_reference(model_dir, sequence_parallel_group=group), train=False)
    full = reference_logp(load_reference(model_dir), mb)
    ref_diff = ((reference_logp(ref, mb) - full) * mb.attention_mask).abs().max().item()  # padding aside
    res = {
        "group_size": dist.get_world_size(group) if group is not None else 1,
        "data_parallel": [strategy.data_parallel_rank, strategy.data_parallel_size],
        "ref_logp_diff": ref_diff,
        "losses": [sft_step(engine, [mb], sft_loss_fn=sft_loss).loss for _ in range(3)],
    }
    state = strategy.full_state_dict(engine.module.model)
    if dist.get_rank() == 0:
        suffix = "" if backend == "deepspeed" else f"_{backend}"
        torch.save(state, out / f"weights_sp_w{world}{suffix}.pt")
    return res


def tensor_parallel_sft(model_dir: str, world: int, out: Path) -> dict:
    """SFT steps with DeepSpeed AutoTP over all ranks (world 2) vs. one process (world 1)."""
    from rlhf_algos import sft_loss
    from rlhf_learner.steps import sft_step

    strategy = Strategy(StrategyOptions(zero_stage=1, lr=1e-3, tensor_parallel_size=world))
    strategy.setup_distributed()
    engine = strategy.prepare(Actor(load_causal_lm(model_dir)))
    mb = pad_rows(global_rows(seed=4)[:4])
    mb.pop("advantages")
    mb["loss_mask"] = mb.pop("action_mask")
    mb = SFTBatch(**mb)
    res = {"losses": [sft_step(engine, [mb], sft_loss_fn=sft_loss).loss for _ in range(3)]}
    mlp = engine.module.model.model.layers[0].mlp.gate_proj.weight
    res["gate_proj_shape"] = list(mlp.shape)
    state = strategy.full_state_dict(engine.module.model)
    res["gate_proj_full_shape"] = list(state["model.layers.0.mlp.gate_proj.weight"].shape)
    if strategy.rank == 0:
        torch.save(state, out / f"weights_tp_w{world}.pt")
    return res


def kto_micro_batches(engine, rank: int, world: int) -> list[KTOBatch]:
    """Per micro-batch: this rank's share of 4 examples, then its share of 4 mismatched rows. The
    reference log-probs are the initial model's minus a per-row offset, so that the KL estimates
    are positive and differ between the ranks' shares."""
    g = torch.Generator().manual_seed(1)
    examples, mismatched = [], []
    for i, n in enumerate(LENGTHS + LENGTHS[::-1]):
        mask = torch.zeros(n, dtype=torch.bool)
        mask[3:] = True
        row = {"input_ids": torch.randint(3, 400, (n,), generator=g), "loss_mask": mask}
        (examples if i < len(LENGTHS) else mismatched).append((row, 0.5 * i))
    share = 4 // world
    mbs = []
    for k in range(GAS):
        take = slice(4 * k + rank * share, 4 * k + (rank + 1) * share)
        part = examples[take] + mismatched[take]
        mb = pad_rows([row for row, _ in part])
        ref = reference_sequence_logp(engine, model_rows(mb), mb["loss_mask"])
        mb["ref_logp"] = ref - torch.tensor([off for _, off in part])
        mb["desirable"] = torch.tensor([(4 * k + rank * share + j) % 3 != 0 for j in range(share)])
        mbs.append(KTOBatch(**mb))
    return mbs


def kto(model_dir: str, rank: int, world: int) -> dict:
    stage = 0 if world == 1 else 2
    strategy = Strategy(
        StrategyOptions(zero_stage=stage, lr=1e-3, grad_accum_steps=GAS, micro_batch_size=4 // world)
    )
    strategy.setup_distributed()
    engine = build(strategy, model_dir)
    mbs = kto_micro_batches(engine, rank, world)
    n = 4 // world
    local = [
        float(kto_kl_baseline(reference_sequence_logp(engine, mb, mb.loss_mask)[n:], mb.ref_logp[n:]))
        for mb in mbs
    ]
    step = functools.partial(
        kto_step, kto_loss_fn=functools.partial(kto_loss, beta=0.1), kl_baseline_fn=kto_kl_baseline
    )
    results = [step(engine, mbs) for _ in range(STEPS)]
    return {
        "losses": [r.loss for r in results],
        "kl_baseline": [r.metrics["kl_baseline"] for r in results],
        "local_kl_baseline_step1": sum(local) / len(local),
    }


def join_from_args(*extra: str) -> argparse.Namespace:
    """Parse a worker's command line (``--rank --world --port --model --out`` plus ``extra`` options with
    a value) and join the gloo group it names."""
    ap = argparse.ArgumentParser()
    for name in ("--rank", "--world", "--port"):
        ap.add_argument(name, type=int, required=True)
    for name in ("--model", "--out", *extra):
        ap.add_argument(name, required=name in ("--model", "--out"))
    args = ap.parse_args()
    from rlhf_learner.strategy import init_distributed

    init_distributed(
        rank=args.rank, world_size=args.world, master_addr="127.0.0.1", master_port=args.port, timeout_s=120
    )
    return args


def main() -> None:
    args = join_from_args()
    out = Path(args.out)
    results: dict = {}
    if args.world == 4:
        results["sp"] = sequence_parallel_sft(args.model, args.world, out)
    elif args.world == 1:
        results["z0"] = train(0, args.model, args.rank, args.world, out, extras=False)
        results["kto"] = kto(args.model, args.rank, args.world)
        results["sp"] = sequence_parallel_sft(args.model, args.world, out)
        results["tp"] = tensor_parallel_sft(args.model, args.world, out)
    else:
        results["ring"] = ring_checks(args.model, args.rank, args.world)
        results["z2"] = train(2, args.model, args.rank, args.world, out, extras=False)
        results["z3"] = train(3, args.model, args.rank, args.world, out, extras=True)
        results["kto"] = kto(args.model, args.rank, args.world)
        results["sp"] = sequence_parallel_sft(args.model, args.world, out)
        results["tp"] = tensor_parallel_sft(args.model, args.world, out)
    (out / f"results_w{args.world}_r{args.rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
