"""rlhf-learner on CPU: training tokens/s, packed vs padded, and ZeRO-3 on 2 ranks vs ZeRO-0 on 1.

    uv run python benchmarks/learner_cpu.py [--repeats 3]

1. A length-skewed batch (64 sequences, lengths 16..512, most short) trained with SFT steps on one
   process (ZeRO-0, gloo group of one): padded micro-batches (8 rows, padded to the longest row, in
   data order) vs packed micro-batches (rows of up to 512 tokens, token-balanced over the same
   number of micro-batches). Tokens/s counts real tokens only.
2. The same packed batch on 2 gloo ranks with ZeRO-3 vs one process with ZeRO-0: same global batch
   and optimizer steps (so ZeRO-3 uses 2 cores, ZeRO-0 one).
3. A vision-language model (Qwen2-VL, the same language model's shape, a 2-block vision tower): 64
   image sequences (one image each, 4 to 144 image tokens; responses skewed like the text batch) as
   rlhf's recipes lay them out, padded (``--train.packing false``) vs packed, SFT steps as in 1.
Every process runs torch on 1 thread: on a shared 2-core machine, 2-thread runs were dominated by
contention with other jobs (step times varied 5x).
Prints medians over ``--repeats`` timed steps (after one warm-up step). CPU timings on a shared
machine are noisy: the padded and packed steps are interleaved so load drift hits both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _summary
import torch
from _vlm import build_wide_vlm

SEQS = 64
MICRO = 8  # micro-batches per optimizer step
ROW_TOKENS = 512


def lengths(seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(SEQS, generator=g)
    return [int(16 + 496 * x**3) for x in u.tolist()]  # skewed: median ~75, a few near 512


def sequences(seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed + 1)
    out = []
    for n in lengths(seed):
        ids = torch.randint(3, 400, (n,), generator=g)
        out.append({"input_ids": ids, "loss_mask": torch.ones(n, dtype=torch.bool)})
    return out


def padded_micro_batches(seqs):
    per = len(seqs) // MICRO
    mbs = []
    for i in range(MICRO):
        group = seqs[i * per : (i + 1) * per]
        width = max(s["input_ids"].shape[0] for s in group)

        def pad(t, width=width):
            return torch.nn.functional.pad(t, (0, width - t.shape[0]))

        mbs.append(
            {
                "input_ids": torch.stack([pad(s["input_ids"]) for s in group]),
                "loss_mask": torch.stack([pad(s["loss_mask"]) for s in group]),
                "attention_mask": torch.stack([pad(torch.ones_like(s["input_ids"])) for s in group]),
            }
        )
    return mbs


def packed_micro_batches(seqs, n_micro=MICRO):
    from rlhf_learner.packing import balance_micro_batches, pack_sequences

    groups = balance_micro_batches([s["input_ids"].shape[0] for s in seqs], n_micro)
    mbs = []
    for group in groups:
        t = pack_sequences([seqs[i] for i in group], max_tokens_per_row=ROW_TOKENS).tensors
        # The first token of each packed sequence has no prediction: keep the mask equal to padded.
        t["loss_mask"] = t["loss_mask"] & (t["position_ids"] > 0)
        mbs.append(t)
    return mbs


def timed_steps(engine, variants, repeats):
    """Seconds per optimizer step for each list of micro-batches in ``variants``; the variants are
    interleaved (A B A B ...) so that drifting machine load hits them alike. One warm-up step each."""
    from rlhf_algos import sft_loss
    from rlhf_learner.steps import SFTBatch, sft_step

    variants = [[SFTBatch(**mb) for mb in mbs] for mbs in variants]
    for mbs in variants:
        sft_step(engine, mbs, sft_loss_fn=sft_loss)
    times: list[list[float]] = [[] for _ in variants]
    for _ in range(repeats):
        for i, mbs in enumerate(variants):
            t0 = time.perf_counter()
            sft_step(engine, mbs, sft_loss_fn=sft_loss)
            times[i].append(time.perf_counter() - t0)
    return times


def build_model(path: Path) -> Path:
    from rlhf_testkit import TinyModelSpec, build_tiny_model

    spec = TinyModelSpec(
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return build_tiny_model(path, spec)


def engine_for(model_dir, stage, gas):
    from rlhf_learner.models import Actor, load_causal_lm
    from rlhf_learner.strategy import Strategy, StrategyOptions

    s = Strategy(StrategyOptions(zero_stage=stage, grad_accum_steps=gas, lr=1e-4))
    return s.prepare(Actor(load_causal_lm(model_dir, ds_config=s.ds_config())))


def build_vlm(path: Path) -> Path:
    """The demo's tiny Qwen2-VL, its language model widened to :func:`build_model`'s shape, and a processor
    that takes images up to 336x336 pixels (144 tokens)."""
    text = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4)
    return build_wide_vlm(path, max_side=336, **text, num_key_value_heads=2)


def vlm_micro_batches(model_dir: Path) -> tuple[list[dict], list[dict], int]:
    """``(padded, packed, real tokens)``: the image sequences' micro-batches as the recipes build them."""
    from rlhf_cli.data.batches import to_rows
    from rlhf_cli.data.images import ImageEncoder
    from rlhf_cli.demo import shapes
    from rlhf_learner.packing import balance_micro_batches

    encoder = ImageEncoder.for_model(model_dir)
    g = torch.Generator().manual_seed(2)
    seqs, images = [], []
    for k, (record, n) in enumerate(zip(shapes.records(seed=3, count=SEQS), lengths(), strict=True)):
        side = 56 + 28 * (k % 11)  # 56..336 pixels: 4..144 image tokens
        picture = [record.images[0].resize((side, side))]
        prompt = torch.tensor(list(encoder.prompt(record.prompt, picture)))
        ids = torch.cat([prompt, torch.randint(3, 400, (n,), generator=g)])
        mask = torch.cat([torch.zeros_like(prompt, dtype=torch.bool), torch.ones(n, dtype=torch.bool)])
        seqs.append({"input_ids": ids, "loss_mask": mask})
        images.append(encoder.inputs(picture, ids, mask))
    per = len(seqs) // MICRO
    padded = [
        to_rows(seqs[i * per : (i + 1) * per], packing=False, images=images[i * per : (i + 1) * per]).tensors
        for i in range(MICRO)
    ]
    groups = balance_micro_batches([len(s["input_ids"]) for s in seqs], MICRO)
    packed = []
    for group in groups:
        t = to_rows([seqs[i] for i in group], packing=True, images=[images[i] for i in group]).tensors
        t["loss_mask"] = t["loss_mask"] & (t["position_ids"] > 0)
        packed.append(t)
    return padded, packed, sum(len(s["input_ids"]) for s in seqs)


