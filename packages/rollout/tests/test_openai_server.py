"""The OpenAI-compatible server, driven by the official ``openai`` client, and the executor that
turns an OpenAI-API agent's calls back into exact-token trajectories."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from rlhf_rollout import OpenAIAgentExecutor, OpenAIServer
from rollout_testutil import reference_logprobs

KEY = "k3y"


@pytest.fixture(scope="module")
def server(hf_engine, tokenizer):
    with OpenAIServer(engine=hf_engine, tokenizer=tokenizer, api_key=KEY, max_body_bytes=4096) as srv:
        yield srv


def _chat_ids(tokenizer, messages):
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return ids if isinstance(ids, list) else list(ids["input_ids"])


def test_chat_and_completions_are_recorded_exactly(server, tokenizer, hf_model):
    assert server.url.startswith("http://127.0.0.1:")
    client = openai.OpenAI(base_url=server.base_url("s1"), api_key=KEY, max_retries=0)
    messages = [{"role": "user", "content": "what is two plus two"}]
    chat = client.chat.completions.create(
        model="policy", messages=messages, max_tokens=12, temperature=0.8, seed=1
    )
    (rec,) = server.records("s1")
    assert rec.kind == "chat" and rec.prompt_ids == _chat_ids(tokenizer, messages)
    g = rec.generations[0]
    assert chat.choices[0].message.content == tokenizer.decode(g.token_ids, skip_special_tokens=True)
    assert chat.usage.prompt_tokens == len(rec.prompt_ids) and chat.usage.completion_tokens == len(
        g.token_ids
    )
    assert chat.choices[0].finish_reason == ("length" if g.finish_reason == "length" else "stop")
    ref = reference_logprobs(hf_model, rec.prompt_ids, g.token_ids, temperature=0.8)
    torch.testing.assert_close(torch.tensor(g.logprobs, dtype=ref.dtype), ref, atol=1e-4, rtol=0)

    comp = client.completions.create(model="policy", prompt=[1, 40, 41], max_tokens=6, n=2, seed=3)
    rec2 = server.records("s1")[1]
    assert rec2.kind == "completion" and rec2.prompt_ids == [1, 40, 41] and len(rec2.generations) == 2
    assert [c.text for c in comp.choices] == [
        tokenizer.decode(x.token_ids, skip_special_tokens=True) for x in rec2.generations
    ]
    assert server.pop_records("s1") and server.records("s1") == []
    assert [m.id for m in client.models.list()] == ["policy"]


def test_bad_requests_are_400_with_a_reason(server):
    client = openai.OpenAI(base_url=server.base_url(), api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="'stop' strings are not supported"):
        client.completions.create(model="policy", prompt="hello", max_tokens=4, stop=["\n"])
    with pytest.raises(openai.BadRequestError, match="prompt 0 has 600 tokens"):
        client.completions.create(model="policy", prompt=[1] * 600, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="temperature must be"):
        client.completions.create(model="policy", prompt="hello", temperature=-1)
    # zeros are values, not "unset": each is refused by SamplingParams instead of becoming a default
    for field, message in (
        ("top_p", "top_p must be in"),
        ("n", "n must be >= 1"),
        ("max_tokens", "max_new_tokens"),
    ):
        with pytest.raises(openai.BadRequestError, match=message):
            client.completions.create(model="policy", prompt="hello", **{"max_tokens": 4, field: 0})
    assert server.records() == []


def test_requests_need_the_bearer_token_and_a_bounded_body(server):
    for key in ("wrong", KEY + "x", KEY[:-1]):
        client = openai.OpenAI(base_url=server.base_url("s9"), api_key=key, max_retries=0)
        with pytest.raises(openai.AuthenticationError, match="missing or wrong bearer token"):
            client.completions.create(model="policy", prompt=[1, 40], max_tokens=2)
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
    client = openai.OpenAI(base_url=server.base_url("s9"), api_key=KEY, max_retries=0)
    with pytest.raises(openai.APIStatusError, match="4096-byte limit") as err:
        client.completions.create(model="policy", prompt="x" * 5000, max_tokens=2)
    assert err.value.status_code == 413
    for path in ("/docs", "/openapi.json"):  # no unauthenticated pages either
        assert httpx.get(server.url + path, headers={"Authorization": f"Bearer {KEY}"}).status_code == 404
    r = httpx.post(server.base_url("s9") + "/completions", json={"prompt": [1], "max_tokens": 1})
    assert r.status_code == 401  # no header at all
    assert server.records("s9") == []


async def agent(*, base_url: str, api_key: str, prompt: str, label) -> float:
    """Three calls: a chat turn; a completion that extends the exact tokens (merged into the same
    trajectory); a chat call that re-renders the history from text (a new trajectory)."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": prompt}]
    first = await client.chat.completions.create(
        model="policy",
        messages=messages,
        max_tokens=8,
        temperature=0.9,
        extra_body={"return_token_ids": True},
    )
    context = first.model_extra["prompt_token_ids"] + first.choices[0].model_extra["token_ids"]
    await client.completions.create(model="policy", prompt=[*context, 50, 51], max_tokens=8, temperature=0.9)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "again"},
    ]
    await client.chat.completions.create(model="policy", messages=messages, max_tokens=8, temperature=0.9)
    return 0.5 if label == "half" else 1.0


def test_openai_agent_executor_rebuilds_trajectories(server, tokenizer, hf_model):
    ex = OpenAIAgentExecutor(server=server, agent=agent, samples_per_prompt=2)
    trajs = ex.run(["count to three", "say hello"], labels=["half", "full"])
    assert len(trajs) == 2 * 2 * 2  # 2 prompts x 2 samples x (merged trajectory + re-rendered one)
    for t in trajs:
        assert t.reward == (0.5 if t.prompt_index == 0 else 1.0)
        ref = reference_logprobs(hf_model, t.token_ids[:1], t.token_ids[1:], temperature=0.9)
        mask = torch.tensor(t.action_mask[1:])
        got = torch.tensor(t.logprobs[1:], dtype=ref.dtype)
        assert (ref[mask] - got[mask]).abs().max() < 1e-4
        assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.action_mask, strict=True) if not m)
    merged = trajs[0]
    # prompt, action, the agent's two extra tokens (masked out), action
    first_end = merged.action_mask.index(False, merged.prompt_len)
    assert merged.token_ids[first_end : first_end + 2] == [50, 51]
    assert merged.action_mask[first_end : first_end + 2] == [False, False]
    assert all(merged.action_mask[first_end + 2 :])
    assert server.records() == []  # sessions are popped


def test_server_in_front_of_the_vllm_actor(vllm_client, tokenizer):
    with OpenAIServer(engine=vllm_client, tokenizer=tokenizer) as srv:
        client = openai.OpenAI(base_url=srv.base_url(), api_key="unused", max_retries=0)
        out = client.completions.create(
            model="policy", prompt=[1, 40, 41], max_tokens=5, seed=2, temperature=1.0
        )
        (rec,) = srv.records()
        direct = vllm_client.generate([[1, 40, 41]], rec.params)[0][0]
        assert rec.generations[0].token_ids == direct.token_ids
        assert out.choices[0].text == tokenizer.decode(direct.token_ids, skip_special_tokens=True)
