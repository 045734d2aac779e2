"""SingleTurnExecutor with a reward_func file (transformers engine and the vLLM actor), and the bad
inputs that must fail with errors naming the file or the sample."""

from __future__ import annotations

import textwrap

import pytest
import torch
from rlhf_rollout import RewardFunction, SamplingParams, SingleTurnExecutor, load_reward_func
from rollout_testutil import PROMPTS, reference_logprobs

REWARD_FILE = """
import torch

def reward_func(queries, prompts, labels, **kwargs):
    assert len(queries) == len(prompts) == len(labels)
    rewards = torch.tensor([len(q) % 5 + (10.0 if lab == "bonus" else 0.0) for q, lab in zip(queries, labels)])
    return {
        "rewards": rewards,
        "scores": (rewards > 2).float(),
        "extra_logs": {"query_chars": torch.tensor([float(len(q)) for q in queries])},
    }
"""


def _write(tmp_path, name, body):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def _expected_reward(tokenizer, prompt, response, label):
    text = tokenizer.decode(prompt, skip_special_tokens=True) + tokenizer.decode(
        response, skip_special_tokens=True
    )
    return len(text) % 5 + (10.0 if label == "bonus" else 0.0), float(len(text))


@pytest.mark.parametrize("chunk_size", [None, 1])
def test_single_turn_with_reward_file(hf_engine, hf_model, tokenizer, tmp_path, chunk_size):
    reward = RewardFunction.from_file(_write(tmp_path, "reward.py", REWARD_FILE))
    params = SamplingParams(temperature=0.9, max_new_tokens=16, n=2, seed=8)
    ex = SingleTurnExecutor(
        engine=hf_engine, params=params, tokenizer=tokenizer, reward=reward, chunk_size=chunk_size
    )
    labels = ["bonus", None, "x", "bonus"]
    trajs = ex.run(PROMPTS, labels=labels)
    assert [(t.prompt_index, t.sample_index) for t in trajs] == [(i, j) for i in range(4) for j in range(2)]
    for t in trajs:
        prompt = PROMPTS[t.prompt_index]
        response = t.token_ids[len(prompt) :]
        assert t.token_ids[: len(prompt)] == prompt and t.prompt_len == len(prompt)
        assert t.action_mask == [False] * len(prompt) + [True] * len(response)
        assert t.logprobs[: len(prompt)] == [0.0] * len(prompt)
        ref = reference_logprobs(hf_model, prompt, response, temperature=0.9)
        torch.testing.assert_close(
            torch.tensor(t.logprobs[len(prompt) :], dtype=ref.dtype), ref, atol=1e-4, rtol=0
        )
        r, chars = _expected_reward(tokenizer, prompt, response, labels[t.prompt_index])
        assert t.reward == r and t.score == float(r > 2) and t.extra_logs == {"query_chars": chars}
        assert t.truncated == (len(response) == 16 and response[-1] != tokenizer.eos_token_id)


def test_single_turn_through_the_vllm_actor(vllm_client, tokenizer, tmp_path):
    reward = RewardFunction.from_file(_write(tmp_path, "reward.py", REWARD_FILE))
    params = SamplingParams(temperature=1.0, max_new_tokens=16, n=2, seed=8)
    ex = SingleTurnExecutor(
        engine=vllm_client, params=params, tokenizer=tokenizer, reward=reward, chunk_size=2
    )
    trajs = ex.run(PROMPTS)
    direct = vllm_client.generate(PROMPTS, params)  # chunking keeps vLLM's per-sample seeds
    for t in trajs:
        g = direct[t.prompt_index][t.sample_index]
        assert t.token_ids[t.prompt_len :] == g.token_ids
        assert t.logprobs[t.prompt_len :] == pytest.approx(g.logprobs, abs=1e-5)
        assert t.reward == _expected_reward(tokenizer, PROMPTS[t.prompt_index], g.token_ids, None)[0]


def test_reward_file_errors_name_the_file(tmp_path):
    missing = tmp_path / "nope.py"
    with pytest.raises(FileNotFoundError, match=r"nope\.py"):
        load_reward_func(missing)
    no_func = _write(tmp_path, "no_func.py", "def reward(q, p, l):\n    return [0.0]\n")
    with pytest.raises(ValueError, match=r"no_func\.py.*defines no 'reward_func'"):
        load_reward_func(no_func)
    broken = _write(tmp_path, "broken.py", "import not_a_module_xyz\n")
    with pytest.raises(RuntimeError, match=r"broken\.py.*failed"):
        load_reward_func(broken)


@pytest.mark.parametrize(
    ("body", "error", "match"),
    [
        (
            "def reward_func(q, p, l):\n    raise KeyError('boom')\n",
            RuntimeError,
            r"raises\.py.* raised KeyError\('boom'\)",
        ),
        (
            "def reward_func(q, p, l):\n    return [float('nan') if i == 3 else 0.0 for i in range(len(q))]\n",
            ValueError,
            r"nan\.py.*rewards of sample 3 is nan",
        ),
        (
            "def reward_func(q, p, l):\n    return [0.0] * (len(q) - 1)\n",
            ValueError,
            r"short\.py.*7 values for 8 samples",
        ),
        (
            "def reward_func(q, p, l):\n    return {'scores': [0.0] * len(q)}\n",
            ValueError,
            r"dict\.py.*without 'rewards'",
        ),
    ],
    ids=["raises", "nan", "short", "dict"],
)
def test_bad_reward_functions(hf_engine, tokenizer, tmp_path, body, error, match):
    name = match.split("\\")[0]
    reward = RewardFunction.from_file(_write(tmp_path, f"{name}.py", body))
    ex = SingleTurnExecutor(
        engine=hf_engine,
        params=SamplingParams(max_new_tokens=4, n=2, seed=0),
        tokenizer=tokenizer,
        reward=reward,
    )
    with pytest.raises(error, match=match):
        ex.run(PROMPTS)


def test_prompt_longer_than_engine_max_length(hf_engine, tokenizer):
    ex = SingleTurnExecutor(engine=hf_engine, params=SamplingParams(max_new_tokens=4), tokenizer=tokenizer)
    with pytest.raises(ValueError, match="prompt 2 has 600 tokens; the engine's max_model_len is 512"):
        ex.run([[1, 2], [1, 3], [1] * 600])


def test_engine_locks_are_freed_with_their_engine():
    import gc

    from rlhf_rollout.executors import base

    class Engine:
        def generate(self, prompts, params):
            return []

    gc.collect()  # engines other tests left for the collector go first
    engine = Engine()
    lock = base._engine_lock(engine)
    assert base._engine_lock(engine) is lock  # one lock per engine, shared by every executor
    before = len(base._LOCKS)
    del engine, lock
    gc.collect()
    assert len(base._LOCKS) == before - 1
