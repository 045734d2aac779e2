"""The rewards stage of a PPO step: a reward-model group scores the trajectories (when there is one;
otherwise the executor's reward function, remote endpoints or environment already did), the length
penalties shape each reward, and the sources' ``extra_logs`` are averaged for logging."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from rlhf_algos import overlong_penalty, stop_penalty
from rlhf_cli.ppo.settings import RewardSettings
from rlhf_cli.runtime.learners.protocols import ScoringGroup
from rlhf_rollout import Trajectory

__all__ = ["RewardStage", "extra_log_means"]


class RewardStage:
    def __init__(self, settings: RewardSettings, *, reward_model: ScoringGroup | None) -> None:
        self.settings, self.reward_model = settings, reward_model

    def score(self, trajs: Sequence[Trajectory]) -> None:
        """With a reward-model group: its score becomes each trajectory's score and reward."""
        if self.reward_model is None:
            return
        scores = self.reward_model.forward(
            [torch.tensor(t.token_ids) for t in trajs],
            micro_batch_size=self.settings.micro_batch_size,
            packing=False,
        )
        for t, s in zip(trajs, scores, strict=True):
            t.reward = t.score = float(s)

    def reward(self, t: Trajectory) -> float:
        """The trajectory's reward, stop-penalised when truncated, plus the overlong penalty on the
        policy's own tokens of one turn, as ``max_new_tokens`` limits them: a multi-turn episode's
        longest turn (its ``max_turn_tokens`` log; environment tokens and other turns excluded)."""
        s = self.settings
        reward = float(t.reward)
        if s.stop_penalty is not None:
            truncated = torch.tensor([t.truncated])
            reward = float(stop_penalty(torch.tensor([reward]), truncated, coef=s.stop_penalty)[0])
        if s.overlong_buffer:
            generated = torch.tensor([t.extra_logs.get("max_turn_tokens", sum(t.action_mask))])
            reward += float(
                overlong_penalty(
                    generated,
                    max_length=s.max_new_tokens,
                    buffer_length=s.overlong_buffer,
                    penalty_factor=s.overlong_penalty_factor,
                )[0]
            )
        return reward


def extra_log_means(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """The mean of each ``extra_logs`` entry over the trajectories that report it (non-finite values
    skipped), as ``extra/<name>``."""
    sums: dict[str, list[float]] = {}
    for t in trajs:
        for k, v in t.extra_logs.items():
            if math.isfinite(float(v)):
                sums.setdefault(k, []).append(float(v))
    return {f"extra/{k}": sum(v) / len(v) for k, v in sorted(sums.items()) if v}
