"""MultiTurnExecutor: token-by-token masks, logprobs over the exact context, done / truncation paths,
per-turn sampling changes, and the number-guessing example environment."""

from __future__ import annotations

import asyncio
import itertools
from typing import ClassVar

import pytest
import torch
from rlhf_rollout import MultiTurnExecutor, SamplingParams, StepResult
from rlhf_rollout.envs import NumberGuessEnv
from rollout_testutil import PROMPTS, reference_logprobs

TEMPERATURE = 0.9


class ScriptedEnv:
    """Answers "Turn k: try again." with reward k / 10, done after ``done_after`` steps."""

    instances: ClassVar[list[ScriptedEnv]] = []

    def __init__(self, *, done_after: int, short_second_turn: bool = False) -> None:
        self.done_after = done_after
        self.short_second_turn = short_second_turn
        self.actions: list[str] = []
        self.feedback: list[str] = []
        self.label = None
        ScriptedEnv.instances.append(self)

    async def reset(self, *, prompt: str, label) -> None:
        self.label = label

    async def step(self, *, action: str) -> StepResult:
        await asyncio.sleep(0)
        self.actions.append(action)
        k = len(self.actions)
        self.feedback.append(f"Turn {k}: try again.")
        params = (
            SamplingParams(temperature=TEMPERATURE, max_new_tokens=3)
            if self.short_second_turn and k == 1
            else None
        )
        return StepResult(feedback=self.feedback[-1], reward=k / 10, done=k >= self.done_after, params=params)


def _runs(mask):
    """[(is_action, start, end)] of maximal runs after the prompt."""
    out, pos = [], 0
    for flag, group in itertools.groupby(mask):
        n = len(list(group))
        out.append((flag, pos, pos + n))
        pos += n
    return out


def _expected_feedback(tokenizer, text, ended_with_eos):
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )
    if not isinstance(ids, list):
        ids = ids["input_ids"]
    newline = tokenizer.encode("\n", add_special_tokens=False)
    return (newline if ended_with_eos else [tokenizer.eos_token_id, *newline]) + list(ids)


def _run(hf_engine, tokenizer, *, done_after, max_turns, n=2, max_length=None, short_second_turn=False):
    ScriptedEnv.instances = []
    ex = MultiTurnExecutor(
        engine=hf_engine,
        params=SamplingParams(temperature=TEMPERATURE, max_new_tokens=10, n=n, seed=3),
        tokenizer=tokenizer,
        env_factory=lambda: ScriptedEnv(done_after=done_after, short_second_turn=short_second_turn),
        max_turns=max_turns,
        max_length=max_length,
    )
    trajs = ex.run(PROMPTS, labels=["a", "b", "c", "d"])
    return trajs, list(ScriptedEnv.instances)


@pytest.mark.parametrize(("done_after", "max_turns"), [(2, 4), (9, 3)])
def test_masks_token_by_token_and_logprobs_over_the_exact_context(
    hf_engine, hf_model, tokenizer, done_after, max_turns
):
    trajs, envs = _run(hf_engine, tokenizer, done_after=done_after, max_turns=max_turns)
    assert len(trajs) == 8 and len(envs) == 8
    for t, env in zip(trajs, envs, strict=True):
        prompt = PROMPTS[t.prompt_index]
        assert env.label == "abcd"[t.prompt_index]
        assert t.token_ids[: len(prompt)] == prompt
        runs = _runs(t.action_mask)
        assert runs[0] == (False, 0, len(prompt))
        turns = min(done_after, max_turns)
        actions = [r for r in runs if r[0]]
        feedback = [r for r in runs[1:] if not r[0]]
        assert len(actions) == turns == len(env.actions)
        assert len(feedback) == turns - 1  # no feedback after the last turn
        for k, (_, s, e) in enumerate(actions):
            assert tokenizer.decode(t.token_ids[s:e], skip_special_tokens=True) == env.actions[k]
        for k, (_, s, e) in enumerate(feedback):
            ended = t.token_ids[s - 1] == tokenizer.eos_token_id
            assert t.token_ids[s:e] == _expected_feedback(tokenizer, env.feedback[k], ended)
        assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.action_mask, strict=True) if not m)
        # Every action token's logprob, recomputed over the final token sequence, matches the rollout's.
        ref = reference_logprobs(hf_model, t.token_ids[:1], t.token_ids[1:], temperature=TEMPERATURE)
        got = torch.tensor(t.logprobs[1:], dtype=ref.dtype)
        mask = torch.tensor(t.action_mask[1:])
        assert (ref[mask] - got[mask]).abs().max() < 1e-4
        assert t.reward == pytest.approx(sum(k / 10 for k in range(1, turns + 1)))
        assert t.truncated == (done_after > max_turns)
        assert t.extra_logs["turns"] == turns


