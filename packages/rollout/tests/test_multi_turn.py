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


# --- episodes advance independently -------------------------------------------------------------------


class RecordingEngine:
    """The session's transformers engine, logging each call: (prompt index, prompts, n, seed). A local
    engine: the executor reaches it through ``generate`` in a thread."""

    def __init__(self, inner, log: list) -> None:
        self.inner, self.log = inner, log

    @property
    def max_model_len(self) -> int:
        return self.inner.max_model_len

    def generate(self, prompts, params):
        i = next(k for k, p in enumerate(PROMPTS) if list(prompts[0][: len(p)]) == p)
        self.log.append(("generate", i, len(prompts), params.n, params.seed))
        return self.inner.generate(prompts, params)


class ConcurrentEngine(RecordingEngine):
    """Like ``EngineClient`` on Ray: ``agenerate`` calls overlap."""

    async def agenerate(self, prompts, params):
        await asyncio.sleep(0.01)
        return self.generate(prompts, params)


class PacedEnv:
    """Prompt 0 ("fast") ends after 3 quick steps; prompt 1 ("slow") after 2, and its first step
    lasts until the fast episode has ended (giving up after 60 s)."""

    def __init__(self, log: list, fast_done: asyncio.Event) -> None:
        self.log, self.fast_done, self.k = log, fast_done, 0

    async def reset(self, *, prompt: str, label) -> None:
        self.label = label

    async def step(self, *, action: str) -> StepResult:
        self.k += 1
        if self.label == "slow" and self.k == 1:
            try:
                await asyncio.wait_for(self.fast_done.wait(), 60)
            except TimeoutError:
                self.log.append(("slow step gave up waiting",))
        self.log.append(("stepped", self.label, self.k))
        done = self.k >= (3 if self.label == "fast" else 2)
        if done and self.label == "fast":
            self.fast_done.set()
        return StepResult(feedback="Go on.", reward=1.0, done=done)


@pytest.mark.parametrize("engine_kind", [RecordingEngine, ConcurrentEngine], ids=["local", "concurrent"])
def test_an_episode_does_not_wait_for_slower_ones(hf_engine, tokenizer, engine_kind):
    log: list = []
    fast_done = asyncio.Event()
    ex = MultiTurnExecutor(
        engine=engine_kind(hf_engine, log),
        params=SamplingParams(temperature=TEMPERATURE, max_new_tokens=5, seed=1),
        tokenizer=tokenizer,
        env_factory=lambda: PacedEnv(log, fast_done),
        max_turns=4,
    )
    fast, slow = ex.run(PROMPTS[:2], labels=["fast", "slow"])
    assert ("slow step gave up waiting",) not in log  # lockstep turns would keep fast waiting on slow
    # the fast episode took all its turns while the slow one was still in its first step
    assert log.index(("stepped", "fast", 3)) < log.index(("stepped", "slow", 1))
    gens = [entry for entry in log if entry[0] == "generate"]
    assert all(n_prompts == 1 and n == 1 for _, _, n_prompts, n, _ in gens)  # one episode per call
    assert [i for _, i, *_ in gens] == [0, 1, 0, 0, 1]  # not grouped per turn
    assert (fast.prompt_index, slow.prompt_index) == (0, 1)
    assert (fast.extra_logs["turns"], slow.extra_logs["turns"]) == (3.0, 2.0)
    assert (fast.reward, slow.reward) == (3.0, 2.0) and not fast.truncated and not slow.truncated


class LateEnv:
    """Done after 3 steps. Episodes of prompt ``late`` take their first step only once every episode
    of the other prompt has ended (giving up after 60 s), so the engine sees the turns in another order."""

    def __init__(self, late: int, ended: list, other_done: asyncio.Event) -> None:
        self.late, self.ended, self.other_done, self.k = late, ended, other_done, 0

    async def reset(self, *, prompt: str, label) -> None:
        self.prompt = label

    async def step(self, *, action: str) -> StepResult:
        self.k += 1
        if self.prompt == self.late and self.k == 1:
            await asyncio.wait_for(self.other_done.wait(), 60)
        if self.k == 3 and self.prompt != self.late:
            self.ended.append(self.prompt)
            if len(self.ended) == 2:  # both samples of the other prompt
                self.other_done.set()
        return StepResult(feedback="Again.", reward=0.0, done=self.k == 3)


def test_samples_depend_on_seed_prompt_sample_and_turn_not_on_scheduling(hf_engine, tokenizer):
    def run(late: int):
        log: list = []
        ended: list = []
        other_done = asyncio.Event()
        ex = MultiTurnExecutor(
            engine=RecordingEngine(hf_engine, log),
            params=SamplingParams(temperature=TEMPERATURE, max_new_tokens=6, n=2, seed=11),
            tokenizer=tokenizer,
            env_factory=lambda: LateEnv(late, ended, other_done),
            max_turns=4,
        )
        return ex.run(PROMPTS[:2], labels=[0, 1]), log

    first, log_first = run(late=0)
    second, log_second = run(late=1)
    order = [[i for _, i, *_ in log] for log in (log_first, log_second)]
    assert order[0] != order[1]  # the engine saw the episodes' turns in another order
    assert order[0][-4:] == [0, 0, 0, 0] and order[1][-4:] == [1, 1, 1, 1]
    for a, b in zip(first, second, strict=True):
        assert (a.prompt_index, a.sample_index) == (b.prompt_index, b.sample_index)
        assert a.token_ids == b.token_ids and a.logprobs == pytest.approx(b.logprobs)
    # turn t of sample j of prompt i: seed + (i * n + j) * max_turns + t, each used once
    expected = sorted(11 + k * 4 + t for k in range(4) for t in range(3))
    assert sorted(seed for *_, seed in log_first) == expected == sorted(seed for *_, seed in log_second)
    assert len({tuple(t.token_ids) for t in first}) == 4  # the samples differ from one another


# --- per-turn lengths ------------------------------------------------------------------------------------


class ThreeTokenEngine:
    """Every turn: 3 tokens, the last EOS (well under ``max_new_tokens``)."""

    max_model_len = 512

    def __init__(self, eos: int) -> None:
        self.eos = eos

    def generate(self, prompts, params):
        from rlhf_rollout import Generation

        ids = [30, 31, self.eos]
        return [[Generation(token_ids=ids, logprobs=[-0.5] * 3, finish_reason="stop")] for _ in prompts]


def test_max_turn_tokens_counts_one_turn_not_the_sum_over_turns(tokenizer):
    """An overlong penalty compares ``max_turn_tokens`` with ``max_new_tokens``: 3 turns of 3 tokens
    under ``max_new_tokens=8`` are 9 policy tokens, yet no turn came near the per-turn limit."""
    ScriptedEnv.instances = []
    ex = MultiTurnExecutor(
        engine=ThreeTokenEngine(tokenizer.eos_token_id),
        params=SamplingParams(max_new_tokens=8, n=2, seed=0),
        tokenizer=tokenizer,
        env_factory=lambda: ScriptedEnv(done_after=3),
        max_turns=3,
    )
    trajs = ex.run(PROMPTS[:2])
    for t in trajs:
        turns = [e - s for flag, s, e in _runs(t.action_mask) if flag]
        assert turns == [3, 3, 3] and sum(t.action_mask) == 9 > 8
        assert t.extra_logs["max_turn_tokens"] == 3.0  # the longest turn, not 9
        assert not t.truncated and t.extra_logs["turns"] == 3.0
        assert t.reward == pytest.approx(0.1 + 0.2 + 0.3)
