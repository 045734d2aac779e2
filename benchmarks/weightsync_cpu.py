"""Weight sync on CPU: plain memcpy (the limit) vs shm vs bucketed gloo vs per-parameter gloo broadcast.

Run: uv run --no-sync python benchmarks/weightsync_cpu.py [--syncs 7] [--bucket-mb N] [--receivers 1] [--threads 1]
     [--methods shm,shm delivery,...]

A Qwen2-shaped fp32 model of ~50M parameters in 195 tensors (vocab 16000, hidden 640, 16 layers) is
synced from this process (the sender) to receiver processes, each of which copies every tensor into
its own model of the same shape, as an engine's load_weights does. Each figure is the median over
``--syncs`` rounds (after one warm-up round); each round runs every method once, one after the
other, so that all methods see the same background load. A sync is timed on the sender from its
start until every receiver has finished loading it (receivers' CPU seconds from the start of the
sync). GB/s counts the model's bytes once. The sender and receivers use
``--threads`` torch threads each (default 1: on a 2-core machine two processes with two OpenMP
threads each oversubscribe the cores); the memcpy limit uses the machine's default thread count.

- memcpy: ``dst.copy_(src)`` for every tensor, in this process: the bound for any sync.
- shm, gloo -> model: ``WeightSender.send(model.named_parameters())`` with checksums, each receiver
  loading into its model with ``copy_into(model)`` (end to end: the sender's pack copy plus the
  receiver's load copy).
- shm, gloo, delivery only: the same sync, but the receiver's load callback only takes every
  (verified) tensor and keeps none: what the transport itself costs, comparable to one memcpy.
  Tensors larger than a bucket are still assembled from their pieces in a scratch buffer.
- per-parameter gloo: OpenRLHF's way: for every parameter one ``broadcast`` on a (private) gloo
  group, the receiver allocating a tensor per parameter and then loading it into its model.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rlhf_weightsync import WeightReceiver, WeightSender, copy_into
from rlhf_weightsync.checksum import word_sum

VOCAB, HIDDEN, INTER, KV, LAYERS = 16000, 640, 448, 128, 16


def model_shapes() -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (HIDDEN, HIDDEN),
            p + "self_attn.q_proj.bias": (HIDDEN,),
            p + "self_attn.k_proj.weight": (KV, HIDDEN),
            p + "self_attn.k_proj.bias": (KV,),
            p + "self_attn.v_proj.weight": (KV, HIDDEN),
            p + "self_attn.v_proj.bias": (KV,),
            p + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
            p + "mlp.gate_proj.weight": (INTER, HIDDEN),
            p + "mlp.up_proj.weight": (INTER, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, INTER),
            p + "input_layernorm.weight": (HIDDEN,),
            p + "post_attention_layernorm.weight": (HIDDEN,),
        }
    shapes |= {"model.norm.weight": (HIDDEN,), "lm_head.weight": (VOCAB, HIDDEN)}
    return shapes


def make_model(fill: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    if fill == "random":
        return {n: torch.randn(s, generator=gen) for n, s in model_shapes().items()}
    return {n: torch.zeros(s) for n, s in model_shapes().items()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def private_gloo(port: int, rank: int, world: int) -> dist.ProcessGroupGloo:
    store = dist.TCPStore("127.0.0.1", port, None, rank == 0, timedelta(seconds=120), wait_for_workers=False)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timedelta(seconds=120)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(store, rank, world, opts)


DELIVERY = " delivery"
METHODS = ("shm", "shm delivery", "gloo", "gloo delivery", "per-param gloo")
TRANSPORT = {m: m.removesuffix(DELIVERY) for m in METHODS}
LABELS = {
    "shm": "shm -> model",
    "shm delivery": "shm, delivery only",
    "gloo": "gloo -> model",
    "gloo delivery": "gloo, delivery only",
    "per-param gloo": "per-param gloo -> model",
}


def consume(named_tensors) -> None:
    """A load callback that takes every (verified) tensor and keeps none: the transport's own cost."""
    for _ in named_tensors:
        pass


def receiver_main(rank: int, method: str, port: int, world: int, syncs: int, threads: int, cpu_q) -> None:
    torch.set_num_threads(threads)
    model = make_model("zeros")
    cpu = []
    if method == "per-param gloo":
        pg = private_gloo(port, rank, world)
        for _ in range(syncs):
            pg.barrier().wait()  # the sender starts its clock here
            c0 = time.process_time()
            for name, shape in model_shapes().items():
                buf = torch.empty(shape)  # a fresh tensor per parameter, then loaded into the model
                pg.broadcast(buf, 0).wait()
                model[name].copy_(buf)
            cpu.append(time.process_time() - c0)
            pg.barrier().wait()
        cpu_q.put(cpu)
        return
    receiver = WeightReceiver(
        transport=TRANSPORT[method],
        master_addr="127.0.0.1",
        master_port=port,
        rank=rank,
        world_size=world,
        timeout_s=120,
    )
    load = consume if method.endswith(DELIVERY) else copy_into(model)
    started: list[float] = []

    def timed(named_tensors) -> None:
        # the clock starts once the sync has started: the wait for it (polling the store while
        # the other methods run) is not part of a sync's cost
        started.append(time.process_time())
        load(named_tensors)

    if hasattr(load, "target_for"):
        timed.target_for = load.target_for  # keep copy_into's in-place path for split tensors
    for _ in range(syncs):
        receiver.receive(timed)
        cpu.append(time.process_time() - started.pop())
    receiver.close()
    cpu_q.put(cpu)


