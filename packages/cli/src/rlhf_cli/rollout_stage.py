"""Stage 1 of a PPO step: prompts -> samples with rewards, filtered and refilled (DAPO), penalised."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from rlhf_algos import dynamic_filter, overlong_penalty, stop_penalty
from rlhf_rollout import AgentExecutorBase, SamplingParams, Trajectory

from rlhf_cli.batches import Sample
from rlhf_cli.config import PPOConfig
from rlhf_cli.data import PromptSet
from rlhf_cli.groups import LearnerGroup

__all__ = ["RolloutBatch", "RolloutStage"]


@dataclass(kw_only=True)
class RolloutBatch:
    """What the generation stage hands the training stage (through the queue)."""

    step: int
    samples: list[Sample]
    metrics: dict[str, float] = field(default_factory=dict)


class RolloutStage:
    """Runs the executor on the engines, scores with the reward model group when there is one, applies
    dynamic filtering with refill and the length penalties."""

    def __init__(
        self,
        cfg: PPOConfig,
        *,
        make_executor: Callable[[SamplingParams], AgentExecutorBase],
        prompts: PromptSet,
        reward_model: LearnerGroup | None,
    ) -> None:
        self.cfg, self.make_executor, self.prompts, self.reward_model = (
            cfg,
            make_executor,
            prompts,
            reward_model,
        )

    def params(self, step: int, round_: int) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(
            temperature=r.temperature,
            top_p=r.top_p,
            max_new_tokens=r.max_new_tokens,
            n=r.n_samples_per_prompt,
            seed=self.cfg.train.seed + 100_003 * step + 7_919 * round_,
        )

    def _generate(
        self, prompts: list[list[int]], labels: list[Any], params: SamplingParams
    ) -> list[Trajectory]:
        return self.make_executor(params).run(prompts, labels=labels)

    def produce(self, step: int, *, weight_version: int) -> RolloutBatch:
        cfg, n = self.cfg, self.cfg.rollout.n_samples_per_prompt
        want = cfg.rollout.batch_size
        df = cfg.algo.dynamic_filtering
        kept: list[list[Trajectory]] = []
        dropped: list[list[Trajectory]] = []
        t_gen = t_reward = 0.0
        rounds = 0
        for rounds in range(1, (df.max_rounds if df.enable else 1) + 1):
            prompts, labels = self.prompts.next_batch(want - len(kept))
            t0 = time.perf_counter()
            trajs = self._generate(prompts, labels, self.params(step, rounds))
            t_gen += time.perf_counter() - t0
            t0 = time.perf_counter()
            if self.reward_model is not None:
                scores = self.reward_model.forward(
                    [torch.tensor(t.token_ids) for t in trajs],
                    micro_batch_size=cfg.train.micro_batch_size,
                    packing=False,
                )
                for t, s in zip(trajs, scores, strict=True):
                    t.reward = t.score = float(s)
            t_reward += time.perf_counter() - t0
            groups = [trajs[i * n : (i + 1) * n] for i in range(len(prompts))]
            if df.enable:
                scores = torch.tensor([[t.score for t in g] for g in groups])
                keep = dynamic_filter(scores, low=df.low, high=df.high).tolist()
                kept += [g for g, k in zip(groups, keep, strict=True) if k]
                dropped += [g for g, k in zip(groups, keep, strict=True) if not k]
            else:
                kept += groups
            if len(kept) >= want:
                break
        filled = max(0, want - len(kept))
        kept = (kept + dropped[:filled])[:want]
        trajs = [t for g in kept for t in g]
        samples = [self._sample(t, i // n, weight_version) for i, t in enumerate(trajs)]
        scores = torch.tensor([s.score for s in samples])
        lengths = torch.tensor([float(s.response_length) for s in samples])
        metrics = {
            "rollout/score_mean": float(scores.mean()),
            "rollout/reward_mean": float(torch.tensor([s.reward for s in samples]).mean()),
            "rollout/response_length": float(lengths.mean()),
            "rollout/truncated_frac": float(torch.tensor([float(s.truncated) for s in samples]).mean()),
            "rollout/weight_version": float(weight_version),
            "time/generation": t_gen,
            "time/reward": t_reward,
        }
        if df.enable:
            metrics |= {"filter/rounds": float(rounds), "filter/refilled_with_dropped_groups": float(filled)}
        return RolloutBatch(step=step, samples=samples, metrics=metrics)

    def _sample(self, t: Trajectory, group: int, version: int) -> Sample:
        """The trajectory as a sample; its reward is the score, stop-penalised when truncated, plus the
        overlong penalty on the policy's own tokens (environment tokens of a multi-turn episode excluded)."""
        cfg = self.cfg
        reward = float(t.reward)
        if cfg.algo.stop_penalty is not None:
            truncated = torch.tensor([t.truncated])
            reward = float(stop_penalty(torch.tensor([reward]), truncated, coef=cfg.algo.stop_penalty)[0])
        if cfg.algo.overlong.buffer_length:
            generated = torch.tensor([sum(t.action_mask)])
            reward += float(
                overlong_penalty(
                    generated,
                    max_length=cfg.rollout.max_new_tokens,
                    buffer_length=cfg.algo.overlong.buffer_length,
                    penalty_factor=cfg.algo.overlong.penalty_factor,
                )[0]
            )
        return Sample(
            token_ids=torch.tensor(t.token_ids, dtype=torch.long),
            action_mask=torch.tensor(t.action_mask, dtype=torch.bool),
            rollout_logp=torch.tensor(t.logprobs, dtype=torch.float32),
            score=float(t.score),
            reward=float(reward),
            truncated=bool(t.truncated),
            prompt_index=group,
            weight_version=version,
        )
