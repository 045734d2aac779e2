"""One sender (this process) and one or two receiver processes, over gloo and shm: after every sync each
receiver holds exactly the sender's tensors (in the wire dtype), for tied weights, a bf16 cast, many
small mixed-dtype tensors, and tensors larger than a bucket; versions bump."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from rlhf_weightsync import WeightSender

BUCKET = 64 << 10
NUM_SYNCS = 4
DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int32,
    torch.int8,
    torch.bool,
    torch.uint8,
]
SHAPES = [(), (0,), (3,), (2, 5), (7, 1, 3), (33,)]


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(96, 24)
        self.body = torch.nn.Linear(24, 24)
        self.head = torch.nn.Linear(24, 96, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("steps", torch.arange(5))


def random_tensor(shape, dtype, gen) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(-100 if dtype.is_signed else 0, 100, shape, generator=gen).to(dtype)


def scenarios() -> Iterator[tuple[dict, list[tuple[str, torch.Tensor]], dict]]:
    """(send kwargs, named tensors to send, expected received tensors) per sync; each is sent before
    the next is built (the model is updated in place between syncs)."""
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = Tied()
    # 1. tied weights: head.weight is embed.weight
    sd = model.state_dict()
    yield {}, list(sd.items()), {n: t.clone() for n, t in sd.items()}
    # 2. fp32 master -> bf16 engine, after an update; the int64 buffer keeps its dtype
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen))
    sd = model.state_dict()
    expected = {n: t.to(torch.bfloat16) if t.is_floating_point() else t.clone() for n, t in sd.items()}
    yield {"dtype": torch.bfloat16}, list(sd.items()), expected
    # 3. many small tensors of mixed dtypes, including 0-d and empty ones
    small = [
        (f"small.{i}", random_tensor(SHAPES[i % len(SHAPES)], DTYPES[i % len(DTYPES)], gen))
        for i in range(400)
    ]
    yield {}, small, {n: t.clone() for n, t in small}
    # 4. tensors larger than a bucket (one non-contiguous), between small ones; explicit version
    big = [
        ("a", torch.randn(10, generator=gen)),
        ("big", torch.randn(50_000, generator=gen)),
        ("b", torch.randint(0, 9, (4,), generator=gen)),
        ("big_t", torch.randn(300, 200, generator=gen).t()),
        ("big_half", torch.randn(70_001, generator=gen).half()),
    ]
    yield {"version": 10}, big, {n: t.clone() for n, t in big}


@pytest.mark.parametrize("receivers", [1, 2])
@pytest.mark.parametrize("transport", ["gloo", "shm"])
def test_every_receiver_gets_the_senders_tensors(transport, receivers, peers, free_port):
    port, world = free_port(), receivers + 1
    for rank in range(1, world):
        peers.spawn(transport=transport, port=port, rank=rank, world=world, syncs=NUM_SYNCS)
    sender = WeightSender(
        transport=transport,
        master_addr="127.0.0.1",
        master_port=port,
        world_size=world,
        timeout_s=30,
        bucket_bytes=BUCKET,
    )
    sent, plan = [], []
    for kwargs, named, expected in scenarios():
        sent.append(sender.send(named, **kwargs))
        plan.append(expected)
    sender.close()
    assert peers.join() == [0] * receivers
    assert [s.version for s in sent] == [1, 2, 3, 10]
    assert (sent[0].num_tensors, sent[0].num_names) == (4, 5)  # head.weight shipped once
    assert sent[3].num_buckets >= 7  # the big tensors span several 64 KiB buckets
    for rank in range(1, world):
        for k, expected in enumerate(plan):
            res = peers.result(rank, k)
            assert "error" not in res, res.get("error")
            assert res["stats"]["version"] == sent[k].version
            got = res["tensors"]
            assert sorted(got) == sorted(expected), f"rank {rank} sync {k}: names differ"
            for name, want in expected.items():
                assert got[name].dtype == want.dtype, (rank, k, name)
                assert got[name].shape == want.shape, (rank, k, name)
                assert torch.equal(got[name], want), (rank, k, name)


@pytest.mark.parametrize("transport", ["gloo", "shm"])
def test_a_cpu_sync_runs_one_torch_thread_per_side_and_restores_them(transport, peers, free_port):
    """Sender and receiver copy at once: each side packs, checks and loads on one thread (two each would
    oversubscribe shared cores), and gets its thread count back afterwards."""
    port = free_port()
    peers.spawn(transport=transport, port=port, rank=1, world=2, syncs=1, threads=2)
    sender = WeightSender(
        transport=transport, master_addr="127.0.0.1", master_port=port, world_size=2, timeout_s=30
    )
    seen: list[int] = []

    @contextlib.contextmanager
    def gather(_params):  # called while each bucket is packed
        seen.append(torch.get_num_threads())
        yield

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        sender.send([("w", torch.randn(1000))], gather=gather)
        after = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
        sender.close()
    assert peers.join() == [0]
    assert seen and set(seen) == {1} and after == 2
    assert peers.result(1, 0)["threads"] == [1, 2]
