"""``rlhf serve-rm``: a reward model behind HTTP, in the format rlhf-rollout's ``RemoteReward`` posts.

``POST /score`` with ``{"queries": [text, ...]}`` (prompt + response texts; ``prompts`` / ``labels`` may
come along and are ignored) or ``{"input_ids": [[id, ...], ...]}`` answers ``{"rewards": [...],
"scores": [...]}``, one per sequence, from the learner's ``RewardModel`` (with the normalisation stored
in the folder). Texts are tokenised as ``rlhf rm`` tokenised its training examples: special tokens
added, EOS appended when missing. ``GET /health`` answers ``{"status": "ok", ...}``. An optional bearer
token guards both; bodies over the size limit get 413, malformed ones 422 with the reason.
"""

# No `from __future__ import annotations`: FastAPI reads the handlers' annotations at runtime.

import os
import socket
import threading
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, model_validator
from rlhf_rollout.http_guard import HTTPGuard

from rlhf_cli.config.models import REWARD_TOKEN_ENV as TOKEN_ENV

__all__ = ["TOKEN_ENV", "RewardScorer", "RewardServer", "ScoreRequest", "build_app", "resolve_token"]


class ScoreRequest(BaseModel):
    """One scoring request: texts or token ids (exactly one of them)."""

    queries: list[str] | None = None
    input_ids: list[list[int]] | None = None
    prompts: list[str] | None = None
    labels: list[Any] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> "ScoreRequest":
        if (self.queries is None) == (self.input_ids is None):
            raise ValueError("give exactly one of 'queries' (texts) or 'input_ids' (token id lists)")
        if self.input_ids is not None and any(not row for row in self.input_ids):
            raise ValueError("input_ids: a sequence is empty")
        return self


class RewardScorer:
    """A reward-model folder loaded with rlhf-learner's ``RewardModel``; scores in batches."""

    def __init__(
        self, path: str | Path, *, batch_size: int = 16, max_len: int = 2048, device: str | None = None
    ):
        from rlhf_learner import load_reward_model
        from rlhf_learner.models import check_model_dir
        from rlhf_learner.models.loading import max_positions
        from transformers import AutoTokenizer

        self.path = str(path)
        check_model_dir(self.path, need_causal_lm=False)  # with its tokenizer: texts are tokenised here
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model = load_reward_model(self.path).to(self.device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        self.batch_size = batch_size
        self.max_len = min(
            max_len, max_positions(self.model.config) or max_len
        )  # within the model's positions
        self._lock = threading.Lock()  # one forward at a time (requests arrive on several threads)

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    @property
    def normalized(self) -> bool:
        return bool(getattr(self.model.config, "normalize_reward", False))

    def encode(self, text: str) -> list[int]:
        ids = list(self.tokenizer(text, add_special_tokens=True)["input_ids"])
        eos = self.tokenizer.eos_token_id
        return ids if ids and ids[-1] == eos else [*ids, eos]

    @torch.no_grad()
    def score_ids(self, sequences: list[list[int]]) -> list[float]:
        out: list[float] = []
        with self._lock:
            for lo in range(0, len(sequences), self.batch_size):
                chunk = [s[-self.max_len :] for s in sequences[lo : lo + self.batch_size]]
                width = max(len(s) for s in chunk)
                ids = torch.zeros((len(chunk), width), dtype=torch.long)
                mask = torch.zeros((len(chunk), width), dtype=torch.long)
                for i, s in enumerate(chunk):
                    ids[i, : len(s)] = torch.tensor(s)
                    mask[i, : len(s)] = 1
                scores = self.model(ids.to(self.device), attention_mask=mask.to(self.device))
                out += [float(x) for x in scores.float().cpu()]
        return out

    def score_texts(self, texts: list[str]) -> list[float]:
        return self.score_ids([self.encode(t) for t in texts])


def build_app(scorer: RewardScorer, *, token: str | None, max_body_bytes: int) -> Any:
    """The FastAPI application, behind the bearer token and the body-size limit."""
    from fastapi import FastAPI, HTTPException
    from fastapi.concurrency import run_in_threadpool

    app = FastAPI(title="rlhf reward model", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok", "model": scorer.path, "normalized": scorer.normalized}

    @app.post("/score")
    async def score(body: ScoreRequest) -> dict:
        if body.queries is not None:
            scores = await run_in_threadpool(scorer.score_texts, body.queries)
        else:
            vocab = scorer.vocab_size
            for i, row in enumerate(body.input_ids):
                bad = next((t for t in row if not 0 <= t < vocab), None)
                if bad is not None:
                    raise HTTPException(
                        status_code=422,
                        detail=f"input_ids[{i}]: token id {bad} is outside the vocabulary [0, {vocab})",
                    )
            scores = await run_in_threadpool(scorer.score_ids, body.input_ids)
        return {"rewards": scores, "scores": scores}

    return HTTPGuard(app, token=token, max_body_bytes=max_body_bytes, limit_hint="--serve.max_body_bytes")


class RewardServer:
    """Serve ``app`` with uvicorn on ``host:port`` (port 0: a free one): in this thread (:meth:`run`) or
    a background one (:meth:`start` / :meth:`stop`)."""

    def __init__(self, app: Any, *, host: str = "127.0.0.1", port: int = 0) -> None:
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def run(self) -> None:
        self.server.run(sockets=[self.sock])

    def start(self, *, timeout_s: float = 30.0) -> "RewardServer":
        import time

        self._thread = threading.Thread(target=self.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"reward server on {self.url} did not start within {timeout_s} s")
            time.sleep(0.05)
        return self

    def stop(self, *, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
        self.sock.close()


def resolve_token(flag: str | None) -> str | None:
    """``--serve.token``, else the ``RLHF_REWARD_TOKEN`` environment variable, else None."""
    return flag or os.environ.get(TOKEN_ENV) or None
