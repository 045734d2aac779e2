"""Evaluation of the policy on the evaluation prompts (greedy or sampled), and the built-in demo's warm-up."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from rlhf_cli.data.batches import Sample, sft_batch
from rlhf_cli.data.images import ImageEncoder
from rlhf_cli.data.prompts import PromptRecord, PromptSet, encode_prompt
from rlhf_cli.demo import task
from rlhf_cli.ppo.settings import EvalSettings, WarmupSettings
from rlhf_cli.ppo.updates import micro_batches
from rlhf_cli.runtime.learners.protocols import ScoringGroup
from rlhf_rollout import AgentExecutorBase, SamplingParams

__all__ = ["evaluate", "pass_metrics", "warmup"]


def evaluate(
    settings: EvalSettings,
    make_executor: Callable[[SamplingParams], AgentExecutorBase],
    prompts: PromptSet,
    reward_model: ScoringGroup | None,
) -> dict[str, float]:
    """``--eval.n_samples`` answers to every evaluation prompt, greedy or sampled at ``--eval.temperature``
    (seeded with ``--train.seed``: every evaluation draws the same noise): mean reward, pass rate (the
    answers scoring >= ``--eval.pass_threshold``) and, with several answers, pass@n (the prompts with a
    passing answer)."""
    trajs = make_executor(settings.sampling).run(prompts.token_ids, labels=prompts.labels)
    scores = [t.score for t in trajs]
    if reward_model is not None:
        scores = [
            float(s)
            for s in reward_model.forward(
                [torch.tensor(t.token_ids) for t in trajs],
                micro_batch_size=settings.micro_batch_size,
                packing=False,
            )
        ]
    prompts_of = [t.prompt_index for t in trajs]  # an agent's episode may give several trajectories
    return {"eval/reward_mean": sum(scores) / len(scores)} | pass_metrics(
        scores, prompts_of, several=settings.sampling.n > 1, threshold=settings.pass_threshold
    )


def pass_metrics(
    scores: Sequence[float], prompts: Sequence[int], *, several: bool, threshold: float
) -> dict[str, float]:
    """From the answers' ``scores`` and the prompt each answers (``prompts``), an answer passing when its
    score is at least ``threshold``: ``eval/pass_rate``, the passing answers' fraction (mean@n), and with
    ``several`` answers per prompt ``eval/pass_at_n``, the fraction of prompts with a passing answer."""
    passed = [s >= threshold for s in scores]
    out = {"eval/pass_rate": sum(passed) / len(passed)}
    if several:
        by_prompt: dict[int, bool] = {}
        for p, ok in zip(prompts, passed, strict=True):
            by_prompt[p] = by_prompt.get(p, False) or ok
        out["eval/pass_at_n"] = sum(by_prompt.values()) / len(by_prompt)
    return out


def warmup(settings: WarmupSettings, actor: Any, tokenizer: Any, encoder: ImageEncoder | None = None) -> None:
    """Built-in demo: a few supervised steps on the answer format before reinforcement learning (the image
    task's prompts through ``encoder``, the model's processor)."""
    pairs = task.builtin_task(settings.demo_model).warmup_records(seed=settings.seed)
    eos = tokenizer.eos_token_id
    samples = []
    for prompt, response in pairs:
        pictured = isinstance(prompt, PromptRecord) and prompt.images and encoder is not None
        if pictured:
            p = list(encoder.prompt(prompt.prompt, prompt.images))
        else:
            text = prompt.prompt if isinstance(prompt, PromptRecord) else prompt
            p = encode_prompt(text, tokenizer, apply_chat_template=settings.apply_chat_template)
        r = tokenizer(response, add_special_tokens=False)["input_ids"] + [eos]
        ids = torch.tensor(p + r)
        mask = torch.tensor([False] * len(p) + [True] * len(r))
        images = encoder.inputs(prompt.images, ids, mask) if pictured else None
        samples.append(
            Sample(
                token_ids=ids,
                action_mask=mask,
                rollout_logp=torch.zeros(len(ids)),
                score=0.0,
                reward=0.0,
                truncated=False,
                prompt_index=0,
                weight_version=0,
                images=images,
            )
        )
    per_step, b = settings.batch_size, settings.batching  # one optimizer step of the actor each
    g = torch.Generator().manual_seed(settings.seed)
    for _ in range(settings.steps):
        idx = torch.randint(len(samples), (per_step,), generator=g).tolist()
        batches = micro_batches(
            [samples[i] for i in idx],
            actor,
            micro_batch_size=b.micro_batch_size,
            dynamic=False,
            build=lambda part: sft_batch(part, packing=b.packing),
        )
        actor.train_sft(batches)
