"""Reference log-probs bound late (``--train.overlap_reference``): the update stage sends each actor rank
its micro-batches without reference log-probs, with where each sample's go in their rows; a rank rebuilds
them from the reference's results in Ray's object store. They must be exactly the tensors the batches
carry when the reference is scored first. (A whole run with and without: test_ppo_runs.py.)"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from rlhf_cli.config import PPOConfig, build_config
from rlhf_cli.data.batches import Sample
from rlhf_cli.ppo.settings import UpdateSettings
from rlhf_cli.ppo.updates import update
from rlhf_cli.runtime.learners.late_reference import PendingScores, ref_logp_of
from rlhf_learner import StepResult


class RecordingActor:
    """A two-rank actor group in-process: contiguous shards, ``train_policy`` records its calls."""

    def __init__(self, world_size: int = 2) -> None:
        self.world_size = world_size
        self.calls: list[tuple] = []

    def shards(self, items):
        n, k = len(items), self.world_size
        return [list(items[n * r // k : n * (r + 1) // k]) for r in range(k)]

    def train_policy(self, per_rank, *, settings, reference=None):
        self.calls.append((per_rank, reference))
        return StepResult(loss=0.0, grad_norm=None, metrics={"kl": 0.5})


def samples(n: int, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p, r = rng.randint(2, 4), rng.randint(2, 7)
        ids = torch.tensor([rng.randint(3, 60) for _ in range(p + r)])
        mask = torch.tensor([False] * p + [True] * r)
        out.append(
            Sample(
                token_ids=ids,
                action_mask=mask,
                rollout_logp=torch.where(mask, torch.full((p + r,), -1.5), torch.zeros(())),
                score=0.0,
                reward=float(i % 3),
                truncated=False,
                prompt_index=i // 4,
                weight_version=1,
            )
        )
    for s in out:
        s.advantages, s.returns = torch.randn(s.length), torch.zeros(s.length)
    return out


@pytest.mark.parametrize("packing", [True, False])
def test_each_rank_rebuilds_the_reference_log_probs_the_batches_carry_otherwise(ray_cluster, packing):
    cfg = build_config(
        PPOConfig,
        [
            *("--rollout.batch_size", "3", "--rollout.n_samples_per_prompt", "4"),
            *("--train.batch_size", "6", "--train.ppo_epochs", "2"),  # shuffled mini-batches, 4 updates
            *("--train.micro_batch_size", "1", "--train.packing", str(packing).lower()),
            *("--algo.kl.coef", "0.1", "--algo.kl.use_loss", "true", "--train.warmup_sft_steps", "0"),
        ],
    )
    # (A run overlaps the reference only with one optimizer step per rollout batch, where the experience
    # stage needs no KL; the update stage binds it late over any number of them, as here.)
    assert not cfg.reference_overlaps_update
    assert cfg.model_copy(
        update={"train": cfg.train.model_copy(update={"ppo_epochs": 1, "batch_size": None})}
    ).reference_overlaps_update
    batch = samples(12)
    scores = [torch.randn(s.length) for s in batch]
    # The reference's results as five ranks leave them: contiguous shards of 2-3, padded to 3 (NaNs here).
    bounds = [12 * d // 5 for d in range(6)]
    shards = [scores[lo:hi] for lo, hi in itertools.pairwise(bounds)]
    parts = [ray_cluster.put(s + [torch.full((9,), float("nan"))] * (3 - len(s))) for s in shards]
    pending = PendingScores(parts=parts, lengths=[len(s) for s in shards], all_refs=parts, timeout_s=30.0)

    late, scored = RecordingActor(), RecordingActor()
    update(UpdateSettings.of(cfg), batch, actor=late, critic=None, kl_coef=0.1, step=3, reference=pending)
    for s, lp in zip(batch, scores, strict=True):
        s.ref_logp = lp
    update(UpdateSettings.of(cfg), batch, actor=scored, critic=None, kl_coef=0.1, step=3)

    assert len(late.calls) == len(scored.calls) == 4
    fetched = [{}, {}]  # what each rank keeps across the rollout batch's optimizer steps
    for (per_rank, reference), (want_per_rank, none) in zip(late.calls, scored.calls, strict=True):
        assert none is None and reference[0] is pending
        for rank, (mbs, rank_late, want) in enumerate(
            zip(per_rank, reference[1], want_per_rank, strict=True)
        ):
            assert len(mbs) == 3 and all(mb.ref_logp is None for mb in mbs)
            of = ref_logp_of(rank_late, [mb.input_ids.shape for mb in mbs], fetched[rank])
            for i, (mb, w) in enumerate(zip(mbs, want, strict=True)):
                assert torch.equal(mb.input_ids, w.input_ids)
                assert torch.equal(of(i), w.ref_logp)


def test_a_reference_forward_of_other_samples_is_refused(ray_cluster):
    cfg = build_config(
        PPOConfig, ["--algo.kl.coef", "0.1", "--algo.kl.use_loss", "true", "--train.warmup_sft_steps", "0"]
    )
    parts = [ray_cluster.put([torch.zeros(3)] * 3)]
    pending = PendingScores(parts=parts, lengths=[3], all_refs=parts, timeout_s=30.0)
    with pytest.raises(ValueError, match="scored 3 sequences, the update has 4"):
        update(
            UpdateSettings.of(cfg),
            samples(4),
            actor=RecordingActor(),
            critic=None,
            kl_coef=0.1,
            reference=pending,
        )
