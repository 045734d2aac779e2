"""``rlhf ppo`` with an agent that talks to the policy through the OpenAI API (``run_agent`` in the
agent file): the executor's server, its errors, and a two-step run on the transformers backend."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from rlhf_cli.config import PPOConfig, build_config
from rlhf_cli.ppo.recipe import run
from rlhf_cli.ppo.sources import OpenAIAgentFactory, executor_factory
from rlhf_rollout import Generation, SamplingParams

AGENT = Path(__file__).parent / "agents" / "openai_agent.py"
MISMATCH = 1e-3  # engine vs learner log-prob of a sampled token with the same weights


class _Tokenizer:
    """Ids are character codes (enough for the server's text paths)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt: bool, tokenize: bool) -> list[int]:
        return self.encode("".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>")


class _Engine:
    """A local engine answering 'ab' (or max_new_tokens of it), recording the parameters it got."""

    max_model_len = 64

    def __init__(self) -> None:
        self.params: list[SamplingParams] = []

    def generate(self, prompts, params: SamplingParams) -> list[list[Generation]]:
        self.params.append(params)
        ids = [ord("a"), ord("b")][: params.max_new_tokens]
        gen = Generation(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop")
        return [[gen] * params.n for _ in prompts]


def _factory(agent, *, timeout_s: float = 30.0) -> OpenAIAgentFactory:
    return OpenAIAgentFactory(
        agent, path=Path("my_agent.py"), tokenizer=_Tokenizer(), timeout_s=timeout_s, default_max_tokens=8
    )


def test_the_server_samples_at_the_run_settings_and_keeps_one_trajectory_per_episode():
    import openai

    async def agent(*, base_url: str, api_key: str, prompt: str, label) -> float:
        async with openai.AsyncOpenAI(base_url=base_url, api_key="x", timeout=30.0, max_retries=0) as client:
            with pytest.raises(openai.AuthenticationError):  # the run's server wants the run's key
                await client.models.list()
        async with openai.AsyncOpenAI(
            base_url=base_url, api_key=api_key, timeout=30.0, max_retries=0
        ) as client:
            first = await client.chat.completions.create(
                model="policy",
                messages=[{"role": "user", "content": prompt}],
                temperature=0.1,
                max_tokens=50,
                extra_body={"return_token_ids": True},
            )
            ids = first.model_extra["prompt_token_ids"] + first.choices[0].model_extra["token_ids"]
            await client.completions.create(model="policy", prompt=[*ids, 33], max_tokens=1)
            if label == "rerender":  # a call that does not extend the tokens: a second segment
                await client.completions.create(model="policy", prompt="again", max_tokens=2)
        return 1.0 if label == "rerender" else 0.5

    factory, engine = _factory(agent), _Engine()
    try:
        params = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=2, n=2)
        trajs = factory(engine, params).run([[ord("h"), ord("i")], [ord("y")]], labels=["x", "rerender"])
        assert factory.server().url.startswith("http://127.0.0.1:")
    finally:
        factory.close()
    assert {(p.temperature, p.top_p) for p in engine.params} == {(0.7, 0.9)}
    assert sorted({p.max_new_tokens for p in engine.params}) == [1, 2]  # 50 capped at 2; 1 kept
    assert [(t.prompt_index, t.sample_index) for t in trajs] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    merged = trajs[0]
    assert merged.token_ids == [*_Tokenizer().encode("<user>hi<assistant>"), 97, 98, 33, 97]
    assert merged.action_mask[-4:] == [True, True, False, True] and merged.logprobs[-2:] == [0.0, -0.5]
    assert merged.reward == 0.5 and merged.extra_logs["agent_segments"] == 1.0
    last = trajs[2]  # the last segment: the re-rendered call
    assert last.token_ids == [*_Tokenizer().encode("again"), 97, 98] and last.reward == 1.0
    assert last.extra_logs["agent_segments"] == 2.0


def test_agent_errors_and_timeouts_name_the_file_and_the_sample():
    async def failing(*, base_url: str, api_key: str, prompt: str, label) -> float:
        raise KeyError(f"no answer for {label}")

    async def slow(**kwargs) -> float:
        await asyncio.sleep(30)
        return 0.0

    params = SamplingParams(max_new_tokens=2)
    for agent, timeout_s, message in (
        (failing, 30.0, r"'my_agent.py': agent failed on prompt 0 \(sample 0\): KeyError"),
        (slow, 0.2, r"'my_agent.py': agent failed on prompt 0 \(sample 0\).*--train.agent_timeout_s"),
    ):
        factory = _factory(agent, timeout_s=timeout_s)
        try:
            with pytest.raises(RuntimeError, match=message) as info:
                factory(_Engine(), params).run([[104]], labels=["q"])
        finally:
            factory.close()
        assert "\n" not in str(info.value)
    # the agent's own frames (its file and line) come with the error; none of ours
    with pytest.raises(RuntimeError) as info:
        factory = _factory(failing, timeout_s=30.0)
        try:
            factory(_Engine(), params).run([[104]], labels=["q"])
        finally:
            factory.close()
    frames = info.value.user_traceback
    assert f'File "{__file__}"' in frames and "in failing" in frames and "rlhf_rollout" not in frames


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("x = 1\n", "defines none of make_env\\(\\) \\(multi-turn\\), run_agent"),
        (
            "def run_agent(*, base_url, api_key, prompt, label):\n    return 1.0\n",
            "must be 'async def run_agent",
        ),
        (  # the token is part of the contract: an agent without it could not call the server
            "async def run_agent(*, base_url, prompt, label):\n    return 1.0\n",
            r"must be 'async def run_agent\(\*, base_url, api_key, prompt, label\) -> float'",
        ),
        (
            "async def run_agent(*, base_url, api_key, prompt, label):\n    return 1.0\n\n"
            "def reward_func(queries, prompts, labels):\n    return [0.0] * len(queries)\n",
            "defines run_agent and reward_func: define one",
        ),
        (
            "def make_env(label):\n    return None\n",
            r"is def make_env\(label\): it is called as make_env\(\)",
        ),
        (
            "def reward_func(queries, prompts):\n    return [0.0] * len(queries)\n",
            r"reward_func in '.*bad.py' is def reward_func\(queries, prompts\): it is called as "
            r"reward_func\(queries, prompts, labels\)",
        ),
    ],
)
def test_a_bad_agent_file_is_a_one_line_error(tmp_path, source, message):
    bad = tmp_path / "bad.py"
    bad.write_text(source)
    cfg = build_config(PPOConfig, ["--train.agent_func_path", str(bad), "--logger.run_dir", str(tmp_path)])
    with pytest.raises(ValueError, match=f"^--train.agent_func_path: .*{message}") as info:
        executor_factory(cfg, tokenizer=_Tokenizer())
    assert "\n" not in str(info.value)


