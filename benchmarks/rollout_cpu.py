"""Rollout throughput on CPU: our engine wrappers against the raw engines they wrap.

Run: uv run python benchmarks/rollout_cpu.py [--models tiny,small,vlm,vlm-small] [--repeats 3]

For each model (the test kit's tiny 2-layer model and a ~25M-parameter one, both random, float32):
32 prompts x 4 samples x up to 64 new tokens, temperature 1, EOS allowed (ragged lengths), timed as
1. raw ``vllm.LLM.generate`` (default engine options), without and with per-token logprobs,
2. our vLLM engine in its Ray actor, driven by ``SingleTurnExecutor`` (logprobs of every token),
3. raw transformers ``generate`` (one left-padded batch of 128 rows),
4. our ``TransformersEngine`` (logprobs of every token).
``--models vlm,vlm-small``: the demo's tiny Qwen2-VL (its language model as is, or shaped as ``small``)
on 32 image prompts (one drawn image each, 56 to 112 pixels square), raw ``vllm.LLM.generate`` given the
same ids and images against our vLLM engine (1 and 2 only).
Raw and ours run interleaved (one warm-up each, then ``--repeats`` alternating rounds) so the load of a
shared machine hits both alike. Prints median wall time, generated tokens and tokens per second, and
the ratios ours / raw and vLLM / transformers (of median tok/s).
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import _summary
from _vlm import build_wide_vlm

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

VLLM_OURS = "our vLLM (Ray actor + executor)"
RAW_VLLM_LOGPROBS = "raw vLLM + logprobs"

MODELS = {
    "tiny": {},
    "small": dict(
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
    ),
}


def make_prompts(tokenizer, num: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    words = "guess the number add plus minus equals think step answer question total result".split()
    out = []
    for _ in range(num):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(4, 24)))
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        out.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    return out


def interleaved(runners: dict, repeats: int) -> dict:
    """One warm-up each, then ``repeats`` rounds that run every runner once (so drift in the
    machine's load hits all alike). Returns ``name -> (median seconds, median tokens, median tok/s)``."""
    for fn in runners.values():
        fn()
    samples: dict[str, list[tuple[float, int]]] = {name: [] for name in runners}
    for _ in range(repeats):
        for name, fn in runners.items():
            t0 = time.perf_counter()
            tokens = fn()
            samples[name].append((time.perf_counter() - t0, tokens))
    return {
        name: (
            statistics.median(t for t, _ in runs),
            int(statistics.median(n for _, n in runs)),
            statistics.median(n / t for t, n in runs),
        )
        for name, runs in samples.items()
    }


def image_prompts(model_dir, num: int):
    """``(ours, raw)``: ``num`` image prompts as our recipes build them (:class:`ImagePrompt`, placeholders
    expanded), and as a vLLM user writes them (the chat template's text tokenized, one placeholder per image,
    the images as ``multi_modal_data``)."""
    from rlhf_cli.data.images import ImageEncoder
    from rlhf_cli.demo import shapes

    encoder = ImageEncoder.for_model(model_dir)
    ours, raw = [], []
    for k, record in enumerate(shapes.records(seed=1, count=num)):
        images = [record.images[0].resize((56 + 28 * (k % 3),) * 2)]
        ours.append(encoder.prompt(record.prompt, images))
        words = record.prompt.replace("<image>", "")  # the demo's prompts open with their image
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": words}]}]
        text = encoder.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = encoder.processor.tokenizer(text, add_special_tokens=False)["input_ids"]
        raw.append({"prompt_token_ids": ids, "multi_modal_data": {"image": images}})
    return ours, raw


def bench_vlm(name: str, root: Path, args) -> dict:
    from rlhf_cli.demo.tiny_vlm import build_tiny_vlm
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    shape = MODELS[name.removeprefix("vlm-")] if name != "vlm" else None
    model_dir = build_wide_vlm(root / name, **shape) if shape else build_tiny_vlm(root / name)
    params = sum(p.numel() for p in AutoModelForImageTextToText.from_pretrained(model_dir).parameters())
    ours, raw = image_prompts(model_dir, args.prompts)
    raw_run, raw_lp_run, raw_close = raw_vllm(model_dir, raw, args)
    our_run, our_close = our_vllm(model_dir, ours, AutoTokenizer.from_pretrained(model_dir), args)
    try:
        runners = {"raw vLLM": raw_run, RAW_VLLM_LOGPROBS: raw_lp_run, VLLM_OURS: our_run}
        res = {"params": params, **interleaved(runners, args.repeats)}
    finally:
        our_close()
        raw_close()
    for key, value in res.items():
        if key != "params":
            print(f"[{name}] {key}: {value[0]:.3f} s, {value[1]} tokens, {value[2]:.0f} tok/s", flush=True)
    return res


def raw_vllm(model_dir, prompts, args):
    """``vllm.LLM.generate`` with default engine options, without and with per-token logprobs (the
    work an RL rollout needs); returns (run, run_with_logprobs, close)."""
    import vllm
    from vllm.inputs import TokensPrompt

    llm = vllm.LLM(model=str(model_dir), dtype="float32", seed=0)
    sp = vllm.SamplingParams(n=args.samples, temperature=1.0, max_tokens=args.max_new_tokens)
    sp_logprobs = vllm.SamplingParams(
        n=args.samples,
        temperature=1.0,
        max_tokens=args.max_new_tokens,
        logprobs=0,
        flat_logprobs=True,
        detokenize=False,
    )
    reqs = [TokensPrompt(**p) if isinstance(p, dict) else TokensPrompt(prompt_token_ids=p) for p in prompts]

    def run(sampling=sp):
        outs = llm.generate(reqs, sampling, use_tqdm=False)
        return sum(len(c.token_ids) for o in outs for c in o.outputs)

    return run, functools.partial(run, sp_logprobs), llm.llm_engine.engine_core.shutdown


def our_vllm(model_dir, prompts, tokenizer, args):
    """Our vLLM engine in a Ray actor, driven by SingleTurnExecutor; returns (run, close)."""
    import ray
    from rlhf_rollout import EngineClient, SamplingParams, SingleTurnExecutor, create_engines

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    (actor,) = create_engines(
        num_engines=1,
        backend="vllm",
        engine_kwargs=dict(model=str(model_dir), dtype="float32", seed=0),
        num_cpus_per_engine=1,
        env_vars={  # every core, as raw vLLM's worker takes
            "VLLM_CPU_KVCACHE_SPACE": os.environ["VLLM_CPU_KVCACHE_SPACE"],
            "OMP_NUM_THREADS": str(os.cpu_count()),
        },
    )
    params = SamplingParams(temperature=1.0, n=args.samples, max_new_tokens=args.max_new_tokens)
    ex = SingleTurnExecutor(engine=EngineClient([actor]), params=params, tokenizer=tokenizer)

    def run():
        return sum(t.response_len for t in ex.run(prompts))

    def close():
        ray.get(actor.shutdown.remote())
        ray.shutdown()

    return run, close


def raw_hf(model, prompts, pad_id, args):
    import torch

    rows = [p for p in prompts for _ in range(args.samples)]
    longest = max(map(len, rows))
    ids = torch.tensor([[pad_id] * (longest - len(p)) + p for p in rows])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in rows])
    eos = model.generation_config.eos_token_id

    def run():
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=args.max_new_tokens,
                pad_token_id=pad_id,
            )
        new = out[:, longest:]
        done = (new == eos).int().cumsum(-1)
        return int(((done == 0) | ((done == 1) & (new == eos))).sum())  # tokens up to and including EOS

    return run


