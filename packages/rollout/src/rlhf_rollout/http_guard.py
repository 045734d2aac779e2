"""What every HTTP server of ours puts in front of its app: a bearer token and a body-size limit, as one
ASGI wrapper (no web framework needed)."""

from __future__ import annotations

import hmac
import json
from typing import Any

__all__ = ["HTTPGuard"]


class HTTPGuard:
    """ASGI middleware. With ``token`` set, a request whose ``Authorization`` header is not exactly
    ``Bearer <token>`` gets 401 (compared in constant time). A body over ``max_body_bytes`` gets 413
    before the app reads any of it (by ``Content-Length``, or while a chunked body arrives).
    ``limit_hint`` names the setting in the 413 message (e.g. the flag that raises it). Only HTTP is
    guarded: the apps behind it serve no WebSockets."""

    def __init__(
        self, app: Any, *, token: str | None, max_body_bytes: int, limit_hint: str = "max_body_bytes"
    ) -> None:
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
        if token is not None and not token.strip():
            raise ValueError("token is empty: give a token, or None for no authentication")
        self.app, self.max_body_bytes, self.limit_hint = app, max_body_bytes, limit_hint
        self._expected = f"Bearer {token}".encode() if token is not None else None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if self._expected is not None and not hmac.compare_digest(
            headers.get(b"authorization", b""), self._expected
        ):
            await _reply(send, 401, "missing or wrong bearer token")
            return
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await self._too_large(send)
            return
        body, more = b"", True
        while more:  # read the whole body first (chunked uploads have no Content-Length)
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, receive, send)  # a disconnect: let the app see it
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body_bytes:
                await self._too_large(send)
                return
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, send: Any) -> None:
        await _reply(send, 413, f"request body over the {self.max_body_bytes}-byte limit ({self.limit_hint})")


async def _reply(send: Any, status: int, detail: str) -> None:
    """``{"detail": ..., "error": {"message": ...}}``: FastAPI's shape and OpenAI's, so either client
    shows the reason."""
    body = json.dumps({"detail": detail, "error": {"message": detail, "type": "invalid_request_error"}})
    await send(
        {"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]}
    )
    await send({"type": "http.response.body", "body": body.encode()})
