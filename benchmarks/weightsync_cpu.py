"""Weight sync on CPU: memcpy (the limit) vs shm vs bucketed gloo vs per-parameter gloo broadcasts.

Run: uv run python benchmarks/weightsync_cpu.py [--syncs 7] [--bucket-mb N] [--receivers 1] [--threads 1]
     [--receiver-threads N]
     [--methods shm,shm delivery,gloo,gloo delivery,gloo raw,per-param openrlhf,per-param gloo]
     uv run python benchmarks/weightsync_cpu.py --across-hosts [--syncs 7]   (as root)

``--across-hosts``: the 23M model (``_grpo_work.py``'s ``small``) from a sender on test host A to a
receiver on test host B over gloo (two network namespaces joined by a veth link,
``rlhf_testkit.hosts``), against shm from host A to a receiver on host A, one sync of each per round.

A Qwen2-shaped fp32 model of ~50M parameters in 195 tensors (vocab 16000, hidden 640, 16 layers) is
synced from this process (the sender) to receiver processes, each of which copies every tensor into
its own model of the same shape, as an engine's load_weights does. Each figure is the median over
``--syncs`` rounds (after one warm-up round); each round runs every method once, one after the
other, so that all methods see the same background load. A sync is timed on the sender from its
start until every receiver has finished loading it (receivers' CPU seconds from the start of the
sync). GB/s counts the model's bytes once. The sender and receivers use
``--threads`` torch threads each (default 1: on a 2-core machine two processes with two OpenMP
threads each oversubscribe the cores). Two phases: every method without Ray, then (for OpenRLHF's
protocol, which needs Ray) gloo and both per-parameter methods again with a local Ray instance
running, because Ray's idle processes take CPU from everything timed beside them.

- memcpy: ``dst.copy_(src)`` for every tensor, in this process, on one thread (a plain memcpy, as
  each side of a sync runs one thread) and on the machine's default thread count (torch splits each
  copy across threads). A sync makes two copies (into the transport, out of it into the model), so
  on the cores that the two-thread memcpy uses it cannot exceed 50% of that row.
- shm, gloo -> model: ``WeightSender.send(model.named_parameters())`` with checksums, each receiver
  loading into its model with ``copy_into(model)`` (end to end: the sender's pack copy plus the
  receiver's load copy).
- shm, gloo, delivery only: the same sync, but the receiver's load callback only takes every
  (verified) tensor and keeps none: what the transport itself costs, comparable to one memcpy.
  Tensors larger than a bucket are still assembled from their pieces in a scratch buffer.
- gloo, raw bytes only: the model's bytes (concatenated once, outside the clock) broadcast in
  32 MiB pieces, two in flight, on a two-device gloo group into two reused buffers: the gloo
  transport with nothing packed, checked or loaded, its ceiling on this machine.
- per-param gloo, OpenRLHF's protocol: what OpenRLHF's ``broadcast_to_vllm`` does for every
  parameter: a Ray call to each engine actor naming the parameter (``update_weight(name, dtype,
  shape)``), one ``broadcast`` on a private gloo group into a tensor the engine allocates, the engine
  loading it into its model, and ``ray.get`` of the calls before the next parameter. The engine is a
  Ray actor here (OpenRLHF's engines are, and add a vLLM ``collective_rpc`` hop this one skips).
- per-param gloo, broadcast only: the same broadcasts, allocations and loads with no control
  messages (shapes agreed in advance, no per-parameter wait): a lower bound of any per-parameter
  scheme, not a protocol an engine could follow as is.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from datetime import timedelta
from pathlib import Path

import _summary
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")  # see packages/rollout/tests/conftest.py
from rlhf_learner.strategy import free_port
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


def private_gloo(port: int, rank: int, world: int, devices: int = 1) -> dist.ProcessGroupGloo:
    store = dist.TCPStore("127.0.0.1", port, None, rank == 0, timedelta(seconds=120), wait_for_workers=False)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timedelta(seconds=120)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1") for _ in range(devices)]
    opts._threads = devices
    return dist.ProcessGroupGloo(store, rank, world, opts)


RAW_CHUNK = 32 << 20  # the gloo transport's default bucket


def raw_broadcasts(pg: dist.ProcessGroupGloo, chunks: list[torch.Tensor]) -> None:
    """Broadcast ``chunks`` with two in flight, as the gloo transport does with its buckets."""
    works = []
    for chunk in chunks:
        works.append(pg.broadcast(chunk, 0))
        if len(works) == 2:
            works.pop(0).wait()
    for work in works:
        work.wait()


DELIVERY = " delivery"
OPENRLHF = "per-param openrlhf"
RAW = "gloo raw"
METHODS = ("shm", "shm delivery", "gloo", "gloo delivery", RAW, OPENRLHF, "per-param gloo")
TRANSPORT = {m: m.removesuffix(DELIVERY) for m in METHODS}
LABELS = {
    "shm": "shm -> model",
    "shm delivery": "shm, delivery only",
    "gloo": "gloo -> model",
    "gloo delivery": "gloo, delivery only",
    RAW: "gloo, raw bytes only",
    OPENRLHF: "per-param, OpenRLHF's",
    "per-param gloo": "per-param, bcast only",
}


class OpenRLHFStyleEngine:
    """An engine actor receiving weights the way OpenRLHF's vLLM workers do: one call per parameter."""

    def __init__(self, threads: int) -> None:
        torch.set_num_threads(threads)
        self.model = make_model("zeros")

    def join(self, port: int, rank: int, world: int) -> None:
        self.pg = private_gloo(port, rank, world)

    def update_weight(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        weight = torch.empty(shape, dtype=dtype)
        self.pg.broadcast(weight, 0).wait()
        self.model[name].copy_(weight)  # vLLM's load_weights([(name, weight)])

    def cpu_seconds(self) -> float:
        return time.process_time()


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
    if method == RAW:
        pg = private_gloo(port, rank, world, devices=2)
        nbytes = sum(t.numel() * t.element_size() for t in model.values())
        bufs = [torch.empty(RAW_CHUNK, dtype=torch.uint8) for _ in range(2)]
        sizes = [min(RAW_CHUNK, nbytes - a) for a in range(0, nbytes, RAW_CHUNK)]
        for _ in range(syncs):
            pg.barrier().wait()
            c0 = time.process_time()
            raw_broadcasts(pg, [bufs[i % 2][:n] for i, n in enumerate(sizes)])
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
        if method == OPENRLHF:
            import ray

            engine_cls = ray.remote(num_cpus=0)(OpenRLHFStyleEngine)
            self.engines = [engine_cls.remote(args.receiver_threads) for _ in range(args.receivers)]
            joins = [e.join.remote(port, r, world) for r, e in enumerate(self.engines, start=1)]
            self.pg = private_gloo(port, 0, world)
            ray.get(joins, timeout=300)
            self.engine_cpu: list[float] = []
            return
        ctx = mp.get_context("spawn")
        self.cpu_q = ctx.Queue()
        self.procs = [
            ctx.Process(
                target=receiver_main,
                args=(r, method, port, world, args.syncs + 1, args.receiver_threads, self.cpu_q),
            )
            for r in range(1, world)
        ]
        for p in self.procs:
            p.start()
        if method == "per-param gloo":
            self.pg = private_gloo(port, 0, world)
        elif method == RAW:
            self.pg = private_gloo(port, 0, world, devices=2)
            flat = torch.cat([t.view(-1).view(torch.uint8) for t in model.values()])
            self.chunks = list(flat.split(RAW_CHUNK))
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
        if self.method == OPENRLHF:
            return self._once_openrlhf()
        if self.method in ("per-param gloo", RAW):
            self.pg.barrier().wait()
        t0, c0 = time.perf_counter(), time.process_time()
        if self.method == "per-param gloo":
            for tensor in self.model.values():
                self.pg.broadcast(tensor, 0).wait()
            self.pg.barrier().wait()
        elif self.method == RAW:
            raw_broadcasts(self.pg, self.chunks)
            self.pg.barrier().wait()
        else:
            self.sender.send(self.model.items())
        return time.perf_counter() - t0, time.process_time() - c0

    def _once_openrlhf(self) -> tuple[float, float]:
        import ray

        c_engine = ray.get(self.engines[0].cpu_seconds.remote())
        t0, c0 = time.perf_counter(), time.process_time()
        for name, tensor in self.model.items():
            refs = [
                e.update_weight.remote(name, dtype=tensor.dtype, shape=tuple(tensor.shape))
                for e in self.engines
            ]
            self.pg.broadcast(tensor, 0).wait()
            ray.get(refs, timeout=120)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        self.engine_cpu.append(ray.get(self.engines[0].cpu_seconds.remote()) - c_engine)
        return wall, cpu

    def close(self) -> list[float]:
        """The receivers' CPU seconds per sync (first receiver)."""
        if self.method == OPENRLHF:
            import ray

            for e in self.engines:
                ray.kill(e)
            return self.engine_cpu
        if self.method not in ("per-param gloo", RAW):
            self.sender.close()
        cpu = [self.cpu_q.get(timeout=120) for _ in self.procs]
        for p in self.procs:
            p.join(timeout=120)
            if p.exitcode != 0:
                raise RuntimeError(f"{self.method}: receiver exited with {p.exitcode}")
        return cpu[0]


# ---- across two test hosts (--across-hosts) ----------------------------------------------------------


def _enter_host(namespace: str) -> None:
    """Move this (new, single-threaded) process into a test host's network namespace."""
    fd = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
    os.setns(fd, os.CLONE_NEWNET)
    os.close(fd)


def host_receiver(namespace: str, transport: str, master: str, port: int, syncs: int, folder: str) -> None:
    _enter_host(namespace)
    torch.set_num_threads(1)
    from safetensors.torch import load_file

    model = {n: torch.zeros_like(t) for n, t in load_file(f"{folder}/model.safetensors").items()}
    receiver = WeightReceiver(
        transport=transport, master_addr=master, master_port=port, rank=1, world_size=2, timeout_s=300
    )
    for _ in range(syncs):
        receiver.receive(copy_into(model))
    receiver.close()


def host_sender(namespace: str, transport: str, master: str, port: int, folder: str, go, done) -> None:
    """Sends the model once per ``go`` message; puts each sync's wall seconds on ``done``."""
    _enter_host(namespace)
    torch.set_num_threads(1)
    from safetensors.torch import load_file

    model = load_file(f"{folder}/model.safetensors")
    sender = WeightSender(
        transport=transport,
        master_addr=master,
        master_port=port,
        world_size=2,
        timeout_s=300,
        connect_timeout_s=300,
    )
    while go.get(timeout=600):
        t0 = time.perf_counter()
        sender.send(model.items())
        done.put(time.perf_counter() - t0)
    sender.close()


def across_hosts(args) -> None:
    """The 23M model (benchmarks/_grpo_work.py's ``small``) from host A to host B over gloo (the veth
    link between two network namespaces) against shm from host A to a receiver on host A, one sync of
    each per round, alternating."""
    import tempfile

    import _grpo_work
    from rlhf_testkit.hosts import two_hosts

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="ws_hosts") as tmp, two_hosts() as (a, b):
        folder = str(_grpo_work.build_model("small", Path(tmp)))
        from safetensors.torch import load_file

        nbytes = sum(t.numel() * t.element_size() for t in load_file(f"{folder}/model.safetensors").values())
        cases = {"shm, same host": ("shm", a, a), "gloo, across hosts": ("gloo", a, b)}
        running = {}
        for label, (transport, src, dst) in cases.items():
            port, go, done = free_port(), ctx.Queue(), ctx.Queue()
            procs = [
                ctx.Process(
                    target=host_sender, args=(src.namespace, transport, a.ip, port, folder, go, done)
                ),
                ctx.Process(
                    target=host_receiver, args=(dst.namespace, transport, a.ip, port, args.syncs + 1, folder)
                ),
            ]
            for proc in procs:
                proc.start()
            running[label] = (go, done, procs)
        times: dict[str, list[float]] = {label: [] for label in cases}
        for _ in range(args.syncs + 1):  # the first round warms up
            for label, (go, done, _procs) in running.items():
                go.put(True)
                times[label].append(done.get(timeout=600))
        for go, _done, procs in running.values():
            go.put(False)
            for proc in procs:
                proc.join(timeout=120)
                if proc.exitcode != 0:
                    raise RuntimeError(f"a weight-sync process exited with {proc.exitcode}")
    print(f"\nAcross two test hosts: the 23M model ({nbytes / 1e6:.0f} MB), median of {args.syncs} syncs")
    print(f"{'transport':<20} {'median s':>8} {'GB/s':>6}")
    med = {label: statistics.median(ts[1:]) for label, ts in times.items()}
    for label, sec in med.items():
        print(f"{label:<20} {sec:>8.4f} {nbytes / sec / 1e9:>6.2f}")
    ratio = med["shm, same host"] / med["gloo, across hosts"]
    print(f"gloo across hosts runs at {ratio:.2f}x the speed of shm on one host")
    _summary.ratio_row(args.summary, "weightsync gloo across hosts vs shm on one host (23M)", ratio, None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--syncs", type=int, default=7)
    parser.add_argument("--bucket-mb", type=int, default=None, help="default: the transport's default")
    parser.add_argument("--receivers", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of sender and receivers")
    parser.add_argument("--receiver-threads", type=int, default=None, help="default: --threads")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {METHODS}")
    parser.add_argument(
        "--across-hosts",
        action="store_true",
        help="instead: the 23M model over gloo between two test hosts vs shm on one (root, iproute2)",
    )
    _summary.add_argument(parser)
    args = parser.parse_args()
    if args.across_hosts:
        across_hosts(args)
        return
    if args.receiver_threads is None:
        args.receiver_threads = args.threads
    chosen = args.methods.split(",")
    unknown = set(chosen) - set(METHODS)
    if unknown:
        parser.error(f"--methods: unknown {sorted(unknown)}; expected a subset of {METHODS}")
    model = make_model("random")
    nbytes = sum(t.numel() * t.element_size() for t in model.values())
    print(
        f"torch {torch.__version__}; model: {len(model)} fp32 tensors, "
        f"{sum(t.numel() for t in model.values()) / 1e6:.1f}M params, {nbytes / 1e6:.0f} MB; "
        f"{args.receivers} receiver process(es); torch threads: {args.threads} sender, "
        f"{args.receiver_threads} per receiver; buckets: "
        f"{'transport default' if args.bucket_mb is None else f'{args.bucket_mb} MiB'}; "
        f"median of {args.syncs} rounds, methods interleaved within each round"
    )
    without_ray = [m for m in chosen if m != OPENRLHF]
    if without_ray:
        print("\nPhase 1: no Ray running")
        med = measure(model, without_ray, args)
        plain = med[f"memcpy ({args.threads} thr)"]
        if "shm" in med:
            check = f"weightsync shm -> model vs memcpy ({args.threads} thread)"
            _summary.ratio_row(args.summary, check, plain / med["shm"], 0.5)
    if OPENRLHF in chosen:
        import ray

        # Ray's own processes take CPU even when idle: OpenRLHF's protocol is timed in a phase of its
        # own, against the bucketed and the plain per-parameter sync under the same load.
        print("\nPhase 2: a local Ray instance running (OpenRLHF's protocol calls a Ray actor per parameter)")
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
        med = measure(model, [m for m in ("gloo", "per-param gloo", OPENRLHF) if m in chosen], args)
        ray.shutdown()
        if "gloo" in med:
            check = "weightsync gloo (buckets) vs OpenRLHF's per-parameter protocol"
            _summary.ratio_row(args.summary, check, med[OPENRLHF] / med["gloo"], 3.0)


def measure(model: dict[str, torch.Tensor], names: list[str], args) -> dict[str, float]:
    """Time the memcpy limits and every method in ``names``, interleaved per round; print a table and
    return the median seconds by row."""
    nbytes = sum(t.numel() * t.element_size() for t in model.values())
    default_threads = torch.get_num_threads()
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

    methods = {name: Method(name, model, args) for name in names}
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
    torch.set_num_threads(default_threads)
    recv_cpu = {name: method.close() for name, method in methods.items()}
    med = {row: statistics.median(ts[1:]) for row, ts in times.items()}
    fast, plain = med[rows[0]], med[rows[1]]
    nan = float("nan")
    print(
        f"{'method':<22} {'median s':>8} {'GB/s':>6} {'vs memcpy':>9} {'vs memcpy':>9} "
        f"{'vs per-param':>12} {'vs per-param':>12} {'CPU s send / recv':>18}"
    )
    print(
        f"{'':<22} {'':>8} {'':>6} {rows[0][8:-1]:>9} {rows[1][8:-1]:>9} {'OpenRLHF':>12} {'bcast only':>12}"
    )
    for row in rows:
        sec = med[row]
        cpu = (
            f"{statistics.median(send_cpu[row][1:]):.3f} / {statistics.median(recv_cpu[row][1:]):.3f}"
            if row in methods
            else ""
        )
        print(
            f"{LABELS.get(row, row):<22} {sec:>8.4f} {nbytes / sec / 1e9:>6.2f} {fast / sec:>9.0%} "
            f"{plain / sec:>9.0%} {med.get(OPENRLHF, nan) / sec:>11.2f}x "
            f"{med.get('per-param gloo', nan) / sec:>11.2f}x {cpu:>18}"
        )
    print(
        f"checksum, one pass over the model on {args.threads} thread(s): {nbytes / med['checksum'] / 1e9:.1f} GB/s"
    )
    return med


if __name__ == "__main__":
    main()
