"""``--train.elastic``: which groups a restart shrinks to the nodes left, and where it is refused. (A run
that loses a host and goes on: ``test_two_hosts.py``.)"""

from __future__ import annotations

import pytest
from rlhf_cli.config import ConfigError, PPOConfig, SFTConfig, build_config
from rlhf_cli.runtime.runs.elastic import check_elastic, shrink_to


def test_groups_over_more_nodes_than_are_left_span_the_nodes_left():
    shape = ["--actor.num_nodes", "3", "--actor.num_devices_per_node", "2", "--ref.num_nodes", "2"]
    cfg = build_config(PPOConfig, [*shape, "--rollout.batch_size", "12", "--train.micro_batch_size", "2"])
    smaller, changes = shrink_to(cfg, 2)
    assert (smaller.actor.num_nodes, smaller.actor.world_size, smaller.ref.num_nodes) == (2, 4, 2)
    assert changes == ["--actor.num_nodes 3 -> 2 (6 -> 4 ranks, data-parallel 6 -> 4)"]
    assert cfg.actor.num_nodes == 3  # the original is left as it was
    assert smaller.optimizer_batch_size == cfg.optimizer_batch_size  # the batch is kept
    one, changes = shrink_to(cfg, 1)
    assert (one.actor.world_size, one.ref.world_size) == (2, 1) and len(changes) == 2
    assert shrink_to(cfg, 3) == (cfg, [])
    odd = build_config(PPOConfig, ["--actor.num_nodes", "3", "--rollout.batch_size", "6"])
    with pytest.raises(ConfigError, match=r"^--train\.elastic: the run does not fit 2 node\(s\): "):
        shrink_to(odd, 2)  # 48 samples a step: 16 a rank on 3 ranks; on 2, 24 do not split into 16s


def test_elastic_needs_a_backend_that_loads_checkpoints_on_fewer_ranks():
    with pytest.raises(
        ConfigError, match=r"--train\.elastic: --learner\.backend deepspeed cannot load a checkpoint"
    ):
        check_elastic(build_config(SFTConfig, ["--train.elastic"]))
    check_elastic(build_config(SFTConfig, ["--train.elastic", "--learner.backend", "fsdp2"]))
    check_elastic(build_config(SFTConfig, []))  # not elastic: nothing to check
