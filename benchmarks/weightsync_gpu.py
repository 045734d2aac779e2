"""Weight sync on GPU: a 7B-size bf16 state dict over CUDA IPC and NCCL against a device-to-device copy.

Run: uv run --no-sync python benchmarks/weightsync_gpu.py [--syncs 3] [--warmup 1]
     [--transports cuda_ipc,nccl] [--bucket-mb N] [--timeout 120] [--summary FILE]

The state dict has Llama-7B's shapes (32 layers, hidden 4096, MLP 11008, vocab 32000, untied
``lm_head``): 291 bf16 tensors, 6.74B parameters, 13.5 GB, made directly on the GPU as random
tensors (no model class). This process is the learner: it holds them on ``cuda:0`` and sends them
with ``rlhf_weightsync.WeightSender``; each transport has one receiver process (started with
``torch.multiprocessing``, spawn) that holds its own preallocated bf16 tensors of the same shapes and
loads every sync into them with ``rlhf_weightsync.copy_into``, checksum verification on (it always
is), then synchronizes its device before reporting the sync done.

- D2D copy: ``torch.empty_like(x).copy_(x)`` for every tensor on ``cuda:0``, synchronized: one
  device-to-device copy of the model, the baseline, measured in the same rounds as the syncs.
- cuda_ipc: the receiver runs on the sender's GPU (colocated engine). A sync is a pack copy into a
  shared GPU slot plus a checksum on the sender, a checksum plus the load copy on the receiver.
- nccl: the receiver runs on ``cuda:1`` (NCCL needs one GPU per rank); with one GPU its row says
  ``skipped: needs 2 GPUs``.

Each round regenerates the sender's tensors (a new seed, outside the clock), times the D2D copy,
then one sync per transport; a sync is timed on the sender from ``send`` until every receiver has
loaded it. After each sync the receiver sends back a fingerprint of its own tensors (per-tensor sums
of their bits), which must equal the sender's: the weights really landed. Figures are medians over
``--syncs`` rounds after ``--warmup`` rounds; GB/s counts the model's bytes once. ``--summary FILE``
appends tab-separated rows (check, result, target, pass?) for ``benchmarks/gpu_check.sh``.
Exit status: 0 if every transport tried completed and verified, 1 if one failed, 2 if CUDA or
rlhf_weightsync is missing (one line on stderr).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import queue
import socket
import statistics
import sys
import time

PROG = "weightsync_gpu.py"
TRANSPORTS = ("cuda_ipc", "nccl")
COPY = "D2D copy"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--syncs", type=int, default=3, help="timed rounds (medians over them)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    parser.add_argument(
        "--transports", default=",".join(TRANSPORTS), help=f"comma-separated subset of {TRANSPORTS}"
    )
    parser.add_argument("--layers", type=int, default=32, help="decoder layers (Llama-7B: 32)")
    parser.add_argument("--hidden", type=int, default=4096, help="hidden size (Llama-7B: 4096)")
    parser.add_argument("--mlp", type=int, default=11008, help="MLP size (Llama-7B: 11008)")
    parser.add_argument("--vocab", type=int, default=32000, help="vocabulary (Llama-7B: 32000)")
    parser.add_argument(
        "--bucket-mb",
        type=int,
        default=None,
        help="bucket size in MiB; None: the transport's default, 64 MiB",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="seconds for every wait: joining, each sync, a receiver's answer, process exits",
    )
    parser.add_argument("--summary", default=None, help="append tab-separated table rows to this file")
    args = parser.parse_args(argv)
    chosen = [t for t in args.transports.split(",") if t]
    unknown = sorted(set(chosen) - set(TRANSPORTS))
    if unknown or not chosen:
        parser.error(f"--transports: unknown {unknown}; expected a non-empty subset of {TRANSPORTS}")
    args.transports = chosen
    for name in ("syncs", "layers", "hidden", "mlp", "vocab"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}: expected a positive integer")
    if args.warmup < 0 or not args.timeout > 0:
        parser.error("--warmup must be >= 0 and --timeout > 0")
    if args.hidden % 4 or args.mlp % 4:
        parser.error("--hidden and --mlp must be multiples of 4 (the fingerprint reads 8-byte words)")
    return args


def refuse(message: str) -> None:
    """Missing prerequisites: one line on stderr, exit status 2."""
    print(f"{PROG}: {message}", file=sys.stderr)
    raise SystemExit(2)


def model_shapes(layers: int, hidden: int, mlp: int, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """Llama-7B's parameter names and shapes (multi-head attention, untied embeddings)."""
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            (p + "self_attn.q_proj.weight", (hidden, hidden)),
            (p + "self_attn.k_proj.weight", (hidden, hidden)),
            (p + "self_attn.v_proj.weight", (hidden, hidden)),
            (p + "self_attn.o_proj.weight", (hidden, hidden)),
            (p + "mlp.gate_proj.weight", (mlp, hidden)),
            (p + "mlp.up_proj.weight", (mlp, hidden)),
            (p + "mlp.down_proj.weight", (hidden, mlp)),
            (p + "input_layernorm.weight", (hidden,)),
            (p + "post_attention_layernorm.weight", (hidden,)),
        ]
    out += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    return out


