"""Peak memory of the learner's per-token log-probs and of dense distillation, before and after the
chunked head: log-probs normalised a chunk of tokens at a time (``next_token_logprobs``) and the student's
and teacher's distributions made at the target tokens only (``Actor(..., vocab_logp_at=mask)``), against
whole-tensor formulas (the baseline: ``log_softmax`` / ``logsumexp`` over ``[rows, tokens, vocabulary]``
in float32, the distributions of every position, then the targets picked from them).

    uv run python benchmarks/distill_memory.py [--vocab 151936] [--rows 4] [--tokens 256] [--device cpu]

A one-layer Qwen2 (random weights) with a real model's vocabulary (Qwen2.5's by default); half of each
row's tokens are actions; the teacher's top 16 per action token are random. Three roles, each before and
after, each in a process of its own:
- ``policy``: a PPO actor step without distillation (minus the action tokens' log-probs, backward);
- ``student``: the same plus the dense term (reverse KL to the teacher's top 16, backward);
- ``teacher``: the teacher's forward (no gradients) giving its top 16 at the action tokens.
Memory is the peak over the step less what was held before it: on CUDA ``torch.cuda.max_memory_allocated``,
on CPU the process's peak resident set (large tensors are mapped and unmapped, so it follows them). The
two variants' losses (or targets) must agree. The ratios are reported (no target: on CPU the logits are
float32, and the copies the baseline makes of bf16 logits on a GPU are twice their size).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import _summary
import torch

TOP_K = 16
ROLES = ("policy", "student", "teacher")


def _peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _before(actor, ids, attn, mask, *, whole: bool):
    """The baseline formulas on the model's logits: per-token log-probs from a whole ``logsumexp``, and
    (``whole``) every position's distribution in float32, shifted onto its token, the targets picked."""
    logits = actor.model(input_ids=ids, attention_mask=attn, use_cache=False).logits
    z = logits[:, :-1].float() / actor.temperature
    logp = z.gather(-1, ids[:, 1:, None]).squeeze(-1) - torch.logsumexp(z, dim=-1)
    logp = torch.cat([logp.new_zeros(logp.shape[0], 1), logp], dim=1)
    if not whole:
        return logp, None
    full = torch.log_softmax(z, dim=-1)
    return logp, torch.cat([full.new_zeros(full.shape[0], 1, full.shape[-1]), full], dim=1)[mask]


def _after(actor, ids, attn, mask, *, whole: bool):
    out = actor(ids, attention_mask=attn, vocab_logp_at=mask if whole else None)
    return out.logp, out.vocab_logp


def _measure(actor, role: str, variant: str, ids, attn, mask, teacher) -> float:
    """Runs the role's step; returns its loss (or the sum of the teacher's targets)."""
    from rlhf_algos import token_divergence, with_rest
    from rlhf_learner.steps import top_tokens

    forward = _before if variant == "before" else _after
    if role == "teacher":
        with torch.no_grad():
            _, picked = forward(actor.eval(), ids, attn, mask, whole=True)
            return float(top_tokens(picked, top_k=TOP_K)[0].sum())
    logp, picked = forward(actor.train(), ids, attn, mask, whole=role == "student")
    loss = -logp[mask].mean()
    if role == "student":
        teacher_ids, teacher_logp = teacher
        term = token_divergence(
            with_rest(picked.gather(-1, teacher_ids)), with_rest(teacher_logp), loss="reverse_kl"
        )
        loss = loss + term.mean()
    loss.backward()
    return float(loss.detach())


def worker(args) -> None:
    from rlhf_learner.models import Actor
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    device = torch.device(args.device)
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4)
    config = Qwen2Config(vocab_size=args.vocab, num_key_value_heads=4, **shape)
    actor = Actor(Qwen2ForCausalLM(config)).to(device)
    ids = torch.randint(3, args.vocab, (args.rows, args.tokens), device=device)
    attn = torch.ones_like(ids)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, args.tokens // 2 :] = True
    n = int(mask.sum())
    teacher_ids = torch.randint(0, args.vocab, (n, TOP_K), device=device)
    teacher_logp = torch.log_softmax(torch.randn(n, TOP_K + 1, device=device), -1)[:, :TOP_K]
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        held = torch.cuda.memory_allocated(device)
    else:
        held = _peak_bytes(device)  # the peak so far: the model and the inputs
    role, variant = args.variant.split("-")
    value = _measure(actor, role, variant, ids, attn, mask, (teacher_ids, teacher_logp))
    if device.type == "cuda":
        torch.cuda.synchronize()
    Path(args.out).write_text(json.dumps({"peak": _peak_bytes(device) - held, "value": value}))


def _run(args, variant: str, tmp: str) -> dict:
    out = Path(tmp) / f"{variant}.json"
    cmd = [sys.executable, __file__, "--worker", "--variant", variant, "--out", str(out)]
    cmd += ["--vocab", str(args.vocab), "--rows", str(args.rows), "--tokens", str(args.tokens)]
    subprocess.run([*cmd, "--device", args.device], check=True, timeout=900)
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--variant", default="policy-after")
    ap.add_argument("--out", default="")
    _summary.add_argument(ap)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    gib = 2**30
    print(
        f"{args.rows} rows x {args.tokens} tokens (half actions), vocabulary {args.vocab}, on {args.device}"
    )
    print(
        f"one [rows, tokens, vocabulary] float32 tensor: {args.rows * args.tokens * args.vocab * 4 / gib:.2f} GiB"
    )
    print("peak over the step (less what was held before it): before, after, before / after")
    agree = True
    with tempfile.TemporaryDirectory() as tmp:
        for role in ROLES:
            before, after = _run(args, f"{role}-before", tmp), _run(args, f"{role}-after", tmp)
            ratio = before["peak"] / max(after["peak"], 1)
            same = abs(before["value"] - after["value"]) <= 1e-4 * max(1.0, abs(before["value"]))
            agree &= same
            print(
                f"  {role:8s} {before['peak'] / gib:.2f} GiB  {after['peak'] / gib:.2f} GiB  {ratio:.2f}x"
                f"  (same result: {same})"
            )
            _summary.ratio_row(args.summary, f"learner head peak memory, {role}, before / after", ratio, None)
    if not agree:
        raise SystemExit("a role's two variants disagree")


if __name__ == "__main__":
    main()
