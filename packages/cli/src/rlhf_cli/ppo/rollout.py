"""The rollout stage of a PPO step: prompts -> the agent executor on the engines -> rewards -> dynamic
filtering with refill (DAPO) -> samples."""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from rlhf_algos import dynamic_filter
from rlhf_cli.data.batches import Sample
from rlhf_cli.data.prompts import PromptCursor, PromptSet
from rlhf_cli.ppo.rewards import RewardStage, extra_log_means
from rlhf_cli.ppo.settings import RolloutSettings
from rlhf_rollout import AgentExecutorBase, SamplingParams, Trajectory, oldest_version

__all__ = ["RolloutBatch", "RolloutStage"]


@dataclass(kw_only=True)
class RolloutBatch:
    """What the rollout stage hands the training stages."""

    step: int
    samples: list[Sample]
    weight_version: int
    """The engines' version when the batch was started (a sample's own is that of its oldest token)."""
    cursor: PromptCursor
    """Where the data order stood after this batch's prompts (what a checkpoint after it resumes from)."""
    generation_s: float
    reward_s: float
    filter_rounds: int | None = None
    """Generation rounds dynamic filtering took (None: filtering is off)."""
    refilled: int = 0
    """Groups of dropped samples used to fill the batch after the last round."""
    extra_logs: dict[str, float] = field(default_factory=dict)
    reference_s: float | None = None
    """Seconds of the reference forward when the producer ran it (asynchronous training), else None."""

    def uniform_groups(self) -> tuple[int, int]:
        """``(groups whose samples all got the same reward, groups of several samples)``: a group
        estimator learns nothing from the former."""
        rewards: dict[int, list[float]] = {}
        for x in self.samples:
            rewards.setdefault(x.prompt_index, []).append(x.reward)
        several = [r for r in rewards.values() if len(r) > 1]
        return sum(len(set(r)) == 1 for r in several), len(several)

    def metrics(self) -> dict[str, float]:
        s = self.samples
        out = {
            "rollout/score_mean": float(torch.tensor([x.score for x in s]).mean()),
            "rollout/reward_mean": float(torch.tensor([x.reward for x in s]).mean()),
            "rollout/response_length": float(torch.tensor([float(x.response_length) for x in s]).mean()),
            "rollout/truncated_frac": float(torch.tensor([float(x.truncated) for x in s]).mean()),
            "rollout/weight_version": float(self.weight_version),
            "time/generation": self.generation_s,
            "time/reward": self.reward_s,
        }
        uniform, groups = self.uniform_groups()
        if groups:
            out["rollout/uniform_reward_groups_frac"] = uniform / groups
        if self.reference_s is not None:
            out["time/reference"] = self.reference_s
        if self.filter_rounds is not None:
            out |= {
                "filter/rounds": float(self.filter_rounds),
                "filter/refilled_with_dropped_groups": float(self.refilled),
            }
        return out | self.extra_logs


class RolloutStage:
    """Runs the executor on the engines, then the rewards stage, then dynamic filtering with refill."""

    def __init__(
        self,
        settings: RolloutSettings,
        *,
        make_executor: Callable[[SamplingParams], AgentExecutorBase],
        prompts: PromptSet,
        rewards: RewardStage,
    ) -> None:
        self.settings, self.make_executor = settings, make_executor
        self.prompts, self.rewards = prompts, rewards
        self._warned_uniform = False  # said once a run

    def params(self, step: int, round_: int) -> SamplingParams:
        """The sampling of one engine call: its seed derived from the run's, the step and the round."""
        seed = self.settings.seed + 100_003 * step + 7_919 * round_
        return dataclasses.replace(self.settings.sampling, seed=seed)

    def produce(self, step: int, *, weight_version: int) -> RolloutBatch:
        df = self.settings
        n, want = df.sampling.n, df.batch_size
        kept: list[list[Trajectory]] = []
        dropped: list[list[Trajectory]] = []
        t_gen = t_reward = 0.0
        rounds = 0
        for rounds in range(1, df.filter_rounds + 1):
            prompts, labels = self.prompts.next_batch(want - len(kept))
            t0 = time.perf_counter()
            trajs = self.make_executor(self.params(step, rounds)).run(prompts, labels=labels)
            t1 = time.perf_counter()
            self.rewards.score(trajs)
            t_gen, t_reward = t_gen + t1 - t0, t_reward + time.perf_counter() - t1
            groups = [trajs[i * n : (i + 1) * n] for i in range(len(prompts))]
            keep = [True] * len(groups)
            if df.filtering:
                scores = torch.tensor([[t.score for t in g] for g in groups])
                keep = dynamic_filter(scores, low=df.filter_low, high=df.filter_high).tolist()
            kept += [g for g, k in zip(groups, keep, strict=True) if k]
            dropped += [g for g, k in zip(groups, keep, strict=True) if not k]
            if len(kept) >= want:
                break
        filled = max(0, want - len(kept))
        trajs = [t for g in (kept + dropped[:filled])[:want] for t in g]
        batch = RolloutBatch(
            step=step,
            samples=self._samples(trajs, weight_version),
            weight_version=weight_version,
            cursor=dataclasses.replace(self.prompts.cursor),
            generation_s=t_gen,
            reward_s=t_reward,
            filter_rounds=rounds if df.filtering else None,
            refilled=filled,
            extra_logs=extra_log_means(trajs),
        )
        self._warn_if_uniform(batch)
        return batch

    def _warn_if_uniform(self, batch: RolloutBatch) -> None:
        """Once a run: a step where no prompt's samples got different rewards (nothing to learn from)."""
        uniform, groups = batch.uniform_groups()
        if self.settings.group_estimator and groups and uniform == groups and not self._warned_uniform:
            self._warned_uniform = True
            print(
                f"warning: step {batch.step}: each prompt's samples all got the same reward (in every one of "
                f"{groups} prompts): group estimators learn nothing from such a step; check the reward "
                "(rollout/uniform_reward_groups_frac counts them each step)",
                file=sys.stderr,
            )

    def _samples(self, trajs: list[Trajectory], version: int) -> list[Sample]:
        """The batch's samples; the same images (a prompt's, for its ``n`` samples) are made pixels once."""
        n, pixels, encoder = self.settings.sampling.n, {}, self.prompts.encoder
        out = []
        for i, t in enumerate(trajs):
            sample = self._sample(t, i // n, version)
            if t.images and encoder is not None:
                key = tuple(id(image) for image in t.images)  # an episode's own images differ
                if key not in pixels:
                    pixels[key] = encoder.pixels(t.images)
                sample.images = encoder.inputs(t.images, sample.token_ids, sample.action_mask, pixels[key])
            out.append(sample)
        return out

    def _sample(self, t: Trajectory, group: int, version: int) -> Sample:
        oldest = oldest_version(t.weight_versions)  # None: the engine labels no versions
        return Sample(
            token_ids=torch.tensor(t.token_ids, dtype=torch.long),
            action_mask=torch.tensor(t.action_mask, dtype=torch.bool),
            rollout_logp=torch.tensor(t.logprobs, dtype=torch.float32),
            score=float(t.score),
            reward=self.rewards.reward(t),
            truncated=bool(t.truncated),
            prompt_index=group,
            weight_version=version if oldest is None else oldest,
            mixed_versions=len({span.version for span in t.weight_versions}) > 1,
        )