def fingerprint(tensors) -> list[int]:
    """Per-tensor wrapping sums of the tensors' bits as int64 words (one GPU reduction each)."""
    import torch

    return torch.stack([t.view(-1).view(torch.int64).sum() for t in tensors]).tolist()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def receiver_main(
    transport: str,
    port: int,
    device: str,
    shapes: list[tuple[str, tuple[int, ...]]],
    rounds: int,
    timeout_s: float,
    answers,
) -> None:
    """A receiver process (rank 1): its own tensors, ``copy_into`` them every sync, report a fingerprint."""
    try:
        import torch
        from rlhf_weightsync import WeightReceiver, copy_into

        torch.cuda.set_device(device)
        model = {n: torch.zeros(s, dtype=torch.bfloat16, device=device) for n, s in shapes}
        receiver = WeightReceiver(
            transport=transport,
            master_addr="127.0.0.1",
            master_port=port,
            rank=1,
            world_size=2,
            timeout_s=timeout_s,
            connect_timeout_s=timeout_s,
            device=device,
        )
        copier = copy_into(model)

        def load(named_tensors) -> None:
            copier(named_tensors)
            torch.cuda.synchronize(device)  # the copies have landed before the sync is reported done

        load.target_for = copier.target_for  # split tensors are written straight into the model
        for r in range(rounds):
            stats = receiver.receive(load, timeout_s=timeout_s)
            answers.put(("synced", r, fingerprint(model.values()), stats.seconds))
        receiver.close()
    except BaseException as exc:
        with contextlib.suppress(Exception):
            answers.put(("error", f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1) from None


class Link:
    """One transport: its receiver process and this process's ``WeightSender``."""

    def __init__(self, transport: str, device: str, shapes, args, ctx) -> None:
        self.transport, self.device, self.args = transport, device, args
        self.port = free_port()
        self.answers = ctx.Queue()
        self.proc = ctx.Process(
            target=receiver_main,
            args=(transport, self.port, device, shapes, args.warmup + args.syncs, args.timeout, self.answers),
            name=f"receiver-{transport}",
        )
        self.sender = None
        self.times: list[float] = []
        self.receiver_times: list[float] = []
        self.error: str | None = None
        self.proc.start()

    def connect(self) -> None:
        from rlhf_weightsync import WeightSender

        self.sender = WeightSender(
            transport=self.transport,
            master_addr="127.0.0.1",
            master_port=self.port,
            world_size=2,
            timeout_s=self.args.timeout,
            connect_timeout_s=self.args.timeout,
            bucket_bytes=None if self.args.bucket_mb is None else self.args.bucket_mb << 20,
            device="cuda:0",
        )

    def _answer(self):
        try:
            return self.answers.get(timeout=self.args.timeout)
        except queue.Empty:
            state = "running" if self.proc.is_alive() else f"exited with {self.proc.exitcode}"
            raise RuntimeError(
                f"no answer from the receiver within {self.args.timeout:.0f} s (its process is {state})"
            ) from None

    def once(self, named, expected: list[int], round_: int, timed: bool) -> None:
        import torch

        torch.cuda.synchronize()
        t0 = time.perf_counter()
        self.sender.send(named)
        wall = time.perf_counter() - t0
        msg = self._answer()
        if msg[0] == "error":
            raise RuntimeError(f"receiver failed: {msg[1]}")
        _, r, got, receiver_s = msg
        if r != round_ or got != expected:
            bad = next((i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b), None)
            raise RuntimeError(
                f"round {round_}: the receiver's tensors differ from the sender's after the sync "
                f"(answer for round {r}, first differing tensor index {bad})"
            )
        if timed:
            self.times.append(wall)
            self.receiver_times.append(receiver_s)

    def fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = f"{type(exc).__name__}: {exc}".splitlines()[0]
        self.close()

    def close(self) -> None:
        # a receiver that completed every round exits at once; one that never joined or broke off
        # gets a few seconds (it fails fast once the sender's store is gone), then is killed
        healthy = self.sender is not None and self.error is None
        if self.sender is not None:
            with contextlib.suppress(Exception):
                self.sender.close()
            self.sender = None
        self.proc.join(timeout=self.args.timeout if healthy else 10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=30)
            if self.error is None:
                self.error = "the receiver did not exit when expected (killed)"
        elif self.proc.exitcode != 0 and self.error is None:
            self.error = f"the receiver exited with status {self.proc.exitcode}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import torch
        import torch.multiprocessing as mp
    except ImportError as exc:
        refuse(f"needs PyTorch with CUDA: {exc}")
    if not torch.cuda.is_available():
        refuse(f"needs a CUDA GPU: torch {torch.__version__} sees none (torch.cuda.is_available() is False)")
    try:
        import rlhf_weightsync  # noqa: F401
    except ImportError as exc:
        refuse(f"needs rlhf_weightsync (uv sync --all-packages): {exc}")

    shapes = model_shapes(args.layers, args.hidden, args.mlp, args.vocab)
    numel = sum(torch.Size(s).numel() for _, s in shapes)
    nbytes = 2 * numel
    n_gpus = torch.cuda.device_count()
    wanted = list(args.transports)
    skipped = {}
    if "nccl" in wanted and n_gpus < 2:
        skipped["nccl"] = "skipped: needs 2 GPUs"
        wanted.remove("nccl")
    free, total = torch.cuda.mem_get_info(0)
    # sender tensors + the D2D copy's + a colocated receiver's + buckets and contexts
    need = nbytes * (3 if "cuda_ipc" in wanted else 2) + (2 << 30)
    if free < need:
        refuse(
            f"needs about {need / 1e9:.1f} GB free on cuda:0, {free / 1e9:.1f} of {total / 1e9:.1f} GB are "
            "free; pass a smaller --layers"
        )

    bucket = f"{args.bucket_mb} MiB" if args.bucket_mb is not None else "transport default (64 MiB)"
    print(
        f"torch {torch.__version__}, {torch.cuda.get_device_name(0)} x{n_gpus}; state dict: {len(shapes)} bf16 "
        f"tensors, {numel / 1e9:.2f}B params, {nbytes / 1e9:.2f} GB (layers {args.layers}, hidden "
        f"{args.hidden}, MLP {args.mlp}, vocab {args.vocab}); buckets: {bucket}; median of {args.syncs} "
        f"round(s) after {args.warmup} warm-up(s)",
        flush=True,
    )

    ctx = mp.get_context("spawn")
    devices = {"cuda_ipc": "cuda:0", "nccl": "cuda:1"}
    links: dict[str, Link] = {}
    copy_times: list[float] = []
    try:
        torch.cuda.set_device(0)
        t_start = time.perf_counter()
        for t in wanted:  # receivers start (and import torch) in parallel with building the model
            links[t] = Link(t, devices[t], shapes, args, ctx)
        source = [(n, torch.empty(s, dtype=torch.bfloat16, device="cuda:0")) for n, s in shapes]
        tensors = [t for _, t in source]
        for link in links.values():
            try:
                link.connect()
            except Exception as exc:
                link.fail(exc)
        print(f"receivers joined in {time.perf_counter() - t_start:.1f} s", flush=True)
        gen = torch.Generator(device="cuda:0")
        for r in range(args.warmup + args.syncs):
            timed = r >= args.warmup
            gen.manual_seed(r)
            with torch.no_grad():
                for t in tensors:
                    t.normal_(0.0, 0.02, generator=gen)  # new weights every round, outside the clock
            expected = fingerprint(tensors)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            copies = [torch.empty_like(t).copy_(t) for t in tensors]
            torch.cuda.synchronize()
            if timed:
                copy_times.append(time.perf_counter() - t0)
            del copies
            for link in links.values():
                if link.error is None:
                    try:
                        link.once(source, expected, r, timed)
                    except Exception as exc:
                        link.fail(exc)
    finally:
        for link in links.values():
            link.close()

    rows = []  # (label, seconds or None, note, ok)
    copy_s = statistics.median(copy_times) if copy_times else None
    rows.append((f"{COPY} (empty_like + copy_)", copy_s, "baseline", True))
    for t in args.transports:
        label = f"{t} -> receiver ({devices[t]})"
        if t in skipped:
            rows.append((label, None, skipped[t], True))
            continue
        link = links[t]
        if link.error is not None or len(link.times) < args.syncs:
            rows.append((label, None, f"FAILED: {link.error or 'incomplete'}", False))
            continue
        recv = statistics.median(link.receiver_times)
        rows.append(
            (
                label,
                statistics.median(link.times),
                f"verified {args.syncs}/{args.syncs}; receiver {recv:.4f} s",
                True,
            )
        )

    print(f"\n{'method':<34} {'median s':>9} {'GB/s':>8} {'vs copy':>8}  notes")
    for label, sec, note, _ in rows:
        if sec is None:
            print(f"{label:<34} {'':>9} {'':>8} {'':>8}  {note}")
        else:
            ratio = f"{copy_s / sec:.0%}" if copy_s else ""
            print(f"{label:<34} {sec:>9.4f} {nbytes / sec / 1e9:>8.1f} {ratio:>8}  {note}")
    print(
        "GB/s counts the model's bytes once; 'vs copy' is the D2D copy's time over the row's; "
        "checksums verified by every receiver; 'verified' = the receiver's tensors matched the sender's "
        "after every sync"
    )

    if args.summary:
        size = f"{nbytes / 1e9:.1f} GB bf16"
        lines = []
        if copy_s is not None:
            lines.append(
                (
                    f"weightsync {COPY} ({size})",
                    f"{copy_s:.4f} s, {nbytes / copy_s / 1e9:.0f} GB/s",
                    "baseline",
                    "-",
                )
            )
        for t, (_, sec, note, ok) in zip(args.transports, rows[1:], strict=True):
            if sec is None:
                result = note
            else:
                result = (
                    f"{sec:.4f} s, {nbytes / sec / 1e9:.0f} GB/s, {copy_s / sec:.0%} of D2D copy, verified"
                )
            passed = "skip" if t in skipped else ("yes" if ok else "NO")
            lines.append((f"weightsync {t} ({size})", result, "completes, weights verified", passed))
        with open(args.summary, "a", encoding="utf-8") as f:
            for line in lines:
                f.write("\t".join(s.replace("\t", " ") for s in line) + "\n")

    return 0 if all(ok for *_, ok in rows) else 1


if __name__ == "__main__":
    os.environ.setdefault("NCCL_DEBUG", "WARN")
    sys.exit(main())