def our_hf(model, prompts, args):
    from rlhf_rollout import SamplingParams, TransformersEngine

    engine = TransformersEngine(model=model)
    params = SamplingParams(temperature=1.0, n=args.samples, max_new_tokens=args.max_new_tokens)

    def run():
        return sum(len(g.token_ids) for row in engine.generate(prompts, params) for g in row)

    return run


def bench_model(name: str, root: Path, args) -> dict:
    import torch
    from rlhf_testkit import TinyModelSpec, build_tiny_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = build_tiny_model(root / name, TinyModelSpec(**MODELS[name]))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    n_params = sum(p.numel() for p in model.parameters())
    prompts = make_prompts(tokenizer, args.prompts)
    res = {"params": n_params}
    if "vllm" in args.backends:
        raw_run, raw_lp_run, raw_close = raw_vllm(model_dir, prompts, args)
        our_run, our_close = our_vllm(model_dir, prompts, tokenizer, args)
        try:
            runners = {"raw vLLM": raw_run, RAW_VLLM_LOGPROBS: raw_lp_run, VLLM_OURS: our_run}
            res.update(interleaved(runners, args.repeats))
        finally:
            our_close()
            raw_close()
        gc.collect()
    if "transformers" in args.backends:
        runners = {"raw transformers": raw_hf(model, prompts, tokenizer.pad_token_id, args)}
        runners["our transformers"] = our_hf(model, prompts, args)
        res.update(interleaved(runners, args.repeats))
    for key, value in res.items():
        if key != "params":
            print(f"[{name}] {key}: {value[0]:.3f} s, {value[1]} tokens, {value[2]:.0f} tok/s", flush=True)
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,small,vlm,vlm-small")
    parser.add_argument("--backends", default="vllm,transformers")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    _summary.add_argument(parser)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = {
            name: bench_vlm(name, Path(tmp), args)
            if name.startswith("vlm")
            else bench_model(name, Path(tmp), args)
            for name in args.models.split(",")
        }
    print(
        f"\n{args.prompts} prompts x {args.samples} samples x <= {args.max_new_tokens} new tokens, "
        f"temperature 1, EOS allowed; median of {args.repeats}"
    )
    for name, res in results.items():
        print(f"\n{name} ({res['params'] / 1e6:.1f}M params)")
        print(f"  {'engine':34s} {'seconds':>8s} {'tokens':>7s} {'tok/s':>9s}")
        tps = {}
        for key, value in res.items():
            if key == "params":
                continue
            t, tokens, tps[key] = value
            print(f"  {key:34s} {t:8.3f} {tokens:7d} {tps[key]:9.0f}")
        pairs = [
            (VLLM_OURS, "raw vLLM"),
            (VLLM_OURS, RAW_VLLM_LOGPROBS),
            (RAW_VLLM_LOGPROBS, "raw vLLM"),
            ("our transformers", "raw transformers"),
            ("raw vLLM", "raw transformers"),
            (VLLM_OURS, "our transformers"),
        ]
        for a, b in pairs:
            if a in tps and b in tps:
                print(f"  ratio tok/s  {a} / {b}: {tps[a] / tps[b]:.2f}")
        for a, b in ((VLLM_OURS, RAW_VLLM_LOGPROBS), ("our transformers", "raw transformers")):
            if a in tps and b in tps:
                check = f"rollout {name}: {a} / {b}, tok/s"
                _summary.ratio_row(args.summary, check, tps[a] / tps[b], 0.9)


if __name__ == "__main__":
    main()