def worker(args) -> None:
    from rlhf_learner.strategy import init_distributed

    init_distributed(rank=args.rank, world_size=args.world, master_addr="127.0.0.1", master_port=args.port)
    seqs = sequences()
    n_micro = MICRO // args.world
    share = packed_micro_batches(seqs, MICRO)[args.rank * n_micro : (args.rank + 1) * n_micro]
    engine = engine_for(args.model, args.stage, n_micro)
    (times,) = timed_steps(engine, [share], args.repeats)
    if args.rank == 0:
        Path(args.out).write_text(json.dumps(times))


def run_workers(model_dir, stage, world, threads, repeats, tmp) -> list[float]:
    from rlhf_learner.strategy import free_port

    port, out = free_port(), Path(tmp) / f"times_{stage}_{world}.json"
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONWARNINGS": "ignore"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--worker",
                "--rank",
                str(r),
                "--world",
                str(world),
                "--port",
                str(port),
                "--stage",
                str(stage),
                "--model",
                str(model_dir),
                "--out",
                str(out),
                "--repeats",
                str(repeats),
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    errs = [p.communicate(timeout=1200)[1] for p in procs]
    for p, err in zip(procs, errs, strict=True):
        if p.returncode:
            raise SystemExit(f"worker failed:\n{err[-3000:]}")
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--stage", type=int, default=0)
    ap.add_argument("--model", default="")
    ap.add_argument("--out", default="")
    _summary.add_argument(ap)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    seqs = sequences()
    real = sum(s["input_ids"].shape[0] for s in seqs)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp) / "model")
        print(
            f"batch: {SEQS} sequences, lengths {min(lengths())}..{max(lengths())} "
            f"(median {int(statistics.median(lengths()))}), {real} real tokens; {MICRO} micro-batches per step"
        )
        padded = padded_micro_batches(seqs)
        packed = packed_micro_batches(seqs)
        pad_cells = sum(mb["input_ids"].numel() for mb in padded)
        pack_cells = sum(mb["input_ids"].numel() for mb in packed)
        print(f"token slots computed: padded {pad_cells}, packed {pack_cells}")

        times = run_workers(model_dir, 0, 1, 1, args.repeats, tmp)  # ZeRO-0, 1 process, packed
        from rlhf_learner.strategy import init_distributed

        torch.set_num_threads(1)
        init_distributed()
        engine = engine_for(model_dir, 0, MICRO)
        t_pad, t_pack = timed_steps(engine, [padded, packed], args.repeats)
        print(
            f"seconds per step: padded {[round(t, 2) for t in t_pad]}, packed {[round(t, 2) for t in t_pack]}"
        )
        tps_pad, tps_pack = real / statistics.median(t_pad), real / statistics.median(t_pack)
        print(
            f"1 process x 1 thread, ZeRO-0: padded {tps_pad:8.0f} tok/s   packed {tps_pack:8.0f} tok/s   "
            f"packed/padded = {tps_pack / tps_pad:.2f}x"
        )

        t_z3 = run_workers(model_dir, 3, 2, 1, args.repeats, tmp)
        print(
            f"seconds per step: ZeRO-0 x1 {[round(t, 2) for t in times]}, ZeRO-3 x2 {[round(t, 2) for t in t_z3]}"
        )
        tps_z0, tps_z3 = real / statistics.median(times), real / statistics.median(t_z3)
        print(
            f"packed, same global batch: ZeRO-0 1 process x 1 thread {tps_z0:8.0f} tok/s   "
            f"ZeRO-3 2 ranks x 1 thread {tps_z3:8.0f} tok/s   ZeRO-3/ZeRO-0 = {tps_z3 / tps_z0:.2f}x"
        )
        vlm_padded, vlm_packed, vlm_real = vlm_micro_batches(build_vlm(Path(tmp) / "vlm"))
        cells = [sum(mb["input_ids"].numel() for mb in mbs) for mbs in (vlm_padded, vlm_packed)]
        print(
            f"VLM batch: {vlm_real} real tokens; token slots computed: padded {cells[0]}, packed {cells[1]}"
        )
        vlm_engine = engine_for(Path(tmp) / "vlm", 0, MICRO)
        v_pad, v_pack = timed_steps(vlm_engine, [vlm_padded, vlm_packed], args.repeats)
        print(
            f"VLM seconds per step: padded {[round(t, 2) for t in v_pad]}, packed {[round(t, 2) for t in v_pack]}"
        )
        vlm_ratio = statistics.median(v_pad) / statistics.median(v_pack)
        print(f"VLM, 1 process x 1 thread, ZeRO-0: packed/padded = {vlm_ratio:.2f}x tok/s")
        _summary.ratio_row(args.summary, "learner: packed vs padded rows, tok/s", tps_pack / tps_pad, 1.0)
        _summary.ratio_row(args.summary, "learner: VLM image rows packed vs padded, tok/s", vlm_ratio, 1.0)
        _summary.ratio_row(
            args.summary, "learner: ZeRO-3 on 2 ranks vs ZeRO-0 in 1, tok/s", tps_z3 / tps_z0, 1.0
        )


if __name__ == "__main__":
    main()