def test_step_can_change_sampling_params_and_max_length_truncates(hf_engine, tokenizer):
    trajs, _ = _run(hf_engine, tokenizer, done_after=3, max_turns=3, n=1, short_second_turn=True)
    for t in trajs:
        actions = [(s, e) for flag, s, e in _runs(t.action_mask) if flag]
        assert actions[1][1] - actions[1][0] <= 3  # the env asked for max_new_tokens=3 on turn 2
    trajs, _ = _run(hf_engine, tokenizer, done_after=9, max_turns=5, n=1, max_length=40)
    for t in trajs:
        assert len(t.token_ids) <= 40 and t.truncated


def test_number_guess_env_feedback():
    async def play():
        env = NumberGuessEnv()
        await env.reset(prompt="guess", label=42)
        return [await env.step(action=a) for a in ("I think 10", "maybe 90?", "no idea", "42")]

    low, high, invalid, right = asyncio.run(play())
    assert (low.feedback, low.reward, low.done) == ("Higher.", 0.0, False)
    assert (high.feedback, high.done) == ("Lower.", False)
    assert (invalid.feedback, invalid.reward) == ("Answer with a whole number.", -0.1)
    assert (right.feedback, right.reward, right.done) == ("Correct!", 1.0, True)
    with pytest.raises(ValueError, match="label must be an integer, got 'x'"):
        asyncio.run(NumberGuessEnv().reset(prompt="", label="x"))


def test_number_guess_env_in_the_executor(hf_engine, tokenizer):
    ex = MultiTurnExecutor(
        engine=hf_engine,
        params=SamplingParams(temperature=1.0, max_new_tokens=6, n=2, seed=0),
        tokenizer=tokenizer,
        env_factory=NumberGuessEnv,
        max_turns=3,
    )
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Guess my number between 1 and 100."}],
        add_generation_prompt=True,
        tokenize=True,
    )
    prompt = prompt if isinstance(prompt, list) else prompt["input_ids"]
    trajs = ex.run([prompt, prompt], labels=[7, 63])
    hints = {"Higher.", "Lower.", "Answer with a whole number.", "Correct!"}
    for t in trajs:
        env_text = tokenizer.decode(
            [
                tok
                for tok, m in zip(t.token_ids[t.prompt_len :], t.action_mask[t.prompt_len :], strict=True)
                if not m
            ]
        )
        found = [h for h in hints if h in env_text]
        assert found or t.extra_logs["turns"] == 1  # feedback (if any turn followed) is a real hint
        assert t.reward <= 1.0


def test_prompt_too_long_for_multi_turn(hf_engine, tokenizer):
    ex = MultiTurnExecutor(
        engine=hf_engine,
        params=SamplingParams(),
        tokenizer=tokenizer,
        env_factory=NumberGuessEnv,
        max_length=32,
    )
    with pytest.raises(ValueError, match="prompt 1 has 40 tokens; the executor's max_length is 32"):
        ex.run([[1, 2], [1] * 40], labels=[1, 2])
