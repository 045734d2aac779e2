"""An OpenAI-compatible HTTP server in front of an engine that records every call's exact tokens.

Agents written against the OpenAI API talk to ``base_url(session)``; each call's prompt token ids and
sampled token ids / logprobs are kept under that session, so training uses the tokens that were
actually sampled, not a re-tokenization of the text the agent saw.
"""

# No `from __future__ import annotations`: FastAPI reads the handlers' annotations at runtime.

import socket
import threading
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from rlhf_rollout.executors.base import agenerate
from rlhf_rollout.http_guard import HTTPGuard
from rlhf_rollout.types import Generation, SamplingParams

__all__ = ["CallRecord", "OpenAIServer"]


@dataclass(frozen=True, kw_only=True)
class CallRecord:
    """One ``/completions`` or ``/chat/completions`` call as the engine saw it."""

    session: str
    kind: str
    """``completion`` or ``chat``."""
    prompt_ids: list[int]
    generations: list[Generation]
    params: SamplingParams


class _BadRequest(ValueError):
    pass


class OpenAIServer:
    """``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models``, also under
    ``/sessions/{session}/v1/...``. Binds ``127.0.0.1`` by default; ``port=0`` picks a free port.

    Supported request fields: ``prompt`` (text or token ids) / ``messages``, ``max_tokens``,
    ``temperature``, ``top_p``, ``n``, ``seed``, and the extensions ``top_k``, ``stop_token_ids`` and
    ``return_token_ids`` (adds ``prompt_token_ids`` to the response and ``token_ids`` to each choice,
    so an agent can extend the exact token sequence instead of re-rendering text).
    ``stop`` strings are rejected (HTTP 400): they would cut sampled tokens at a text boundary.

    With ``api_key`` set every request must carry ``Authorization: Bearer <api_key>`` (what an OpenAI
    client sends for its ``api_key``), else 401; bodies over ``max_body_bytes`` get 413.
    """

    def __init__(
        self,
        *,
        engine: Any,
        tokenizer: Any,
        model_name: str = "policy",
        host: str = "127.0.0.1",
        port: int = 0,
        default_max_tokens: int = 256,
        api_key: str | None = None,
        max_body_bytes: int = 8 * 2**20,
    ) -> None:
        self.engine = engine
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.host = host
        self.port = port
        self.default_max_tokens = default_max_tokens
        self._records: dict[str, list[CallRecord]] = defaultdict(list)
        self._lock = threading.Lock()
        self._server = None
        self._thread: threading.Thread | None = None
        self.app = self._build_app()

    # --- records ---------------------------------------------------------------------------------------
    def records(self, session: str = "default") -> list[CallRecord]:
        with self._lock:
            return list(self._records.get(session, []))

    def pop_records(self, session: str = "default") -> list[CallRecord]:
        with self._lock:
            return self._records.pop(session, [])

    # --- lifecycle -------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def base_url(self, session: str = "default") -> str:
        """The ``base_url`` an OpenAI client uses to have its calls recorded under ``session``."""
        return f"{self.url}/v1" if session == "default" else f"{self.url}/sessions/{session}/v1"

    def start(self, *, timeout_s: float = 30.0) -> "OpenAIServer":
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        app = HTTPGuard(self.app, token=self.api_key, max_body_bytes=self.max_body_bytes)
        config = uvicorn.Config(app, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"OpenAI server on {self.url} did not start within {timeout_s} s")
            time.sleep(0.02)
        return self

    def stop(self, *, timeout_s: float = 10.0) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout_s)
            self._server = None

    def __enter__(self) -> "OpenAIServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- HTTP ------------------------------------------------------------------------------------------
    def _build_app(self):
        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse

        app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

        async def handle(kind: str, session: str, request: Request):
            try:
                try:
                    body = await request.json()
                except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
                    raise _BadRequest(f"request body is not JSON ({err})") from None
                if not isinstance(body, dict):
                    raise _BadRequest("request body must be a JSON object")
                return await self._serve(kind, session, body)
            except (_BadRequest, ValueError) as err:
                return JSONResponse(
                    status_code=400, content={"error": {"message": str(err), "type": "invalid_request_error"}}
                )

        for prefix in ("/v1", "/sessions/{session}/v1"):

            @app.post(f"{prefix}/completions")
            async def completions(request: Request, session: str = "default"):
                return await handle("completion", session, request)

            @app.post(f"{prefix}/chat/completions")
            async def chat(request: Request, session: str = "default"):
                return await handle("chat", session, request)

            @app.get(f"{prefix}/models")
            async def models(session: str = "default"):
                return {
                    "object": "list",
                    "data": [{"id": self.model_name, "object": "model", "owned_by": "rlhf"}],
                }

        return app

    def _params(self, body: dict) -> SamplingParams:
        if body.get("stop"):
            raise _BadRequest("'stop' strings are not supported; pass token ids as 'stop_token_ids'")

        def given(*names: str, default):
            """The first field the request sets (None counts as unset; 0 is a value, checked below)."""
            for name in names:
                if body.get(name) is not None:
                    return body[name]
            return default

        def typed(kind: type, *names: str, default):
            """The field as ``kind``; a value of another type is refused naming the field."""
            value = given(*names, default=default)
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not ok or (kind is int and isinstance(value, float) and not value.is_integer()):
                field = next((n for n in names if body.get(n) is not None), names[0])
                a = "an integer" if kind is int else "a number"
                raise _BadRequest(f"'{field}' must be {a}, got {value!r:.60}")
            return kind(value)

        stop_ids = given("stop_token_ids", default=[])
        if not isinstance(stop_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in stop_ids
        ):
            raise _BadRequest(f"'stop_token_ids' must be a list of token ids, got {stop_ids!r:.60}")
        seed = body.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise _BadRequest(f"'seed' must be an integer, got {seed!r:.60}")
        fields = dict(
            temperature=typed(float, "temperature", default=1.0),
            top_p=typed(float, "top_p", default=1.0),
            top_k=typed(int, "top_k", default=0),
            max_new_tokens=typed(int, "max_tokens", "max_completion_tokens", default=self.default_max_tokens),
            n=typed(int, "n", default=1),
        )
        try:
            return SamplingParams(**fields, stop_token_ids=tuple(stop_ids), seed=seed)
        except (TypeError, ValueError) as err:
            raise _BadRequest(f"bad sampling parameters: {err}") from err

    def _prompt_ids(self, kind: str, body: dict) -> list[int]:
        if kind == "chat":
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise _BadRequest("'messages' must be a non-empty list")
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            return list(ids)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return prompt
        raise _BadRequest("'prompt' must be a string or a list of token ids (one prompt per request)")

    async def _serve(self, kind: str, session: str, body: dict) -> dict:
        params = self._params(body)
        prompt_ids = self._prompt_ids(kind, body)
        gens = (await agenerate(self.engine, [prompt_ids], params))[0]
        with self._lock:
            self._records[session].append(
                CallRecord(session=session, kind=kind, prompt_ids=prompt_ids, generations=gens, params=params)
            )
        choices = []
        for k, g in enumerate(gens):
            text = self.tokenizer.decode(g.token_ids, skip_special_tokens=True)
            reason = "length" if g.finish_reason == "length" else "stop"
            if kind == "chat":
                choice = {
                    "index": k,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": reason,
                }
            else:
                choice = {"index": k, "text": text, "finish_reason": reason, "logprobs": None}
            if body.get("return_token_ids"):
                choice["token_ids"] = list(g.token_ids)
            choices.append(choice)
        completion_tokens = sum(len(g.token_ids) for g in gens)
        extra = {"prompt_token_ids": prompt_ids} if body.get("return_token_ids") else {}
        return {
            **extra,
            "id": f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": completion_tokens,
                "total_tokens": len(prompt_ids) + completion_tokens,
            },
        }