class Method:
    """One way of syncing, with its receiver processes started; ``once()`` times one sync."""

    def __init__(self, method: str, model: dict[str, torch.Tensor], args) -> None:
        self.method, self.model = method, model
        port, world = free_port(), args.receivers + 1
        ctx = mp.get_context("spawn")
        self.cpu_q = ctx.Queue()
        self.procs = [
            ctx.Process(
                target=receiver_main, args=(r, method, port, world, args.syncs + 1, args.threads, self.cpu_q)
            )
            for r in range(1, world)
        ]
        for p in self.procs:
            p.start()
        if method == "per-param gloo":
            self.pg = private_gloo(port, 0, world)
        else:
            self.sender = WeightSender(
                transport=TRANSPORT[method],
                master_addr="127.0.0.1",
                master_port=port,
                world_size=world,
                timeout_s=120,
                connect_timeout_s=300,
                bucket_bytes=None if args.bucket_mb is None else args.bucket_mb << 20,
            )

    def once(self) -> tuple[float, float]:
        """(wall seconds, sender CPU seconds) of one sync."""
        if self.method == "per-param gloo":
            self.pg.barrier().wait()
        t0, c0 = time.perf_counter(), time.process_time()
        if self.method == "per-param gloo":
            for tensor in self.model.values():
                self.pg.broadcast(tensor, 0).wait()
            self.pg.barrier().wait()
        else:
            self.sender.send(self.model.items())
        return time.perf_counter() - t0, time.process_time() - c0

    def close(self) -> list[float]:
        """The receivers' CPU seconds per sync (first receiver)."""
        if self.method != "per-param gloo":
            self.sender.close()
        cpu = [self.cpu_q.get(timeout=120) for _ in self.procs]
        for p in self.procs:
            p.join(timeout=120)
            if p.exitcode != 0:
                raise RuntimeError(f"{self.method}: receiver exited with {p.exitcode}")
        return cpu[0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--syncs", type=int, default=7)
    parser.add_argument("--bucket-mb", type=int, default=None, help="default: the transport's default")
    parser.add_argument("--receivers", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of sender and receivers")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {METHODS}")
    args = parser.parse_args()
    model = make_model("random")
    nbytes = sum(t.numel() * t.element_size() for t in model.values())
    default_threads = torch.get_num_threads()
    print(
        f"torch {torch.__version__}; model: {len(model)} fp32 tensors, "
        f"{sum(t.numel() for t in model.values()) / 1e6:.1f}M params, {nbytes / 1e6:.0f} MB; "
        f"{args.receivers} receiver process(es); {args.threads} torch thread(s) per sync process; buckets: "
        f"{'transport default' if args.bucket_mb is None else f'{args.bucket_mb} MiB'}; "
        f"median of {args.syncs} rounds, methods interleaved within each round"
    )
    dst = make_model("zeros")
    flat = [t.view(-1).view(torch.uint8) for t in model.values()]

    def copy_all() -> float:
        t0 = time.perf_counter()
        for name, tensor in model.items():
            dst[name].copy_(tensor)
        return time.perf_counter() - t0

    def checksum_all() -> float:
        t0 = time.perf_counter()
        for b in flat:
            word_sum(b, 0, b.numel())
        return time.perf_counter() - t0

    unknown = set(args.methods.split(",")) - set(METHODS)
    if unknown:
        parser.error(f"--methods: unknown {sorted(unknown)}; expected a subset of {METHODS}")
    methods = {name: Method(name, model, args) for name in args.methods.split(",")}
    rows = [f"memcpy ({default_threads} thr)", f"memcpy ({args.threads} thr)", *methods]
    times: dict[str, list[float]] = {row: [] for row in [*rows, "checksum"]}
    send_cpu: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(args.syncs + 1):  # the first round warms up
        torch.set_num_threads(default_threads)
        times[rows[0]].append(copy_all())
        torch.set_num_threads(args.threads)
        times[rows[1]].append(copy_all())
        times["checksum"].append(checksum_all())
        for name, method in methods.items():
            wall, cpu = method.once()
            times[name].append(wall)
            send_cpu[name].append(cpu)
    recv_cpu = {name: method.close() for name, method in methods.items()}
    med = {row: statistics.median(ts[1:]) for row, ts in times.items()}
    limit = min(med[rows[0]], med[rows[1]])
    print(
        f"{'method':<24} {'median s':>9} {'GB/s':>7} {'vs memcpy':>10} {'vs per-param gloo':>18} "
        f"{'CPU s send / recv':>18}"
    )
    for row in rows:
        sec = med[row]
        cpu = (
            f"{statistics.median(send_cpu[row][1:]):.3f} / {statistics.median(recv_cpu[row][1:]):.3f}"
            if row in methods
            else ""
        )
        print(
            f"{LABELS.get(row, row):<24} {sec:>9.4f} {nbytes / sec / 1e9:>7.2f} {limit / sec:>9.0%} "
            f"{med.get('per-param gloo', float('nan')) / sec:>17.2f}x {cpu:>18}"
        )
    print(
        f"('vs memcpy' is against the faster memcpy row.) checksum, one pass over the model: "
        f"{nbytes / med['checksum'] / 1e9:.1f} GB/s"
    )


if __name__ == "__main__":
    main()
