"""``rlhf serve-rm``: the server answers rlhf-rollout's ``RemoteReward`` client with the learner's
``RewardModel`` scores, guards with a bearer token, and refuses oversized or malformed bodies."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import torch
from rlhf_cli.serve_rm import RewardScorer, RewardServer, build_app
from rlhf_rollout import RemoteReward
from rlhf_rollout.remote_reward import RemoteRewardError

TOKEN = "s3cret"
LIMIT = 4096


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory, demo_model_dir):
    """A reward-model folder as ``rlhf rm`` writes one: a scalar head and a stored normalisation."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = tmp_path_factory.mktemp("rm")
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(str(demo_model_dir), num_labels=1)
    model.config.pad_token_id = model.config.eos_token_id
    model.config.normalize_reward, model.config.reward_mean, model.config.reward_std = True, 0.25, 2.0
    model.save_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(demo_model_dir)).save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def server(rm_dir):
    scorer = RewardScorer(rm_dir, batch_size=3)
    srv = RewardServer(build_app(scorer, token=TOKEN, max_body_bytes=LIMIT)).start()
    yield srv
    srv.stop()


def learner_scores(rm_dir, texts: list[str]) -> list[float]:
    """What rlhf-learner's RewardModel gives for the texts, tokenised as rlhf rm's examples (+ EOS)."""
    from rlhf_learner import load_reward_model
    from transformers import AutoTokenizer

    model = load_reward_model(str(rm_dir)).eval()
    tok = AutoTokenizer.from_pretrained(str(rm_dir))
    out = []
    with torch.no_grad():
        for t in texts:
            ids = torch.tensor([tok(t)["input_ids"] + [tok.eos_token_id]])
            out.append(float(model(ids)))
    return out


TEXTS = ["max 3 7 = 7", "max 3 7 = 3", "max 9 2 = 9 and more words here", "max 1 0 = 0", "hello"]


def test_remote_reward_client_gets_the_learner_scores(server, rm_dir):
    client = RemoteReward(f"{server.url}/score", headers={"Authorization": f"Bearer {TOKEN}"}, retries=0)
    res = asyncio.run(client.ascore(queries=TEXTS, prompts=["p"] * len(TEXTS), labels=[None] * len(TEXTS)))
    want = learner_scores(rm_dir, TEXTS)
    assert res.rewards == pytest.approx(want, abs=1e-5)  # batched (3 per forward, padded) = one by one
    assert len(set(res.rewards)) == len(TEXTS)


def test_token_ids_score_like_texts(server, rm_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(rm_dir))
    ids = [tok(t)["input_ids"] + [tok.eos_token_id] for t in TEXTS[:2]]
    r = httpx.post(
        f"{server.url}/score",
        json={"input_ids": ids},
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=30,
    )
    assert r.status_code == 200
    assert r.json()["rewards"] == pytest.approx(learner_scores(rm_dir, TEXTS[:2]), abs=1e-5)


def test_sequences_are_cut_to_the_models_positions_when_max_len_is_longer(rm_dir, tmp_path):
    import shutil

    short = shutil.copytree(rm_dir, tmp_path / "short")
    cfg = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 16}))
    scorer = RewardScorer(short, max_len=2048)
    assert scorer.max_len == 16
    long = [(7 * i) % 50 + 3 for i in range(40)]
    assert scorer.score_ids([long]) == pytest.approx(scorer.score_ids([long[-16:]]), abs=1e-6)


def test_requests_without_the_token_are_refused(server):
    r = httpx.post(f"{server.url}/score", json={"queries": ["x"]}, timeout=30)
    assert r.status_code == 401
    r = httpx.get(f"{server.url}/health", headers={"Authorization": "Bearer wrong"}, timeout=30)
    assert r.status_code == 401
    with pytest.raises(RemoteRewardError, match="401"):
        asyncio.run(
            RemoteReward(f"{server.url}/score", retries=0).ascore(queries=["x"], prompts=["x"], labels=[None])
        )
    ok = httpx.get(f"{server.url}/health", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    assert ok.status_code == 200 and ok.json()["normalized"] is True


def test_oversized_bodies_get_413(server):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    big = {"queries": ["x" * (LIMIT + 10)]}
    r = httpx.post(f"{server.url}/score", json=big, headers=auth, timeout=30)
    assert r.status_code == 413 and "max_body_bytes" in r.json()["detail"]

    def chunks():  # no Content-Length: the limit is enforced while reading
        body = json.dumps(big).encode()
        for i in range(0, len(body), 1000):
            yield body[i : i + 1000]

    r = httpx.post(f"{server.url}/score", content=chunks(), headers=auth, timeout=30)
    assert r.status_code == 413


def test_malformed_bodies_get_422_with_a_message(server):
    auth = {"Authorization": f"Bearer {TOKEN}", "content-type": "application/json"}
    r = httpx.post(f"{server.url}/score", content=b'{"queries": [', headers=auth, timeout=30)
    assert r.status_code == 422 and "json" in r.text.lower()
    r = httpx.post(f"{server.url}/score", json={"prompts": ["x"]}, headers=auth, timeout=30)
    assert r.status_code == 422 and "exactly one of 'queries'" in r.text
    r = httpx.post(f"{server.url}/score", json={"queries": "not a list"}, headers=auth, timeout=30)
    assert r.status_code == 422


def test_binds_localhost_by_default():
    from rlhf_cli.config import ServeRMConfig, build_config

    assert build_config(ServeRMConfig, ["--reward.pretrain", "x"]).serve.host == "127.0.0.1"


def test_token_ids_outside_the_vocabulary_get_422(server):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    r = httpx.post(f"{server.url}/score", json={"input_ids": [[1, 2], [3, 100000]]}, headers=auth, timeout=30)
    assert r.status_code == 422 and "input_ids[1]: token id 100000" in r.text
    r = httpx.post(f"{server.url}/score", json={"input_ids": [[-1]]}, headers=auth, timeout=30)
    assert r.status_code == 422
    ok = httpx.post(f"{server.url}/score", json={"input_ids": [[1, 2]]}, headers=auth, timeout=30)
    assert ok.status_code == 200  # the server still answers after refusing


def test_no_unauthenticated_documentation_endpoints(server):
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(f"{server.url}{path}", timeout=30).status_code in (401, 404)


def test_a_public_address_without_a_token_is_refused(rm_dir, monkeypatch):
    from rlhf_cli.main import app
    from typer.testing import CliRunner

    monkeypatch.delenv("RLHF_REWARD_TOKEN", raising=False)
    out = CliRunner().invoke(app, ["serve-rm", "--reward.pretrain", str(rm_dir), "--serve.host", "0.0.0.0"])
    assert out.exit_code == 2
    assert "--serve.host 0.0.0.0: reachable from other machines; set --serve.token" in out.output
