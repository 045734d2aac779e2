"""A receiver process for the multi-process tests: ``python _peer.py '<json config>'``.

Config keys: transport, port, rank, world, timeout, out (folder), syncs (number of receives), and
optionally ``tamper`` ({"sync": k, "bucket": i, "offset": byte}) to flip one byte of a bucket as it
arrives, ``die`` ({"sync": k}) to exit abruptly after the first tensor of sync k, ``threads``,
``device`` (for the GPU transports).
For each sync it writes ``rank{r}_sync{k}.pt`` with the stats, clones of every received tensor and
torch's thread count during the load and after the sync, or the error it raised.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import torch
from rlhf_weightsync import WeightReceiver


def main(cfg: dict) -> None:
    torch.set_num_threads(cfg.get("threads", 1))
    receiver = WeightReceiver(
        transport=cfg["transport"],
        master_addr="127.0.0.1",
        master_port=cfg["port"],
        rank=cfg["rank"],
        world_size=cfg["world"],
        timeout_s=cfg["timeout"],
        device=cfg.get("device"),
    )
    tamper, die = cfg.get("tamper"), cfg.get("die")
    for k in range(cfg["syncs"]):
        if tamper and tamper["sync"] == k:

            def flip(index: int, buf: torch.Tensor, _t=tamper) -> None:
                if index == _t["bucket"]:
                    buf[_t["offset"]] ^= 0x10

            receiver.transport.tamper = flip
        else:
            receiver.transport.tamper = None
        got: dict[str, torch.Tensor] = {}

        threads: list[int] = []

        def load(named, k=k, got=got, threads=threads):
            threads.append(torch.get_num_threads())
            for name, tensor in named:
                got[name] = tensor.clone()
                if die and die["sync"] == k:
                    os._exit(3)

        path = os.path.join(cfg["out"], f"rank{cfg['rank']}_sync{k}.pt")
        try:
            stats = receiver.receive(load)
        except Exception as exc:
            torch.save({"error": f"{type(exc).__name__}: {exc}"}, path)
            continue
        threads.append(torch.get_num_threads())  # [during the load, after the sync]
        torch.save({"stats": dataclasses.asdict(stats), "tensors": got, "threads": threads}, path)
    receiver.close()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
