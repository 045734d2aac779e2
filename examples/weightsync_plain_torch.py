"""rlhf-weightsync from a plain PyTorch loop (no Ray, no DeepSpeed): after every optimizer step the
trainer pushes its weights to an "engine" in a second process, which loads them into its own copy of
the model (in bf16, as inference engines keep them) and reports what it holds.

    uv run python examples/weightsync_plain_torch.py
"""

from __future__ import annotations

import multiprocessing as mp
import random
import socket

import torch
from rlhf_weightsync import WeightReceiver, WeightSender, copy_into

STEPS = 3


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 32))


def engine(port: int, results: mp.Queue) -> None:
    """The second process: an inference copy of the model that receives every update."""
    model = make_model().bfloat16().eval()
    receiver = WeightReceiver(
        transport="gloo", master_addr="127.0.0.1", master_port=port, rank=1, world_size=2
    )
    try:
        for _ in range(STEPS):
            stats = receiver.receive(copy_into(model))
            results.put((stats.version, {k: v.float().clone() for k, v in model.state_dict().items()}))
    finally:
        receiver.close()


def free_port() -> int:
    """A free port below Linux's ephemeral range (32768-60999): a receiver that retries its connect to a
    port inside that range can be handed it as its own source port, and then the sender cannot bind it."""
    for port in random.sample(range(20000, 32000), 64):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32000")


def main() -> list[int]:
    port = free_port()
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    proc = ctx.Process(target=engine, args=(port, results), daemon=True)
    proc.start()
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sender = WeightSender(
        transport="gloo", master_addr="127.0.0.1", master_port=port, world_size=2, timeout_s=120
    )
    versions = []
    try:
        for step in range(STEPS):
            x = torch.randn(64, 32)
            loss = (model(x) - x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            stats = sender.send(model.named_parameters(), dtype=torch.bfloat16)  # returns once loaded
            version, held = results.get(timeout=120)
            for name, p in model.named_parameters():  # the engine holds this step's weights (bf16)
                torch.testing.assert_close(held[name], p.detach().bfloat16().float())
            versions.append(version)
            print(
                f"step {step}: loss {loss.item():.4f}; engine holds version {version} ({stats.num_bytes} bytes)"
            )
    finally:
        sender.close()
        proc.join(timeout=60)
    assert versions == sorted(versions) and len(set(versions)) == STEPS
    return versions


if __name__ == "__main__":
    main()
