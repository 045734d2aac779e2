"""One rank of a 2-rank DeepSpeed ZeRO-3 learner (gloo, CPU): ``python _ds_learner.py '<json config>'``.

Both ranks take one training step, then rank 0 sends the weights (bf16) to the sync group with
``gather=GatheredParameters`` while rank 1 joins the same gathers through ``gather_along``. Rank 0
writes the fully gathered fp32 weights to ``out/full.pt`` for the test to compare against.
"""

from __future__ import annotations

import json
import os
import sys

cfg = json.loads(sys.argv[1])
os.environ.update(
    MASTER_ADDR="127.0.0.1",
    MASTER_PORT=str(cfg["ds_port"]),
    RANK=str(cfg["rank"]),
    LOCAL_RANK=str(cfg["rank"]),
    WORLD_SIZE="2",
)

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch._dynamo  # noqa: E402  (deepspeed.zero needs it imported first)

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
from rlhf_weightsync import WeightSender, gather_along  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.ReLU(), torch.nn.Linear(300, 64))
    ds_cfg = {
        "train_batch_size": 2,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
    }
    engine, *_ = deepspeed.initialize(model=model, config=ds_cfg, model_parameters=model.parameters())
    torch.manual_seed(1 + cfg["rank"])
    engine.backward(engine(torch.randn(4, 64)).square().mean())
    engine.step()
    params = list(engine.module.named_parameters())
    assert all(p.numel() == 0 for _, p in params), "expected ZeRO-3 partitions outside a gather"
    with deepspeed.zero.GatheredParameters([p for _, p in params]):
        full = {n: p.detach().clone() for n, p in params}

    def gather(ps):
        return deepspeed.zero.GatheredParameters(ps)

    if cfg["rank"] == 0:
        torch.save(full, os.path.join(cfg["out"], "full.pt"))
        sender = WeightSender(
            transport="gloo",
            master_addr="127.0.0.1",
            master_port=cfg["sync_port"],
            world_size=2,
            timeout_s=120,
            bucket_bytes=cfg["bucket_bytes"],
        )
        stats = sender.send(params, dtype=torch.bfloat16, gather=gather)
        sender.close()
        print(f"sent {stats.num_buckets} buckets", flush=True)
    else:
        n = gather_along(params, gather=gather, bucket_bytes=cfg["bucket_bytes"], dtype=torch.bfloat16)
        print(f"gathered along {n} buckets", flush=True)
    # Tear the learner's gloo group down together: a rank that exits while the other still holds
    # live connections can abort in gloo's destructors ("terminate called without an active exception").
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
