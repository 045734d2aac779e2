"""RemoteReward against real local HTTP servers (FastAPI + uvicorn on 127.0.0.1, started here)."""

from __future__ import annotations

import asyncio
import time

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from rlhf_rollout import RemoteReward, RemoteRewardError, SamplingParams, SingleTurnExecutor
from rlhf_testkit import free_port
from rollout_testutil import PROMPTS, ServerThread


class RewardServer:
    """rewards = number of characters of each query; scores = 1 when the label is "good"."""

    def __init__(self) -> None:
        self.calls: list[int] = []
        self.flaky_failures = 0
        app = FastAPI()

        @app.post("/score")
        async def score(request: Request):
            body = await request.json()
            self.calls.append(len(body["queries"]))
            return {
                "rewards": [float(len(q)) for q in body["queries"]],
                "scores": [1.0 if lab == "good" else 0.0 for lab in body["labels"]],
                "extra_logs": {"prompt_chars": [float(len(p)) for p in body["prompts"]]},
            }

        @app.post("/slow")
        async def slow(request: Request):
            await asyncio.sleep(2.0)
            return {"rewards": []}

        @app.post("/flaky")
        async def flaky(request: Request):
            body = await request.json()
            if self.flaky_failures < 2:
                self.flaky_failures += 1
                return JSONResponse(status_code=503, content={"error": "warming up"})
            return {"rewards": [1.0] * len(body["queries"])}

        @app.post("/short")
        async def short(request: Request):
            return {"rewards": [0.0]}

        @app.post("/reject")
        async def reject(request: Request):
            return JSONResponse(status_code=422, content={"error": "bad labels"})

        self.thread = ServerThread(app)
        self.url = self.thread.url


@pytest.fixture(scope="module")
def servers():
    a, b = RewardServer(), RewardServer()
    yield a, b
    a.thread.stop()
    b.thread.stop()


def _score(reward, n=5, labels=None):
    queries = [f"q{i}" * (i + 1) for i in range(n)]
    return asyncio.run(
        reward.ascore(queries=queries, prompts=["p"] * n, labels=labels or (["good", "bad"] * n)[:n])
    )


def test_sharded_across_two_servers_in_order(servers):
    a, b = servers
    a.calls.clear(), b.calls.clear()
    out = _score(
        RemoteReward([f"{a.url}/score", f"{b.url}/score"]), n=5, labels=["good", "bad", "good", "x", "y"]
    )
    assert out.rewards == [float(len(f"q{i}" * (i + 1))) for i in range(5)]
    assert out.scores == [1.0, 0.0, 1.0, 0.0, 0.0]
    assert out.extra_logs == {"prompt_chars": [1.0] * 5, "reward_retries": [0.0] * 5}
    assert a.calls == [2] and b.calls == [3]


def test_retries_then_succeeds_and_each_retry_is_logged_and_counted(servers, caplog):
    a, _ = servers
    a.flaky_failures = 0
    with caplog.at_level("WARNING", logger="rlhf_rollout.remote_reward"):
        out = _score(RemoteReward(f"{a.url}/flaky", retries=2, backoff_s=0.01), n=3)
    assert out.rewards == [1.0, 1.0, 1.0] and a.flaky_failures == 2
    assert out.extra_logs["reward_retries"] == [2.0] * 3
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and lines[0].startswith(
        f"reward server {a.url}/flaky: attempt 1 of 3 failed (HTTP 503"
    )


def test_retries_exhausted_names_the_url(servers):
    a, _ = servers
    a.flaky_failures = 0
    with pytest.raises(
        RemoteRewardError, match=rf"reward server {a.url}/flaky failed after 2 attempts: HTTP 503"
    ):
        _score(RemoteReward(f"{a.url}/flaky", retries=1, backoff_s=0.01), n=3)


def test_timeout_names_the_url(servers):
    a, _ = servers
    t0 = time.monotonic()
    with pytest.raises(
        RemoteRewardError, match=rf"reward server {a.url}/slow failed after 2 attempts: timed out after 0.3 s"
    ):
        _score(RemoteReward(f"{a.url}/slow", timeout_s=0.3, retries=1, backoff_s=0.01))
    assert time.monotonic() - t0 < 1.9


def test_unreachable_url(servers):
    url = f"http://127.0.0.1:{free_port()}/score"  # nothing listens there
    with pytest.raises(
        RemoteRewardError, match=rf"reward server {url} failed after 1 attempts: ConnectError"
    ):
        _score(RemoteReward(url, retries=0))


def test_bad_answers_name_the_url_and_samples(servers):
    a, b = servers
    with pytest.raises(
        RemoteRewardError,
        match=rf"reward server {b.url}/short \(samples 2\.\.4\): rewards has 1 values for 3 samples",
    ):
        _score(RemoteReward([f"{a.url}/score", f"{b.url}/short"]), n=5)
    with pytest.raises(
        RemoteRewardError, match=rf"reward server {a.url}/reject rejected the request: HTTP 422"
    ):
        _score(RemoteReward(f"{a.url}/reject", retries=3))
    with pytest.raises(ValueError, match="must start with http"):
        RemoteReward("127.0.0.1:9/score")


def test_single_turn_executor_with_remote_reward(servers, hf_engine, tokenizer):
    a, b = servers
    ex = SingleTurnExecutor(
        engine=hf_engine,
        params=SamplingParams(max_new_tokens=8, n=2, seed=0),
        tokenizer=tokenizer,
        reward=RemoteReward([f"{a.url}/score", f"{b.url}/score"]),
        chunk_size=2,
    )
    trajs = ex.run(PROMPTS, labels=["good", "bad", "good", "bad"])
    for t in trajs:
        text = tokenizer.decode(t.token_ids[: t.prompt_len], skip_special_tokens=True) + tokenizer.decode(
            t.token_ids[t.prompt_len :], skip_special_tokens=True
        )
        assert t.reward == float(len(text))
        assert t.score == (1.0 if t.prompt_index % 2 == 0 else 0.0)
