"""GPU transports between real processes: ``cuda_ipc`` (receiver on the sender's GPU) and ``nccl``
(one GPU per rank). Marked ``gpu``: skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from rlhf_weightsync import WeightSender, WeightSyncError

pytestmark = pytest.mark.gpu

BUCKET = 1 << 20


def model_on(device: str, seed: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    named = [(f"layer{i}.weight", torch.randn(256, 256, generator=gen)) for i in range(6)]
    named += [("big", torch.randn(600_000, generator=gen)), ("steps", torch.arange(10))]
    return [(n, t.to(device)) for n, t in named]


def check(peers, rank: int, sync: int, named, dtype) -> None:
    res = peers.result(rank, sync)
    assert "error" not in res, res.get("error")
    for name, tensor in named:
        want = tensor.to(dtype) if tensor.is_floating_point() else tensor
        got = res["tensors"][name]
        assert got.is_cuda and got.dtype == want.dtype
        assert torch.equal(got.cpu(), want.cpu()), name


def run(transport: str, receiver_device: str, peers, free_port) -> None:
    port = free_port()
    peers.spawn(
        transport=transport,
        port=port,
        rank=1,
        world=2,
        syncs=3,
        device=receiver_device,
        tamper={"sync": 2, "bucket": 1, "offset": 4096},
    )
    sender = WeightSender(
        transport=transport,
        master_addr="127.0.0.1",
        master_port=port,
        world_size=2,
        timeout_s=60,
        bucket_bytes=BUCKET,
        device="cuda:0",
    )
    first, second = model_on("cuda:0", 0), model_on("cuda:0", 1)
    assert sender.send(first).version == 1
    assert sender.send(second, dtype=torch.bfloat16).num_buckets > 3  # "big" spans buckets
    with pytest.raises(WeightSyncError, match="ChecksumError"):
        sender.send(first)  # a flipped byte is caught by the GPU-side checksum
    sender.close()
    assert peers.join() == [0]
    check(peers, 1, 0, first, torch.float32)
    check(peers, 1, 1, second, torch.bfloat16)


def test_cuda_ipc_to_a_colocated_receiver(peers, free_port):
    run("cuda_ipc", "cuda:0", peers, free_port)


def test_nccl_broadcast_to_another_gpu(peers, free_port):
    if torch.cuda.device_count() < 2:
        pytest.skip("nccl needs one GPU per rank; this machine has one")
    run("nccl", "cuda:1", peers, free_port)