def test_ppo_trains_with_an_openai_agent(tmp_path, ray_cluster, demo_model_dir):
    """Two steps, the transformers engine (started by the run), four prompts x two episodes each."""
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"input": f"say {i}", "label": i}) + "\n" for i in range(8)))
    flags = ["--train.num_steps=2", "--rollout.batch_size=4", "--rollout.n_samples_per_prompt=2"]
    flags += ["--rollout.max_new_tokens=6", "--train.micro_batch_size=4", "--eval.every=0"]
    flags += ["--logger.progress=false", "--logger.tensorboard=false", "--rollout.backend=transformers"]
    flags += ["--algo.advantage.estimator=group_norm", f"--actor.pretrain={demo_model_dir}"]
    flags += [
        f"--data.path={data}",
        f"--train.agent_func_path={AGENT}",
        f"--logger.run_dir={tmp_path / 'run'}",
    ]
    result = run(build_config(PPOConfig, flags))
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        # the trajectories are the engine's tokens and log-probs: the learner agrees with the engine
        assert r["sync/logp_mismatch_max"] < MISMATCH, r
        assert r["extra/agent_segments"] == 1.0  # both turns chained into one trajectory
        assert r["rollout/response_length"] > 4  # more than the first turn's tokens
        assert r["rollout/reward_mean"] > 0
    assert (result.final_model / "config.json").is_file()
