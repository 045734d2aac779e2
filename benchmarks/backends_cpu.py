"""Training backends on CPU: fsdp2 against deepspeed on the same work, in one run.

    uv run python benchmarks/backends_cpu.py [--repeats 3] [--model-size small|tiny]

The ``small`` model (~23M parameters) trains SFT steps on learner_cpu.py's packed, length-skewed batch
(64 sequences, 8 micro-batches per step, split over the ranks), fp32, every rank on one thread:
deepspeed ZeRO-3 against fsdp2 full sharding on 2 gloo ranks, and deepspeed ZeRO-0 against fsdp2 on 1.
Per run: the median seconds per optimizer step (after one warm-up step; ``--repeats`` timed), each rank's
peak RSS, and the time to save and to load a checkpoint. Rows alternate between the backends so load
drift hits both alike. Targets: fsdp2 per step <= 1.1x deepspeed at 2 ranks, peak RSS per rank no higher.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _summary

RUNS = [("deepspeed", 3, 2), ("fsdp2", 3, 2), ("deepspeed", 0, 1), ("fsdp2", 0, 1)]


def worker(args) -> None:
    import learner_cpu
    from rlhf_learner.models import Actor, load_causal_lm
    from rlhf_learner.strategy import StrategyOptions, make_strategy

    n_micro = learner_cpu.MICRO // args.world
    opts = StrategyOptions(backend=args.backend, zero_stage=args.stage, grad_accum_steps=n_micro, lr=1e-4)
    strategy = make_strategy(opts)
    strategy.setup_distributed(
        rank=args.rank, world_size=args.world, master_addr="127.0.0.1", master_port=args.port
    )
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    seqs = [s | {"input_ids": s["input_ids"] % vocab} for s in learner_cpu.sequences()]
    mbs = learner_cpu.packed_micro_batches(seqs, learner_cpu.MICRO)
    share = mbs[args.rank * n_micro : (args.rank + 1) * n_micro]
    engine = strategy.prepare(Actor(load_causal_lm(args.model, ds_config=strategy.loader_config())))
    (times,) = learner_cpu.timed_steps(engine, [share], args.repeats)
    ckpt = Path(args.out).with_suffix(".ckpt")
    t0 = time.perf_counter()
    strategy.save_checkpoint(engine, ckpt, tag="bench")
    t_save = time.perf_counter() - t0
    t0 = time.perf_counter()
    strategy.load_checkpoint(engine, ckpt, tag="bench")
    t_load = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    result = {"times": times, "save": t_save, "load": t_load, "rss": rss}
    Path(f"{args.out}.r{args.rank}").write_text(json.dumps(result))


def run(model_dir: Path, backend: str, stage: int, world: int, repeats: int, tmp: str) -> list[dict]:
    from rlhf_learner.strategy import free_port

    port, out = free_port(), Path(tmp) / f"{backend}_{stage}_{world}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, __file__, "--worker", "--world", str(world), "--port", str(port)]
    cmd += ["--backend", backend, "--stage", str(stage), "--model", str(model_dir), "--out", str(out)]
    cmd += ["--repeats", str(repeats)]
    procs = [
        subprocess.Popen(
            [*cmd, "--rank", str(r)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        for r in range(world)
    ]
    errs = [p.communicate(timeout=1800)[1] for p in procs]
    for p, err in zip(procs, errs, strict=True):
        if p.returncode:
            raise SystemExit(f"{backend} worker failed:\n{err[-3000:]}")
    return [json.loads(Path(f"{out}.r{r}").read_text()) for r in range(world)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model-size", dest="size", default="small", choices=["tiny", "small"])
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--backend", default="deepspeed")
    ap.add_argument("--stage", type=int, default=0)
    ap.add_argument("--model", default="")
    ap.add_argument("--out", default="")
    _summary.add_argument(ap)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    import _grpo_work

    results: dict[tuple[str, int, int], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = _grpo_work.build_model(args.size, Path(tmp))
        for backend, stage, world in RUNS:
            results[backend, stage, world] = run(model_dir, backend, stage, world, args.repeats, tmp)
    print(f"model {args.size}, fp32, 1 thread per rank; medians of {args.repeats} steps")
    print(
        f"{'backend':<10} {'sharding':<9} {'ranks':>5} {'s/step':>8} {'peak RSS/rank GiB':>18} {'save s':>7} {'load s':>7}"
    )
    step: dict[tuple[str, int, int], float] = {}
    for (backend, stage, world), ranks in results.items():
        step[backend, stage, world] = statistics.median(ranks[0]["times"])
        rss = max(r["rss"] for r in ranks)
        print(
            f"{backend:<10} {'full' if stage == 3 else 'none':<9} {world:>5} {step[backend, stage, world]:8.2f} "
            f"{rss:18.2f} {ranks[0]['save']:7.2f} {ranks[0]['load']:7.2f}"
        )
    for world, stage in ((2, 3), (1, 0)):
        ratio = step["fsdp2", stage, world] / step["deepspeed", stage, world]
        mem = max(r["rss"] for r in results["fsdp2", stage, world]) / max(
            r["rss"] for r in results["deepspeed", stage, world]
        )
        print(
            f"{world} rank(s): fsdp2/deepspeed step time {ratio:.2f}x (target <= 1.1), peak RSS {mem:.2f}x (<= 1)"
        )
        name = f"backends: fsdp2 speed vs deepspeed (their s/step over ours), {world} rank(s)"
        _summary.ratio_row(args.summary, name, 1 / ratio, round(1 / 1.1, 2), f"RSS {mem:.2f}x")


if __name__ == "__main__":
    main()
